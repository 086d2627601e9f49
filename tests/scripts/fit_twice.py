"""Two fits one after the other in one process, each after the same ``seed_everything``, as a notebook, a sweep or a
k-fold loop does; writes OUT/first/rank0.pt and OUT/second/rank0.pt.

    python tests/scripts/fit_twice.py OUT trainer|fabric
"""

from __future__ import annotations

import sys
from pathlib import Path

import fabric_mlp
import fit_mlp

if __name__ == "__main__":
    out, front_end = Path(sys.argv[1]), sys.argv[2]
    for name in ("first", "second"):
        (out / name).mkdir(parents=True, exist_ok=True)
        if front_end == "trainer":
            fit_mlp.main(out / name, {"devices": 1, "steps": 4})
        else:
            fabric_mlp.main(out / name, {"devices": 1, "steps": 4})
