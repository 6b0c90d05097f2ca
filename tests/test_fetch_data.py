"""`make data` (scripts/fetch_data.py): the manifest names the files of the public mirror exactly, and a file reaches
data/ only whole and checked, from a mirror, a download or a zip archive's member."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = ROOT.parent / "shared" / "data"


def load():
    spec = importlib.util.spec_from_file_location("fetch_data", ROOT / "scripts" / "fetch_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fetch = load()


@pytest.mark.skipif(not MIRROR.is_dir(), reason="no local mirror of the public data beside the clone")
@pytest.mark.parametrize("entry", fetch.MANIFEST, ids=lambda e: e.path)
def test_the_manifest_names_each_file_of_the_mirror_by_its_size_and_checksum(entry):
    data = (MIRROR / entry.path).read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256)
    assert entry.source.startswith("https://")


def entry_for(data: bytes, **kw) -> object:
    fields = {"set": "toy", "path": "toy/file.txt", "source": "https://example.invalid/file.txt"} | kw
    return fetch.DataFile(sha256=hashlib.sha256(data).hexdigest(), size=len(data), **fields)


def toy_mirror(tmp_path: Path, monkeypatch, holds: bytes) -> tuple[Path, Path]:
    """A mirror whose one file holds `holds`, a manifest that expects b"the text\\n" there; (mirror, out)."""
    mirror = tmp_path / "mirror"
    (mirror / "toy").mkdir(parents=True)
    (mirror / "toy/file.txt").write_bytes(holds)
    monkeypatch.setattr(fetch, "MANIFEST", (entry_for(b"the text\n"),))
    return mirror, tmp_path / "data"


def test_a_mirror_is_copied_once_checked(tmp_path, monkeypatch, capsys):
    mirror, out = toy_mirror(tmp_path, monkeypatch, b"the text\n")
    assert fetch.main(["--from", str(mirror), "--out", str(out)]) == 0
    assert (out / "toy/file.txt").read_bytes() == b"the text\n"
    assert fetch.main(["--from", str(mirror), "--out", str(out)]) == 0
    assert "already there" in capsys.readouterr().out


def test_a_file_that_does_not_match_is_refused_by_name_and_nothing_is_placed(tmp_path, monkeypatch, capsys):
    mirror, out = toy_mirror(tmp_path, monkeypatch, b"another text\n")
    assert fetch.main(["--from", str(mirror), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"{mirror / 'toy/file.txt'}: SHA-256" in err and "not the file the docs use" in err
    assert not (out / "toy").exists() or not any((out / "toy").iterdir())


def test_a_file_missing_from_the_mirror_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fetch, "MANIFEST", (entry_for(b"the text\n"),))
    assert fetch.main(["--from", str(tmp_path), "--out", str(tmp_path / "data")]) == 1
    assert f"{tmp_path / 'toy/file.txt'}: not in the mirror" in capsys.readouterr().err


def test_a_member_of_a_downloaded_zip_is_taken_out_and_checked(tmp_path, monkeypatch):
    archive = tmp_path / "set.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("set/wiki.valid.tokens", "valid lines\n")
        z.writestr("set/wiki.test.tokens", "test lines\n")
    url = archive.as_uri()
    monkeypatch.setattr(fetch, "MANIFEST", (
        entry_for(b"valid lines\n", path="toy/valid.txt", source=url, member="set/wiki.valid.tokens"),
        entry_for(b"test lines\n", path="toy/test.txt", source=url, member="set/wiki.test.tokens"),
    ))  # fmt: skip
    out = tmp_path / "data"
    assert fetch.main(["--out", str(out)]) == 0
    assert (out / "toy/valid.txt").read_text() == "valid lines\n" and (
        out / "toy/test.txt"
    ).read_text() == "test lines\n"


def test_a_set_behind_an_account_is_not_downloaded_but_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    entry = entry_for(b"a,b\n", account="download it from the competition and place it at")
    monkeypatch.setattr(fetch, "MANIFEST", (entry,))
    out = tmp_path / "data"
    assert fetch.main(["--out", str(out)]) == 1
    assert f"{out / 'toy/file.txt'}: missing; download it from the competition" in capsys.readouterr().err
    (out / "toy").mkdir(parents=True)
    (out / "toy/file.txt").write_bytes(b"a,b,c\n")  # the wrong file
    assert fetch.main(["--out", str(out)]) == 1
    assert "not the file the docs use" in capsys.readouterr().err
    (out / "toy/file.txt").write_bytes(b"a,b\n")
    assert fetch.main(["--out", str(out)]) == 0
