"""Data: tables of texts, corpora, shards."""
