"""A full disk during a checkpoint, an export or preprocessing: one clear line, nothing half-written, the previous
checkpoint intact, and the same command finishes the job once there is space again. The disk is a small tmpfs in
a private mount namespace (needs root or user namespaces; skipped where neither is allowed)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import bertforge, run_ok
from test_kills import PRETRAIN, export_files, preprocess_args, shard_folder
from test_preprocess import make_documents, write_text
from test_pretrain import losses, params_of

from bertforge.train.checkpoint import damage


def _namespaces_allowed() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _namespaces_allowed(), reason="cannot mount a tmpfs in a mount namespace here")


def on_small_disk(tmp_path: Path, size_kib: int, cmd: list[str]) -> list[dict]:
    """Run `cmd` with its outputs on a tmpfs of `size_kib`, then again after the disk is grown to 64 MiB. Returns,
    for each attempt, its exit code, its stderr and a copy of the disk as it was left."""
    disk, script = tmp_path / "disk", []
    disk.mkdir()
    script.append(f"mount -t tmpfs -o size={size_kib}k tmpfs {disk} || exit 77")
    for attempt in (1, 2):
        out = tmp_path / f"attempt-{attempt}"
        script.append(f"mkdir -p {out}/disk; {shlex.join(cmd)} >{out}/stdout 2>{out}/stderr; echo $? >{out}/rc")
        script.append(f"cp -a {disk}/. {out}/disk/")
        script.append(f"mount -o remount,size=64m {disk}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", "\n".join(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [
        {"rc": int((d / "rc").read_text()), "stderr": (d / "stderr").read_text(), "disk": d / "disk"}
        for d in (tmp_path / "attempt-1", tmp_path / "attempt-2")
    ]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    run_ok(bertforge("pretrain", "--data", str(shards), "--out", str(out), *PRETRAIN, "--checkpoint.every=5"))
    return out


def check_resumed(reference: Path, first: dict, second: dict, saved: int) -> None:
    run = first["disk"] / "run"
    assert [p.name for p in (run / "checkpoints").iterdir() if damage(p) is None] == [str(saved)]
    assert second["rc"] == 0, second["stderr"][-3000:]
    assert f"resuming from step {saved}" in second["stderr"]
    run = second["disk"] / "run"
    for key in ("loss", "valid_loss"):
        assert losses(run, key) == losses(reference, key)
    for x, y in zip(params_of(reference), params_of(run), strict=True):
        np.testing.assert_array_equal(y, x)


def pretrain_filling_the_disk(shards: Path, tmp_path: Path, check_space: bool) -> list[str]:
    """A pretraining command on `tmp_path`/disk during which another program fills the disk, once, just before
    checkpoint 10, leaving 64 KiB free: checkpoint 10 cannot fit, and the second attempt, on the grown disk, has
    room. With `check_space` false, as if the disk filled after the space check. (A disk sized to hold exactly one
    checkpoint would not do: how much room a checkpoint takes, also while in progress, varies from run to run.)"""
    args = ["pretrain", "--data", str(shards), "--out", str(tmp_path / "disk" / "run"), *PRETRAIN,
            "--checkpoint.every=5"]  # fmt: skip
    code = (
        "import shutil, sys; from bertforge.train.checkpoint import Checkpoints; from bertforge.cli import main\n"
        "check_space = Checkpoints._check_space\n"
        "def fill(self, step, state):\n"
        "    filler = self.directory.parent.parent / 'filler'\n"
        "    if step == 10 and not filler.exists():\n"
        "        filler.write_bytes(bytes(shutil.disk_usage(self.directory).free - 65536))\n"
        f"    if {check_space}:\n"
        "        check_space(self, step, state)\n"
        "Checkpoints._check_space = fill\n"
        f"sys.exit(main({args!r}))"
    )
    return [sys.executable, "-c", code]


def test_a_checkpoint_that_cannot_fit_is_refused_before_it_starts(shards, reference, tmp_path, tally):
    tally("disk")
    first, second = on_small_disk(tmp_path, 4096, pretrain_filling_the_disk(shards, tmp_path, check_space=True))
    assert first["rc"] == 2
    line = last_line(first["stderr"])
    assert line.startswith(f"error: {tmp_path}/disk/run/checkpoints: 0.1 MiB free, checkpoint 10 needs up to ")
    assert line.endswith("checkpoint 5 is whole. Free space and run the same command to continue")
    assert "Traceback" not in first["stderr"]
    check_resumed(reference, first, second, 5)


def test_a_disk_that_fills_during_a_save_is_reported_and_the_previous_checkpoint_kept(
    shards, reference, tmp_path, tally
):
    """orbax's writes fail midway."""
    tally("disk")
    first, second = on_small_disk(tmp_path, 4096, pretrain_filling_the_disk(shards, tmp_path, check_space=False))
    assert first["rc"] == 2
    line = last_line(first["stderr"])
    assert line.startswith(f"error: {tmp_path}/disk/run/checkpoints: could not save checkpoint 10 (No space left")
    assert line.endswith("checkpoint 5 is whole. Free space and run the same command to continue")
    # orbax's writer threads fail one by one, and tensorstore's writes still in flight land on closed event loops:
    # none of that reaches the user, whose one line says it all.
    assert "Traceback" not in first["stderr"] and "ERROR" not in first["stderr"], first["stderr"][:3000]
    check_resumed(reference, first, second, 5)


def test_an_export_onto_a_full_disk_leaves_nothing_and_succeeds_later(reference, tmp_path, tally):
    tally("disk")
    run_ok(bertforge("export", str(reference), "--out", str(tmp_path / "expected")))
    cmd = bertforge("export", str(reference), "--out", str(tmp_path / "disk" / "hf"))
    first, second = on_small_disk(tmp_path, 64, cmd)
    assert first["rc"] == 2
    line = last_line(first["stderr"])
    assert line.startswith(f"error: {tmp_path}/disk/") and line.endswith(
        "No space left on device; free space and run the same command again"
    )
    assert list(first["disk"].iterdir()) == []  # neither a partial export nor a temporary folder
    assert second["rc"] == 0 and export_files(second["disk"] / "hf") == export_files(tmp_path / "expected")


def test_preprocessing_onto_a_full_disk_writes_no_manifest_and_finishes_later(wordpiece_dir, tmp_path, tally):
    tally("disk")
    corpus = write_text(tmp_path / "corpus.txt", make_documents(n_docs=4000, seed=3))
    run_ok(bertforge(*preprocess_args(wordpiece_dir, corpus, tmp_path / "expected")))
    cmd = bertforge(*preprocess_args(wordpiece_dir, corpus, tmp_path / "disk" / "out"))
    first, second = on_small_disk(tmp_path, 128, cmd)
    assert first["rc"] == 2, first["stderr"][-3000:]
    assert last_line(first["stderr"]).endswith("No space left on device; free space and run the same command again")
    assert not (first["disk"] / "out" / "manifest.json").exists()
    assert second["rc"] == 0 and shard_folder(second["disk"] / "out") == shard_folder(tmp_path / "expected")


def test_a_compile_cache_on_a_full_disk_is_one_warning_line_and_the_command_succeeds(model_dir, tmp_path, tally):
    """JAX writes its cache entries in place: the full disk cuts some short, and the next run cannot read them."""
    tally("disk")
    cache = tmp_path / "disk" / "cache"
    cmd = ["env", f"BERTFORGE_COMPILE_CACHE={cache}", *bertforge("fill-mask", "--model", str(model_dir), "a [MASK]")]
    first, second = on_small_disk(tmp_path, 32, cmd)
    for attempt, words in ((first, "Error writing"), (second, "Error reading")):
        assert attempt["rc"] == 0, attempt["stderr"][-3000:]
        lines = attempt["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"warning: compile cache: {words} persistent"), lines
        assert lines[0].endswith(f"going on without it (delete {cache} to clear it)")
