"""How the tasks write numbers into prediction and target columns: 7 significant digits, so that a float32 value
reads back as itself."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def numbers(values: np.ndarray) -> list[list[str]]:
    """(N, L) values as N rows of L strings."""
    return [[f"{x:.7g}" for x in row] for row in values]


def prediction_header(names: Sequence[str]) -> list[str]:
    """One column per output: 'prediction' when there is one, else prediction_NAME."""
    return ["prediction"] if len(names) == 1 else [f"prediction_{n}" for n in names]
