"""bertforge: pretrain and fine-tune BERT-family masked language models with JAX."""

__version__ = "0.1.0"
