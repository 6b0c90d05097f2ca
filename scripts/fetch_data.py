"""The public data sets the README, the guides and the benchmarks use, fetched into data/ and checked.

    python scripts/fetch_data.py                    # every set, from its public source (make data)
    python scripts/fetch_data.py --only jglue ner   # some of them
    python scripts/fetch_data.py --from DIR         # from a mirror laid out as data/ (make data DATA_FROM=DIR)

Each file is checked against its SHA-256 before it is put in place (written beside it, then renamed), so a file in
data/ is always a whole, checked copy; one already there and whole is left alone. A set that needs an account
(CommonLit, on Kaggle) is not downloaded: the script says how to get the file and checks the one you place.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JGLUE = "https://raw.githubusercontent.com/yahoojapan/JGLUE/main/datasets"


@dataclass(frozen=True)
class DataFile:
    """One file of a set: where it goes under data/, where it comes from (a URL, and the member of a zip archive
    when the URL is one), its SHA-256 and size."""

    set: str
    path: str
    source: str
    sha256: str
    size: int
    member: str | None = None
    account: str | None = None  # how to get it where the source needs an account (nothing is downloaded)


MANIFEST = (
    DataFile("wikitext-2", "wikitext-2/valid.txt", "https://wikitext.smerity.com/wikitext-2-v1.zip",
             "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8", 1_121_681,
             member="wikitext-2/wiki.valid.tokens"),
    DataFile("wikitext-2", "wikitext-2/test.txt", "https://wikitext.smerity.com/wikitext-2-v1.zip",
             "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0", 1_256_449,
             member="wikitext-2/wiki.test.tokens"),
    DataFile("ner", "ner-wikipedia-ja/ner.json",
             "https://raw.githubusercontent.com/stockmarkteam/ner-wikipedia-dataset/main/ner.json",
             "5796effb85c473aec5b85784545349ed42e408bb0fecdb78f82bc107d53edbe3", 4_042_700),
    DataFile("jglue", "jglue/jsquad-v1.3/valid-v1.3.json", f"{JGLUE}/jsquad-v1.3/valid-v1.3.json",
             "fb0a57a35281ff03bbe7f0e878cff5b577985fbe6fcb242e7e8ddb63d1c0ab11", 1_976_638),
    DataFile("jglue", "jglue/jcommonsenseqa-v1.3/train-v1.3.json", f"{JGLUE}/jcommonsenseqa-v1.3/train-v1.3.json",
             "9b55fae5ecb3aedd6f8ce5bc09196c3b629864668ec6c18eee4d65c0aa48229e", 1_879_961),
    DataFile("jglue", "jglue/jcommonsenseqa-v1.3/valid-v1.3.json", f"{JGLUE}/jcommonsenseqa-v1.3/valid-v1.3.json",
             "0d8d76f3bfa0d174866939882faccdd01fbc2bcd5a76c43748ba0c40a7b3b8d4", 235_633),
    DataFile("jglue", "jglue/jnli-v1.3/valid-v1.3.json", f"{JGLUE}/jnli-v1.3/valid-v1.3.json",
             "ca0353efc7c2eebfb6de4e13f16295053c8b1ee65e7b0849190c90426fbc495f", 632_446),
    DataFile("jglue", "jglue/jsts-v1.3/train-v1.3.json", f"{JGLUE}/jsts-v1.3/train-v1.3.json",
             "db6bd653270ac9786759920413a48973164d322998f34dd4ae32202af5e66969", 3_164_816),
    DataFile("jglue", "jglue/jsts-v1.3/valid-v1.3.json", f"{JGLUE}/jsts-v1.3/valid-v1.3.json",
             "7c0bdcb381179f01096c635d058853d96da1e1248d23fe3f5c2beed5dc2d9b1a", 372_253),
    DataFile("commonlit", "commonlit/train.csv", "https://www.kaggle.com/c/commonlitreadabilityprize/data",
             "16ca4c623eef3a6571e0ee145b6aca2996b8a5f94f2404bcb9ce2c485116753a", 2_927_187,
             account="sign in to Kaggle, accept the CommonLit Readability Prize's rules, download train.csv "
                     "(or: kaggle competitions download -c commonlitreadabilityprize) and place it at"),
)  # fmt: skip
SETS = sorted({f.set for f in MANIFEST})


class DataError(Exception):
    """A file that could not be got or does not match the manifest: one line for the user."""


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def whole(path: Path, entry: DataFile) -> bool:
    """Whether `path` holds exactly the manifest's file."""
    return path.is_file() and path.stat().st_size == entry.size and sha256_of(path.read_bytes()) == entry.sha256


def _download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=120) as response:  # noqa: S310 (the manifest's https URLs)
            return response.read()
    except OSError as e:
        raise DataError(f"{url}: could not be downloaded ({e})") from None


def _fetch(entry: DataFile, mirror: Path | None, archives: dict[str, bytes]) -> bytes:
    """The file's bytes: from the mirror's same path, or its source (a zip's member taken out)."""
    if mirror is not None:
        path = mirror / entry.path
        if not path.is_file():
            raise DataError(f"{path}: not in the mirror {mirror} (expected the layout of data/: {entry.path})")
        return path.read_bytes()
    if entry.member is None:
        return _download(entry.source)
    if entry.source not in archives:
        archives[entry.source] = _download(entry.source)
    try:
        with zipfile.ZipFile(io.BytesIO(archives[entry.source])) as archive:
            return archive.read(entry.member)
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"{entry.source}: not a zip archive holding {entry.member} ({e})") from None


def _place(path: Path, data: bytes) -> None:
    """Write `data` beside `path`, then rename it there: data/ never holds a part of a file. The standard library's
    own, not bertforge.fileio's: `make data` runs with the system's Python, before any .venv exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def get(entry: DataFile, out: Path, mirror: Path | None, archives: dict[str, bytes]) -> str:
    """Put the manifest's file under `out` (checked); returns what was done, for the log."""
    path = out / entry.path
    if whole(path, entry):
        return f"{path}: already there"
    if entry.account is not None and mirror is None:
        if path.exists():
            raise DataError(f"{path}: not the file the docs use (SHA-256 {sha256_of(path.read_bytes())}, expected "
                            f"{entry.sha256}); {entry.account} {path}")  # fmt: skip
        raise DataError(f"{path}: missing; {entry.account} {path} ({entry.source})")
    data = _fetch(entry, mirror, archives)
    if sha256_of(data) != entry.sha256:
        where = (
            mirror / entry.path if mirror is not None else entry.source + (f" ({entry.member})" if entry.member else "")
        )
        raise DataError(f"{where}: SHA-256 {sha256_of(data)}, expected {entry.sha256}: not the file the docs use")
    _place(path, data)
    return f"{path}: {len(data):,} bytes from {mirror / entry.path if mirror is not None else entry.source}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=SETS, help="these sets only")
    p.add_argument("--from", dest="mirror", type=Path, help="copy from this folder (the layout of data/)")
    p.add_argument("--out", type=Path, default=ROOT / "data")
    args = p.parse_args(argv)
    archives: dict[str, bytes] = {}
    failed = 0
    for entry in MANIFEST:
        if args.only and entry.set not in args.only:
            continue
        try:
            print(get(entry, args.out, args.mirror, archives))
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    if failed:
        print(f"{failed} file(s) not in place", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
