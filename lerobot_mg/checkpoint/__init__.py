"""Saving, checking, resuming and converting checkpoints (file names in layout.py)."""
