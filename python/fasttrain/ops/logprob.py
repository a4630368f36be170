"""Placeholder: lands with its issue."""
__all__: list[str] = []
