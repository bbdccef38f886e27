"""Fault injectors shared by the chaos suite and the live chaos command."""
