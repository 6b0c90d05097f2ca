"""The investigations use the benchmarks' shared modules (report, timing, finetune_end_to_end, ...): importing this
puts the folder above on the module path."""

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
