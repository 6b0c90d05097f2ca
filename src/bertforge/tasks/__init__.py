"""Tasks: each a Config dataclass and main(cfg)."""
