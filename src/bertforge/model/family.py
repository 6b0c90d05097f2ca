"""What a model family is: the record each family's module (bert.py, deberta.py, modernbert.py, electra.py,
distilbert.py) declares, and the table of those records that ModelConfig reads.

The family modules build on ModelConfig, so config.py cannot import them: architectures.py collects their records
and installs the table here, and bertforge/model/__init__.py imports architectures so that the table is complete
before any model module is used.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# The suffix of each head's transformers class after a family's hf_prefix.
HEAD_CLASSES = {
    "mlm": "ForMaskedLM",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "span": "ForQuestionAnswering",
    "choice": "ForMultipleChoice",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's name and its Hugging Face conventions beyond its sizes."""

    name: str  # bertforge's name for it, the model_type its config.json has
    hf_prefix: str  # of its class names: BertForMaskedLM, RobertaForSequenceClassification
    pad_token_id: int
    position_offset: int  # position rows before the first token's (RoBERTa: pad_token_id + 1)
    type_vocab_size: int
    layer_norm_eps: float
    special_ids: dict[str, int] = dataclasses.field(default_factory=dict)  # more config.json keys
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)  # more ModelConfig fields of its recipe
    model_types: tuple[str, ...] = ()  # other config.json model_types read as this family (XLM-R: RoBERTa)
    segments: bool = True  # its encoder takes segment_ids: rows packing several sequences
    # The longest input a config's positions allow, when that is not max_position_embeddings.
    max_seq_len: Callable[[Any], int] | None = None
    # The closed-form parameter count of an encoder and MLM head, where the family has one.
    num_params: Callable[[Any], int] | None = None

    def architecture(self, head: str) -> str:
        """Its transformers class of a model of `head` ('mlm', 'sequence', 'token', 'span' or 'choice'):
        BertForMaskedLM, ..."""
        return self.hf_prefix + HEAD_CLASSES[head]

    def apply(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A BERT config's fields (e.g. a preset's) with this family's conventions, for the same sequence length."""
        return {
            **fields,
            "pad_token_id": self.pad_token_id,
            "max_position_embeddings": fields["max_position_embeddings"] + self.position_offset,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            **self.fields,
        }


_TABLE: dict[str, Family] = {}


def install(families: Iterable[Family]) -> None:
    """Sets the table of every family by name (architectures.py does, from the family modules)."""
    _TABLE.clear()
    _TABLE.update((f.name, f) for f in families)


def table() -> Mapping[str, Family]:
    return types.MappingProxyType(_TABLE)


def lookup(name: str) -> Family:
    """The family called `name`; a ValueError naming the known ones for any other."""
    if not isinstance(name, str) or name not in _TABLE:
        raise ValueError(f"family {name!r} is not one of {', '.join(_TABLE)}")
    return _TABLE[name]


def installed() -> bool:
    """Whether the table is set: not yet while the family modules import (config.py builds its presets then)."""
    return bool(_TABLE)
