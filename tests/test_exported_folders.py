"""Every folder bertforge exports loads in transformers with its Auto class and nothing missing, unexpected or
mismatched: each family under each head. An embedding folder of BERT or RoBERTa carries the pooler that
transformers' AutoModel builds and no sentence embedding uses, its base model's where the base had one."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file
from test_token_heads import CASES, reference

import bertforge
from bertforge.card import AUTO
from bertforge.model.hf import save_pretrained
from bertforge.model.load import load_model

HEADS = ("mlm", "sequence", "token", "span", "choice", "embedding")


@pytest.mark.parametrize("family", sorted(CASES))
def test_every_head_exports_a_folder_that_transformers_loads_whole(family, request, tmp_path):
    folder, _ = reference(family, "MaskedLM", request, tmp_path / "base")
    for head in HEADS:
        pre = load_model(folder, head=head, num_labels=None if head in ("mlm", "embedding") else 3)
        out = bertforge.save(pre.model, tmp_path / head, pre.tokenizer)
        auto = getattr(transformers, AUTO[head])
        _, info = auto.from_pretrained(str(out), output_loading_info=True)
        loose = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
        assert not loose, (head, loose)


def test_an_embedding_folder_keeps_its_base_models_pooler(request, tmp_path):
    base, _ = reference("bert", "SequenceClassification", request, tmp_path / "base")
    stored = load_file(str(base / "model.safetensors"))
    pre = load_model(base, head="embedding")
    out = save_pretrained(pre.model, tmp_path / "embedding", pre.tokenizer, base=base)
    written = load_file(str(out / "model.safetensors"))
    for name in ("pooler.dense.weight", "pooler.dense.bias"):
        np.testing.assert_array_equal(written[name], stored[f"bert.{name}"])
