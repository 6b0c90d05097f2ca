"""Tokenizers: loading any supported folder (load.py), training one (train.py: SentencePiece's trainer in
spm_train.py, the lines it reads in corpus.py), reading SentencePiece model files (spm.py)."""
