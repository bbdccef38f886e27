"""Test doubles shipped with the library: fakes that stand in for hardware and services absent here."""
