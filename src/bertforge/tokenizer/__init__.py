"""Tokenizers: loading any supported folder (load.py), training one (train.py), reading SentencePiece (spm.py)."""
