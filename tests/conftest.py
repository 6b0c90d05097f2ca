"""Shared fixtures. Eight simulated CPU devices, so that sharding is exercised on any machine."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `pytest -n 2` two workers share the cores with XLA's own threads: PyTorch's OpenMP threads (the reference
# side of many tests) then spin against them and a torch test runs several times slower; one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# One compilation cache for the whole session, never the user's: the commands that tests run in subprocesses (a
# killed run, its resumption and the uninterrupted run it is compared with) compile the same programs, once.
# It starts empty, so every program compiles at least once per session; test_compile_cache.py sets its own.
if "BERTFORGE_COMPILE_CACHE" not in os.environ:
    os.environ["BERTFORGE_COMPILE_CACHE"] = _SESSION_CACHE = tempfile.mkdtemp(prefix="bertforge-test-cache-")
    atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

WORDS = (
    "the of and to in a is was for on that with as by at from his her it an were are which this be "
    "river city music game season film league army church school station album king war team story"
).split()


def make_corpus(path: Path, n_lines: int = 3000, seed: int = 0) -> Path:
    """Sentences of common and made-up words: enough structure for tokenizers to learn merges and pieces."""
    rng = random.Random(seed)
    invented = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10))) for _ in range(500)
    ]
    vocab = WORDS + invented
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(n_lines):
            words = [rng.choice(vocab) for _ in range(rng.randint(3, 24))]
            fh.write(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", and so on."]) + "\n")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def wordpiece_dir(corpus, tmp_path_factory) -> Path:
    from bertforge.tokenizer.train import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "wordpiece"
    train_tokenizer([str(corpus)], "wordpiece", 700, out, lowercase=True)
    return out


@pytest.fixture(scope="session")
def bpe_dir(corpus, tmp_path_factory) -> Path:
    from bertforge.tokenizer.train import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "bpe"
    train_tokenizer([str(corpus)], "bpe", 700, out)
    return out


@pytest.fixture(scope="session")
def model_dir(wordpiece_dir, tmp_path_factory) -> Path:
    """The `test` preset, freshly initialised, without dropout, with the test tokenizer."""
    from bertforge.model.architectures import build
    from bertforge.model.config import preset
    from bertforge.model.hf import save_pretrained
    from bertforge.tokenizer.load import Tokenizer

    tok = Tokenizer.load(wordpiece_dir)
    cfg = preset("test", vocab_size=tok.vocab_size, hidden_dropout=0.0, attention_dropout=0.0)
    return save_pretrained(build(cfg, "mlm"), tmp_path_factory.mktemp("model") / "test-bert", tok)


@pytest.fixture(scope="session")
def shards(tmp_path_factory, wordpiece_dir) -> Path:
    """Pretraining shards of 32 tokens from 400 generated documents, 5% held out."""
    from test_preprocess import make_documents, run

    tmp = tmp_path_factory.mktemp("pretrain-data")
    run(tmp, wordpiece_dir, make_documents(n_docs=400, seed=7), seq_len=32, valid_fraction=0.05)
    return tmp / "out"
