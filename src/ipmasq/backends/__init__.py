"""Backends: the only code that runs kernel tools (see backends.base for the interface)."""
