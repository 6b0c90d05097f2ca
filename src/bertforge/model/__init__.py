"""bertforge models."""
