"""The single-controller runtime on Ray."""
