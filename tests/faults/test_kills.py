"""Kill -9 at random moments of preprocess, pretrain (in a step, in a checkpoint save), export and finetune; the
same command run again must give exactly what an uninterrupted run gives, and nothing half-written is taken whole."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from conftest import bertforge, kill_when, killer, rng, run_killed, run_ok, seeds
from flax import nnx
from test_finetune import FAST, river_rows, write_table
from test_preprocess import make_documents, write_text
from test_preprocess import run as run_preprocess
from test_pretrain import losses, params_of

from bertforge.model.load import load_run
from bertforge.train.checkpoint import damage

# The kills are timed against an uninterrupted run: `make test` runs these alone, after the rest, so that another
# test's load does not change the time a run takes between the reference and the kill.
pytestmark = pytest.mark.serial

PRETRAIN = ["--model.preset=test", "--train.global_batch=16", "--train.max_steps=30", "--optim.lr=3e-3",
            "--checkpoint.every=4", "--eval.every=10", "--log.every=1", "--log.tensorboard=false"]  # fmt: skip


# A test-sized ModernBERT: pre-norm, rotary positions, local and global attention, no biases.
MODERNBERT = ["--model.family=modernbert", "--model.intermediate_size=48", "--model.local_attention=8",
              "--model.global_attn_every_n_layers=2"]  # fmt: skip


# Replaced-token detection: an ELECTRA discriminator and a generator of half its width, DeBERTa-v3's sharing.
RTD = ["--objective=rtd", "--model.family=electra", "--model.embedding_size=16", "--rtd.generator_width=0.5",
       "--rtd.sharing=gdes"]  # fmt: skip


def pretrain_args(shards: Path, out: Path, *extra: str) -> list[str]:
    data = [] if "--sources" in extra else ["--data", str(shards)]  # a mixture names its folders itself
    phased = "--config" in extra  # the config of a run in phases: its phases' steps are the budget
    flags = [f for f in PRETRAIN if not (phased and f.startswith("--train.max_steps"))]
    return ["pretrain", *data, "--out", str(out), *flags, *extra]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    run_ok(bertforge(*pretrain_args(shards, out)))
    return out


def newest_whole_checkpoint(run: Path) -> int:
    steps = [int(p.name) for p in (run / "checkpoints").glob("*") if p.name.isdigit() and damage(p) is None]
    return max(steps, default=0)


def assert_same_run(reference: Path, run: Path) -> None:
    """Every logged metric of every step, and the final parameters, equal the uninterrupted run's."""
    for key in ("loss", "accuracy", "grad_norm", "lr", "valid_loss", "disc_accuracy", "gen_loss", "valid_disc_auc"):
        assert losses(run, key) == losses(reference, key), key
    for x, y in zip(params_of(reference), params_of(run), strict=True):
        np.testing.assert_array_equal(y, x)
    if yaml.safe_load((run / "config.yaml").read_text())["train"].get("ema"):
        ema = (nnx.state(load_run(r, weights="ema").model, nnx.Param) for r in (reference, run))
        for x, y in zip(*(jax.tree.leaves(e) for e in ema), strict=True):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    if (run / "config.yaml").read_text().count("objective: rtd"):
        for x, y in zip(params_of(reference, part="generator"), params_of(run, part="generator"), strict=True):
            np.testing.assert_array_equal(y, x)
    assert not list((run / "checkpoints").glob("*tmp*")), "a temporary checkpoint folder was left behind"


def resume_and_compare(shards: Path, reference: Path, run: Path, *extra: str) -> None:
    resumed_from = newest_whole_checkpoint(run)
    out = run_ok(bertforge(*pretrain_args(shards, run, *extra)))
    if resumed_from:
        assert f"resuming from step {resumed_from}" in out
    assert_same_run(reference, run)


def kill_at_a_random_step_and_resume(
    shards: Path, reference: Path, run: Path, stream: str, seed: int, *extra: str, steps: tuple[int, int] = (2, 28)
):
    """Kill -9 the run once it has logged a random step of `steps` (after a random delay), then run the same command
    again."""
    r = rng(stream, seed)
    step, delay = r.randint(*steps), r.uniform(0, 0.1)
    kill_when(bertforge(*pretrain_args(shards, run, *extra)), lambda: max(losses(run), default=0) >= step, delay)
    resume_and_compare(shards, reference, run, *extra)


@pytest.mark.parametrize("seed", seeds())
def test_pretrain_killed_at_a_random_step(shards, reference, tmp_path, tally, seed):
    tally("kill")
    kill_at_a_random_step_and_resume(shards, reference, tmp_path / "run", "step", seed)


@pytest.fixture(scope="module")
def modernbert_reference(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "modernbert"
    run_ok(bertforge(*pretrain_args(shards, out, *MODERNBERT)))
    return out


# In the slow set (make faults): every run of the suite kills a ModernBERT in the second phase of a phased run below.
@pytest.mark.parametrize("seed", seeds(fast=0))
def test_modernbert_pretrain_killed_at_a_random_step(shards, modernbert_reference, tmp_path, tally, seed):
    tally("kill")
    kill_at_a_random_step_and_resume(
        shards, modernbert_reference, tmp_path / "run", "modernbert-step", seed, *MODERNBERT
    )


@pytest.fixture(scope="module")
def rtd_reference(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "rtd"
    run_ok(bertforge(*pretrain_args(shards, out, *RTD)))
    return out


@pytest.fixture(scope="module")
def mixture(shards, wordpiece_dir, tmp_path_factory) -> tuple[list[str], Path]:
    """A mixture of `shards` and a small folder, with a moving average of the weights: (its flags, its reference)."""
    tmp = tmp_path_factory.mktemp("mixture")
    run_preprocess(tmp, wordpiece_dir, make_documents(n_docs=30, seed=11), name="small", seq_len=32, valid_fraction=0.1)
    flags = ["--sources", f"{shards}=0.7", f"{tmp / 'small'}=0.3", "--train.ema=0.9"]
    run_ok(bertforge(*pretrain_args(shards, tmp / "reference", *flags)))
    return flags, tmp / "reference"


# In the slow set (make faults): the loader's position and the optimizer's state resume as the kills above check in
# every run of the suite; this adds the mixture's order (data/mixture.py) and the moving average in the state.
@pytest.mark.parametrize("seed", seeds(fast=0))
def test_mixture_pretrain_with_a_moving_average_killed_at_a_random_step(shards, mixture, tmp_path, tally, seed):
    tally("kill")
    flags, reference = mixture
    kill_at_a_random_step_and_resume(shards, reference, tmp_path / "run", "mixture-step", seed, *flags)


@pytest.fixture(scope="module")
def phased(shards, wordpiece_dir, tmp_path_factory) -> tuple[list[str], Path]:
    """A ModernBERT in two phases (tasks/phases.py), 12 steps of 32 tokens at a 30% mask rate, then 18 of 64 tokens
    at 15% with a larger RoPE theta and a linear decay: (its flags, its reference)."""
    tmp = tmp_path_factory.mktemp("phases")
    run_preprocess(tmp, wordpiece_dir, make_documents(n_docs=200, seed=5), name="long", seq_len=64, valid_fraction=0.05)
    phases = [
        {"name": "short", "steps": 12, "mlm": {"rate": 0.3}},
        {"name": "long", "steps": 18, "data": {"shards": str(tmp / "long")}, "mlm": {"rate": 0.15},
         "optim": {"schedule": "linear", "warmup_steps": 0, "warmup_fraction": 0.0},
         "model": {"global_rope_theta": 320_000.0, "max_position_embeddings": 64}},
    ]  # fmt: skip
    (tmp / "phases.yaml").write_text(yaml.safe_dump({"phases": phases}))
    flags = ["--config", str(tmp / "phases.yaml"), *MODERNBERT, "--model.max_position_embeddings=32"]
    run_ok(bertforge(*pretrain_args(shards, tmp / "reference", *flags)))
    return flags, tmp / "reference"


@pytest.mark.parametrize("seed", seeds())
def test_phased_pretrain_killed_in_its_second_phase(shards, phased, tmp_path, tally, seed):
    tally("kill")
    flags, reference = phased
    kill_at_a_random_step_and_resume(shards, reference, tmp_path / "run", "phase-step", seed, *flags, steps=(13, 28))


# Every seed is in the slow set (make faults): the resume path is the one the BERT and ModernBERT kills above check in
# every run of the suite; this adds the generator and discriminator pair's state.
@pytest.mark.parametrize("seed", seeds(fast=0))
def test_rtd_pretrain_killed_at_a_random_step(shards, rtd_reference, tmp_path, tally, seed):
    tally("kill")
    kill_at_a_random_step_and_resume(shards, rtd_reference, tmp_path / "run", "rtd-step", seed, *RTD)


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_pretrain_killed_inside_a_checkpoint_save(shards, reference, tmp_path, tally, seed):
    tally("kill")
    r = rng("save", seed)
    # Saves at steps 4, 8, ..., 28; the timer fires while orbax writes, renames or deletes in the background.
    spec = f"after:bertforge.train.checkpoint:Checkpoints.save:{r.randint(1, 7)}:{r.uniform(0.001, 0.12):.4f}"
    run_killed(killer(spec, *pretrain_args(shards, tmp_path / "run")))
    resume_and_compare(shards, reference, tmp_path / "run")


# A long run: `make faults` runs it with the rest of the kill suite.
@pytest.mark.slow
def test_pretrain_killed_after_the_data_is_written_and_before_the_rename(shards, reference, tmp_path, tally):
    """The narrowest moment of a save: every array on disk, its checksums about to be written, no rename yet."""
    tally("kill", 2)
    run = tmp_path / "run"
    run_killed(killer("after:bertforge.train.checkpoint:write_checksums:3:0", *pretrain_args(shards, run)))
    assert newest_whole_checkpoint(run) == 8 and list((run / "checkpoints").glob("12.orbax-checkpoint-tmp"))
    run_killed(killer("inside:bertforge.train.checkpoint:write_checksums:40", *pretrain_args(shards, run)))
    resume_and_compare(shards, reference, run)


# ------------------------------------------------------------------------------------------------------ export
def export_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def exports(reference, tmp_path_factory) -> dict:
    """The reference run's export at its end and at step 28, and how many calls an export makes."""
    root = tmp_path_factory.mktemp("exports")
    run_ok(bertforge("export", str(reference), "--out", str(root / "old"), "--step", "28"))
    count = killer("count:bertforge.model.hf:save_pretrained", "export", str(reference), "--out", str(root / "new"))
    out = run_ok(count)
    calls = int(out.split("calls: ")[1].split()[0])
    return {"new": export_files(root / "new"), "old": export_files(root / "old"), "calls": calls, "root": root}


@pytest.mark.parametrize("seed", seeds())
def test_export_killed_while_writing(reference, exports, tmp_path, tally, seed):
    tally("kill")
    r = rng("export", seed)
    out = tmp_path / "hf"
    if seed % 2:  # over an older export of the same run
        shutil.copytree(exports["root"] / "old", out)
    k = r.randint(1, exports["calls"] - 1)
    run_killed(killer(f"inside:bertforge.model.hf:save_pretrained:{k}", "export", str(reference), "--out", str(out)))
    if (out / "config.json").exists():  # loadable, so it must be one whole export: the old one or the new one
        assert export_files(out) in (exports["old"], exports["new"])
    run_ok(bertforge("export", str(reference), "--out", str(out)))
    assert export_files(out) == exports["new"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary export folder was left"


# ------------------------------------------------------------------------------------------------------ finetune
FINETUNE = [*FAST, "--folds", "2", "--train.epochs=3", "--train.evals_per_epoch=2"]


def finetune_args(model_dir: Path, data: Path, out: Path) -> list[str]:
    return ["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), *FINETUNE]


def finetune_outputs(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    return {
        "oof": (run / "oof.csv").read_text(),
        "scores": [f["score"] for f in summary["folds"]],
        "models": [(run / f"fold-{f}" / "model" / "model.safetensors").read_bytes() for f in (0, 1)],
    }


@pytest.fixture(scope="module")
def finetune_reference(model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("finetune")
    data = write_table(root / "train.csv", river_rows(64, seed=5))
    # Timed on a second run, as task_reference times the others: with packed rows a first run is mostly compilation.
    run_ok(bertforge(*finetune_args(model_dir, data, root / "cold")))
    started = time.perf_counter()
    run_ok(bertforge(*finetune_args(model_dir, data, root / "run")))
    return {"data": data, "seconds": time.perf_counter() - started, **finetune_outputs(root / "run")}


def kill_then_rerun(args: list[str], seconds: float) -> None:
    """Kill -9 the command `seconds` after it starts, then run the same command again to its end."""
    started = time.perf_counter()
    kill_when(bertforge(*args), lambda: time.perf_counter() - started > seconds, 0)
    run_ok(bertforge(*args))


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_finetune_killed_at_a_random_moment(model_dir, finetune_reference, tmp_path, tally, seed):
    tally("kill")
    run = tmp_path / "run"
    fraction = rng("finetune", seed).uniform(0.35, 0.9)
    kill_then_rerun(finetune_args(model_dir, finetune_reference["data"], run), fraction * finetune_reference["seconds"])
    got = finetune_outputs(run)
    assert got == {k: finetune_reference[k] for k in got}


def task_reference(model_dir: Path, root: Path, data: Path, *extra: str) -> dict:
    """A fine-tuning run of another task to its end, uninterrupted: its command, time and outputs. Timed on a
    second run, whose programs come from the compile cache as the killed runs' do: a first run's time is mostly
    compilation, and a kill at a share of it would often come after a warm run's end."""
    run_ok(bertforge(*finetune_args(model_dir, data, root / "cold"), *extra))
    args = [*finetune_args(model_dir, data, root / "run"), *extra]
    started = time.perf_counter()
    run_ok(bertforge(*args))
    return {"args": args, "seconds": time.perf_counter() - started, **finetune_outputs(root / "run")}


def killed_like(reference: dict, run: Path, fraction: float) -> dict:
    """The reference's command into `run`, killed at `fraction` of the reference's time and run again to its end:
    its outputs."""
    out = reference["args"][reference["args"].index("--out") + 1]
    kill_then_rerun([str(run) if a == out else a for a in reference["args"]], fraction * reference["seconds"])
    return finetune_outputs(run)


@pytest.fixture(scope="module")
def packed_reference(model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packed")
    data = write_table(root / "train.csv", river_rows(64, seed=5))
    return task_reference(model_dir, root, data, "--data.pack=true")


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_packed_finetune_killed_at_a_random_moment(model_dir, packed_reference, tmp_path, tally, seed):
    # Packed rows: micro-batches whose gradients add up within a step, which a kill must not leave half-added.
    tally("kill")
    fraction = rng("packed", seed).uniform(0.35, 0.9)
    got = killed_like(packed_reference, tmp_path / "run", fraction)
    assert got == {k: packed_reference[k] for k in got}


@pytest.fixture(scope="module")
def token_reference(model_dir, tmp_path_factory) -> dict:
    from test_token_classification import tagged_sentences, write_jsonl

    root = tmp_path_factory.mktemp("tokens")
    data = write_jsonl(root / "train.jsonl", tagged_sentences(64, seed=5))
    return task_reference(model_dir, root, data, "--task", "token-classification", "--max-length", "16",
                          "--data.pack=true")  # fmt: skip


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_token_classification_killed_at_a_random_moment(model_dir, token_reference, tmp_path, tally, seed):
    tally("kill")
    got = killed_like(token_reference, tmp_path / "run", rng("tokens", seed).uniform(0.2, 0.6))
    assert got == {k: token_reference[k] for k in got}


@pytest.fixture(scope="module")
def qa_reference(model_dir, tmp_path_factory) -> dict:
    from test_question_answering import _squad

    root = tmp_path_factory.mktemp("questions")
    data = _squad(root / "train.json", 32, seed=5)
    return task_reference(model_dir, root, data, "--task", "question-answering", "--max-length", "32", "--stride", "8",
                          "--data.pack=true")  # fmt: skip


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_question_answering_killed_at_a_random_moment(model_dir, qa_reference, tmp_path, tally, seed):
    tally("kill")
    got = killed_like(qa_reference, tmp_path / "run", rng("questions", seed).uniform(0.2, 0.6))
    assert got == {k: qa_reference[k] for k in got}


@pytest.fixture(scope="module")
def choice_reference(model_dir, tmp_path_factory) -> dict:
    from test_multiple_choice import choice_records, write_csv

    root = tmp_path_factory.mktemp("choices")
    data = write_csv(root / "train.csv", choice_records(96, seed=5))
    return task_reference(model_dir, root, data, "--task", "multiple-choice", "--max-length", "40", "--data.pack=true")


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_multiple_choice_killed_at_a_random_moment(model_dir, choice_reference, tmp_path, tally, seed):
    tally("kill")
    got = killed_like(choice_reference, tmp_path / "run", rng("choices", seed).uniform(0.2, 0.6))
    assert got == {k: choice_reference[k] for k in got}


@pytest.fixture(scope="module")
def embedding_reference(model_dir, tmp_path_factory) -> dict:
    from test_embedding import pair_rows, write_rows

    root = tmp_path_factory.mktemp("embedding")
    data = write_rows(root / "train.csv", pair_rows(96, seed=5))
    return task_reference(model_dir, root, data, "--task", "embedding", "--max-length", "16", "--text-column",
                          "query", "--text-pair-column", "passage", "--negative-column", "negative",
                          "--data.pack=true")  # fmt: skip


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_embedding_killed_at_a_random_moment(model_dir, embedding_reference, tmp_path, tally, seed):
    tally("kill")
    got = killed_like(embedding_reference, tmp_path / "run", rng("embedding", seed).uniform(0.2, 0.6))
    assert got == {k: embedding_reference[k] for k in got}


# ------------------------------------------------------------------------------------------------------ suite
def suite_args(model_dir: Path, root: Path, out: Path, *flags: str) -> list[str]:
    """A suite of one regression task, 1 learning rate and 2 seeds (two units), each a short fine-tuning run."""
    return ["suite", "--suite", str(root / "suite.yaml"), "--data", str(root), "--model", str(model_dir), "--out",
            str(out), *flags, *FAST, "--train.epochs=2"]  # fmt: skip


@pytest.fixture(scope="module")
def suite_reference(model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("suite")
    write_table(root / "train.csv", river_rows(48, seed=5))
    write_table(root / "valid.csv", river_rows(24, seed=6))
    (root / "suite.yaml").write_text(
        "name: rivers\nsource: here\nseeds: 2\nlrs: [3.0e-3]\nbatch_size: 16\nmax_length: 32\ntasks:\n"
        "  rivers: {name: Rivers, task: regression, train: train.csv, valid: valid.csv, text: text, "
        "target: target, metrics: [pearson, spearman]}\n"
    )
    run_ok(bertforge(*suite_args(model_dir, root, root / "cold")))  # timed warm, as task_reference's runs are
    started = time.perf_counter()
    run_ok(bertforge(*suite_args(model_dir, root, root / "run")))
    board = json.loads((root / "run" / "scoreboard.json").read_text())
    return {"root": root, "seconds": time.perf_counter() - started, "board": board}


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_suite_killed_at_a_random_moment(model_dir, suite_reference, tmp_path, tally, seed):
    # The suite's process killed, its unit's finetune with it: run again, the finished unit is kept, the killed one
    # resumes, and the scoreboard is the uninterrupted suite's, to the last bit of every seed's score.
    tally("kill")
    fraction = rng("suite", seed).uniform(0.2, 0.9)
    kill_then_rerun(suite_args(model_dir, suite_reference["root"], tmp_path / "out"),
                    fraction * suite_reference["seconds"])  # fmt: skip
    assert json.loads((tmp_path / "out" / "scoreboard.json").read_text()) == suite_reference["board"]


@pytest.mark.parametrize("seed", seeds(fast=0))
def test_suite_of_units_at_once_killed_at_a_random_moment(model_dir, suite_reference, tmp_path, tally, seed):
    # Both units at once in two slots of the one device (--devices 0,0), the suite killed with both running: run
    # again, the scoreboard is the one of the units run one after another, uninterrupted.
    tally("kill")
    fraction = rng("suite-at-once", seed).uniform(0.2, 0.5)
    kill_then_rerun(suite_args(model_dir, suite_reference["root"], tmp_path / "out", "--devices", "0,0"),
                    fraction * suite_reference["seconds"])  # fmt: skip
    assert json.loads((tmp_path / "out" / "scoreboard.json").read_text()) == suite_reference["board"]


# ------------------------------------------------------------------------------------------------------ preprocess
def preprocess_args(wordpiece_dir: Path, corpus: Path, out: Path) -> list[str]:
    return ["preprocess", "--tokenizer", str(wordpiece_dir), "--files", str(corpus), "--out", str(out),
            "--seq-len", "32", "--shard-size", "300", "--workers", "2"]  # fmt: skip


def shard_folder(out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["stats"], manifest["settings"]["out"]
    return {"manifest": manifest, **{p.name: p.read_bytes() for p in out.glob("*.npy")}}


@pytest.fixture(scope="module")
def preprocess_reference(wordpiece_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("preprocess")
    corpus = write_text(root / "corpus.txt", make_documents(n_docs=40000, seed=11))
    started = time.perf_counter()
    run_ok(bertforge(*preprocess_args(wordpiece_dir, corpus, root / "out")))
    return {"corpus": corpus, "seconds": time.perf_counter() - started, "out": shard_folder(root / "out")}


@pytest.mark.parametrize("seed", seeds())
def test_preprocess_killed_at_a_random_moment(wordpiece_dir, preprocess_reference, tmp_path, tally, seed):
    tally("kill")
    out = tmp_path / "out"
    fraction = rng("preprocess", seed).uniform(0.3, 0.95)
    args = preprocess_args(wordpiece_dir, preprocess_reference["corpus"], out)
    kill_then_rerun(args, fraction * preprocess_reference["seconds"])
    assert shard_folder(out) == preprocess_reference["out"]
