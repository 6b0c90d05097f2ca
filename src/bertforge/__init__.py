"""bertforge: pretrain and fine-tune BERT-family masked language models with JAX.

The Python API mirrors the command line:

    import bertforge
    tok = bertforge.train_tokenizer(["corpus.txt"], "wordpiece", 16000, "tok/")
    pre = bertforge.load("path/or/hub-id")            # model + tokenizer
    bertforge.fill_mask(pre, ["Paris is the [MASK] of France."])
    bertforge.predict(pre, ["a text", "another"])     # (N, num_labels)
    summary = bertforge.finetune("configs/finetune/commonlit-minilm.yaml", out="run", model="path/or/hub-id")
    bertforge.predict("run", ["a text"])              # the mean of the run's fold models
    bertforge.labels("run")                           # the names of predict's columns
    bertforge.entities("ner-run", ["a text"])         # a token-classification run's entities per text
    bertforge.embed("sentence-folder", ["a text"])    # (N, D) vectors of an embedding model
    bertforge.evaluate("run", "test.csv")             # the run's metrics on labelled data, as fine-tuning reports them
    bertforge.save(pre.model, "export/", pre.tokenizer)
"""

from __future__ import annotations

from typing import Any


def version() -> str:
    """This bertforge's version, from the installed package's metadata; 'unknown' when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("bertforge")
    except PackageNotFoundError:
        return "unknown"


# Imported on first use, so that `bertforge --help` does not wait for JAX.
_API = {
    "load": ("bertforge.model.load", "load_model"),
    "save": ("bertforge.model.hf", "save_pretrained"),
    "train_tokenizer": ("bertforge.tokenizer.train", "train_tokenizer"),
    "load_tokenizer": ("bertforge.tokenizer.load", "Tokenizer.load"),
    "fill_mask": ("bertforge.api", "fill_mask"),
    "predict": ("bertforge.api", "predict"),
    "labels": ("bertforge.api", "labels"),
    "entities": ("bertforge.api", "entities"),
    "embed": ("bertforge.api", "embed"),
    "evaluate": ("bertforge.api", "evaluate"),
    "finetune": ("bertforge.api", "finetune"),
    "pretrain": ("bertforge.api", "pretrain"),
}
__all__ = list(_API)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        return version()  # read when asked: the metadata lookup is not free
    if name not in _API:
        raise AttributeError(f"module 'bertforge' has no attribute {name!r}")
    import importlib

    from bertforge.runtime import compile_cache

    compile_cache.enable()  # before the API's first compilation, as the CLI does

    module, attr = _API[name]
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
