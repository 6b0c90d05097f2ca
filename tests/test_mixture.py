"""Mixtures of shard folders (data.sources): each source's share of the rows against its weight, each source read
epoch by epoch, the same rows after a stop and a continuation as without, per-source validation, one-line mistakes."""

from __future__ import annotations

import numpy as np
import pytest
from test_preprocess import make_documents, run
from test_pretrain import config

from bertforge.cli import data_as_sources
from bertforge.cli import main as cli
from bertforge.data.mixture import (
    MixedShards,
    MixtureLoader,
    mixture_weights,
    parse_sources,
    rows_given,
    training_shards,
)
from bertforge.errors import UserError
from bertforge.tasks import pretrain
from bertforge.train.metrics_log import read_metrics


@pytest.fixture(scope="module")
def small(tmp_path_factory, wordpiece_dir):
    """A second folder of the same tokenizer and length, about a thirteenth of the size of `shards`."""
    tmp = tmp_path_factory.mktemp("mixture")
    run(tmp, wordpiece_dir, make_documents(n_docs=30, seed=11), name="small", seq_len=32, valid_fraction=0.1)
    return tmp / "small"


def test_rows_given_are_within_one_row_of_each_share_at_every_point():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.dirichlet(np.ones(rng.integers(2, 6)))
        for n in range(0, 3000, 7):
            given = rows_given(n, w)
            assert given.sum() == n and (given >= 0).all()
            assert np.abs(given - n * w).max() < 1.0 + 1e-9


def test_temperature_weighs_sources_by_their_size_to_its_power():
    np.testing.assert_allclose(mixture_weights([100, 900], [None, None], 0.5), [10 / 40, 30 / 40])
    np.testing.assert_allclose(mixture_weights([100, 900], [None, None], None), [0.1, 0.9])
    np.testing.assert_allclose(mixture_weights([100, 900], [3.0, 1.0], None), [0.75, 0.25])


def test_each_source_gives_its_share_and_is_read_whole_before_it_repeats(shards, small):
    mix = MixedShards(parse_sources([f"{shards}=0.7", f"{small}=0.3"]), "train")
    loader = MixtureLoader(mix, 16, seed=3, prefetch=0)
    n_big, n_small = (p.num_sequences for p in mix.parts)
    steps = n_small // 2 + 3  # the small source (4.8 of 16 rows a step) is read more than twice, the large one once
    rows = np.concatenate([loader.global_indices(k) for k in range(steps)])
    small_rows = rows[rows >= n_big] - n_big
    big_rows = rows[rows < n_big]
    assert abs(len(small_rows) / len(rows) - 0.3) <= 1 / len(rows)  # exact to the row: no sampling noise
    assert len(big_rows) < n_big and len(set(big_rows.tolist())) == len(big_rows)  # never twice before exhausted
    epochs, _ = divmod(len(small_rows), n_small)
    counts = np.bincount(small_rows, minlength=n_small)  # every row read `epochs` times, some once more
    assert epochs >= 2 and set(counts.tolist()) <= {epochs, epochs + 1}
    assert loader.state_dict()["mixture"] == "out=0.7,small=0.3"
    # A position taken with other weights (--resume from another run) would read other rows: refused.
    other = MixtureLoader(MixedShards(parse_sources([f"{shards}=0.5", f"{small}=0.5"]), "train"), 16, 3, prefetch=0)
    with pytest.raises(UserError, match="taken with the mixture out=0.7,small=0.3, this run has out=0.5,small=0.5"):
        other.load_state_dict(loader.state_dict())
    # The rows are those of the folders, in a batch shuffled together.
    batch = loader.local_rows(5)
    np.testing.assert_array_equal(batch, mix.rows(loader.global_indices(5)))
    assert len(set(np.unique(loader.global_indices(0) >= n_big))) == 2  # both sources in a batch


def test_a_stopped_and_continued_mixture_reads_and_learns_what_an_unbroken_one_does(shards, small, tmp_path):
    sources = {"data": {"shards": "", "sources": [f"{shards}=0.6", f"{small}=0.4"]}, "optim": {"schedule": "constant"}}
    for out, budgets in (("unbroken", (12,)), ("continued", (6, 12))):
        for steps in budgets:
            cfg = config(shards, train={"max_steps": steps}, eval={"every": 6}, checkpoint={"every": 6}, **sources)
            pretrain.main(cfg, str(tmp_path / out))
    a, b = (read_metrics(tmp_path / out) for out in ("unbroken", "continued"))
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    last = next(r for r in reversed(a) if "tokens_by_source" in r)
    assert last["tokens_by_source"] == {"out": round(12 * 16 * 0.6) * 32, "small": (192 - round(192 * 0.6)) * 32}
    valid = next(r for r in reversed(a) if "valid_loss" in r)
    shares = MixedShards(parse_sources(sources["data"]["sources"]), "valid").weights
    assert valid["valid_loss"] == pytest.approx(
        shares[0] * valid["valid_loss_out"] + shares[1] * valid["valid_loss_small"]
    )


def test_a_continued_run_with_other_weights_is_refused(shards, small, tmp_path, capsys):
    args = ["pretrain", "--out", str(tmp_path / "run"), "--model.preset=test", "--train.max_steps=2",
            "--train.global_batch=16", "--checkpoint.every=2", "--log.tensorboard=false"]  # fmt: skip
    assert cli([*args, "--data", f"{shards}=0.5", "--data", f"{small}=0.5"]) == 0  # fairseq's spelling
    code = cli([*args, "--train.max_steps=4", "--sources", f"{shards}=0.9", f"{small}=0.1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "this run has data.sources: [" in err and f"{small}=0.1']" in err, err
    assert cli([*args, "--train.max_steps=4", "--sources", f"{shards}=0.5", f"{small}=0.5"]) == 0  # the same mixture


def test_repeated_data_flags_are_a_mixture_and_one_stays_a_folder():
    assert data_as_sources(["pretrain", "--data", "a=0.7", "--data=b=0.3", "--out", "r"]) == [
        "pretrain", "--out", "r", "--sources", "a=0.7", "b=0.3"]  # fmt: skip
    assert data_as_sources(["pretrain", "--data", "a", "--data", "b"])[-3:] == ["--sources", "a", "b"]
    assert data_as_sources(["pretrain", "--data", "runs/x=y", "--data.temperature=0.5"]) == [
        "pretrain", "--data", "runs/x=y", "--data.temperature=0.5"]  # fmt: skip
    with pytest.raises(UserError, match="not both"):
        data_as_sources(["pretrain", "--data", "a=1", "--sources", "b=1"])


@pytest.mark.parametrize(
    ("entries", "extra", "line"),
    [
        (["{shards}=0.5", "{shards}=0.5"], {}, "two sources are named 'out'"),
        (["{shards}=-1", "{small}=1"], {}, "'{shards}=-1' is not PATH=WEIGHT with a positive weight, or PATH"),
        (["{shards}=0.5", "{small}"], {}, "give every source a weight (PATH=WEIGHT) or none"),
        (
            ["{shards}=0.5", "{small}=0.5"],
            {"temperature": 0.3},
            "data.temperature weighs sources given without weights",
        ),
        (["{shards}", "{bpe}"], {}, "differ in tokenizer"),
    ],
)
def test_a_wrong_mixture_is_one_line(shards, small, bpe_shards, tmp_path, capsys, entries, extra, line):
    paths = {"shards": shards, "small": small, "bpe": bpe_shards}
    sources = [e.format(**paths) for e in entries]
    args = ["pretrain", "--out", str(tmp_path / "run"), "--model.preset=test", "--train.max_steps=1",
            "--sources", *sources, *[f"--data.{k}={v}" for k, v in extra.items()]]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert line.format(**paths) in err.splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture(scope="module")
def bpe_shards(tmp_path_factory, bpe_dir):
    tmp = tmp_path_factory.mktemp("mixture-bpe")
    run(tmp, bpe_dir, make_documents(n_docs=40, seed=2), name="bpe", seq_len=32, valid_fraction=0.1)
    return tmp / "bpe"


def test_one_folder_and_a_mixture_are_not_both_given(shards, small):
    with pytest.raises(UserError, match=r"give data.shards \(one folder, --data\) or data.sources"):
        training_shards(str(shards), [str(small)], None, "train")
    with pytest.raises(UserError, match="data.temperature weighs the folders of data.sources"):
        training_shards(str(shards), [], 0.5, "train")
