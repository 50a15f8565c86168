"""The jaxpar version (one place; the package face and checkpoints read it)."""

__version__ = "0.1.0"
