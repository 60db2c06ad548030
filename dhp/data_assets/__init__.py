"""Data shipped with dhp: ``demo/`` is a small real captioning set (see demo/README.md)."""
