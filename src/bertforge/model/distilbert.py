"""Placeholder: this architecture is being written."""
