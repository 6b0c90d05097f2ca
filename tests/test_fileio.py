"""Writing folders that readers may open at any moment: move_into and copy_folder_into."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

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
