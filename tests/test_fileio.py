"""Writing files and folders that readers may open at any moment: write_atomic, move_into and copy_folder_into."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from bertforge import fileio
from bertforge.fileio import copy_folder_into, finite_json, move_into, nan_for_null


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _folder(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_move_into_an_existing_folder_replaces_subfolders_whole_and_config_last(tmp_path, monkeypatch):
    out = _folder(tmp_path / "out", {"config.json": "old", "model.safetensors": "old", "1_Pooling/config.json": "old",
                                     "1_Pooling/stale.txt": "old", "was_a_folder/x": "old", "was_a_file": "old",
                                     "README.md": "mine"})  # fmt: skip
    new = _folder(tmp_path / "new", {"config.json": "new", "model.safetensors": "new", "1_Pooling/config.json": "new",
                                     "was_a_folder": "new", "was_a_file/y": "new"})  # fmt: skip
    moved, replace = [], os.replace

    def recorded(src, dst):
        moved.append(Path(dst).name)
        assert Path(dst).name == "config.json" or not (out / "config.json").exists()  # no config.json meanwhile
        replace(src, dst)

    monkeypatch.setattr(os, "replace", recorded)
    move_into(new, out)
    assert moved[-1] == "config.json" and sorted(moved) == sorted(["config.json", "model.safetensors", "1_Pooling",
                                                                   "was_a_folder", "was_a_file"])  # fmt: skip
    assert _tree(out) == {"1_Pooling/config.json": "new", "README.md": "mine", "config.json": "new",
                          "model.safetensors": "new", "was_a_file/y": "new", "was_a_folder": "new"}  # fmt: skip
    assert not new.exists()


def test_move_into_a_missing_folder_renames_it_and_copy_leaves_the_source(tmp_path):
    new = _folder(tmp_path / "new", {"config.json": "c", "sub/f": "f"})
    move_into(new, tmp_path / "out")
    assert _tree(tmp_path / "out") == {"config.json": "c", "sub/f": "f"} and not new.exists()
    copy_folder_into(tmp_path / "out", tmp_path / "deep" / "copy")
    assert _tree(tmp_path / "deep" / "copy") == _tree(tmp_path / "out")
    assert [p.name for p in (tmp_path / "deep").iterdir()] == ["copy"]  # no temporary folder left beside it


def strict_loads(text: str):
    """json.loads refusing NaN and Infinity, as JSON's grammar (and every parser outside Python) does."""

    def refuse(name: str):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_finite_json_writes_nan_and_infinity_as_null_and_reads_them_back_as_nan():
    data = {"score": math.nan, "scores": {"rmse": 0.5, "pearson": math.inf}, "outputs": [[1.0, -math.inf]], "n": 3}
    text = finite_json(data, indent=2)
    assert strict_loads(text) == {"score": None, "scores": {"rmse": 0.5, "pearson": None}, "outputs": [[1.0, None]],
                                  "n": 3}  # fmt: skip
    back = nan_for_null(strict_loads(text))
    assert math.isnan(back["score"]) and math.isnan(back["scores"]["pearson"]) and math.isnan(back["outputs"][0][1])
    assert back["scores"]["rmse"] == 0.5 and back["n"] == 3


def _flags_of_writes(monkeypatch) -> list[tuple[bool, int]]:
    """Record, for each os.write, whether its file descriptor had O_DIRECT set and how many bytes it was given."""
    import fcntl

    calls, write = [], os.write

    def recorded(fd, data):
        calls.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), memoryview(data).nbytes))
        return write(fd, data)

    monkeypatch.setattr(os, "write", recorded)
    return calls


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 3 * 8192 + 5, 4 * 8192])
def test_write_atomic_writes_a_large_payloads_whole_blocks_past_the_page_cache(tmp_path, monkeypatch, size):
    monkeypatch.setattr(fileio, "DIRECT_MIN", 1)
    monkeypatch.setattr(fileio, "CHUNK", 8192)  # several chunks, the last one short
    data = np.random.default_rng(size).bytes(size)
    calls = _flags_of_writes(monkeypatch)
    fileio.write_atomic(tmp_path / "model.safetensors", data)
    assert (tmp_path / "model.safetensors").read_bytes() == data
    whole = size - size % 4096
    direct = [n for is_direct, n in calls if is_direct]
    assert sum(direct) == whole and all(n % 4096 == 0 and n <= 8192 for n in direct)
    assert sum(n for is_direct, n in calls if not is_direct) == size - whole  # the tail, through the cache
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_write_atomic_falls_back_to_the_page_cache_where_o_direct_is_refused(tmp_path, monkeypatch):
    import errno
    import fcntl

    monkeypatch.setattr(fileio, "DIRECT_MIN", 1)
    monkeypatch.setattr(fileio, "CHUNK", 8192)
    data = np.random.default_rng(0).bytes(5 * 8192 + 7)
    real_fcntl = fcntl.fcntl

    def refusing(fd, cmd, arg=0):  # a filesystem without O_DIRECT (tmpfs on older kernels, some FUSE ones)
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    with monkeypatch.context() as m:
        m.setattr(fcntl, "fcntl", refusing)
        fileio.write_atomic(tmp_path / "a.bin", data)
    assert (tmp_path / "a.bin").read_bytes() == data

    real_write, seen = os.write, []

    def refused_midway(fd, buf):  # a filesystem that takes the flag but refuses the third direct write
        if real_fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen.append(1)
            if len(seen) == 3:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, buf)

    monkeypatch.setattr(os, "write", refused_midway)
    fileio.write_atomic(tmp_path / "b.bin", data)
    assert (tmp_path / "b.bin").read_bytes() == data and len(seen) == 3


def test_write_atomic_names_the_file_a_full_disk_refused_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr(fileio, "DIRECT_MIN", 1)

    def full(fd, buf):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="model.safetensors") as e:
        fileio.write_atomic(tmp_path / "model.safetensors", b"x" * 10000)
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_write_atomic_fs_fsyncs_on_a_local_disk_and_renames_elsewhere(tmp_path, monkeypatch):
    import fsspec

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    for url in (str(tmp_path / "a.bin"), f"file://{tmp_path}/b.bin"):
        fs, path = fsspec.core.url_to_fs(url)
        fileio.write_atomic_fs(fs, path, b"shard")
        assert Path(path).read_bytes() == b"shard"
    assert [Path(p).parent for p in synced] == [tmp_path, tmp_path]  # the temporary files, before their renames
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]
    fs, path = fsspec.core.url_to_fs("memory://bucket/shard.bin")
    fileio.write_atomic_fs(fs, path, b"remote")
    assert fs.cat(path) == b"remote" and fs.ls("/bucket", detail=False) == ["/bucket/shard.bin"]
