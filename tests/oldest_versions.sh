#!/usr/bin/env bash
# The parts of the suite that touch Lightning's and DeepSpeed's APIs, run against the oldest versions pyproject.toml
# allows (the lower bounds of lightning and deepspeed, read from it). Both are pure Python: the ones that differ from
# the installed versions are installed without dependencies into a folder of their own (.venv-oldest/site), put ahead
# of the environment's packages; torch, the compiled loop and DeepSpeed's built ops are shared with the main suite.
# CI runs it after the main suite, in the same environment:  bash tests/oldest_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .venv-oldest
python - > .venv-oldest/constraints.txt <<'PY'
import re
import tomllib
from importlib.metadata import version

with open("pyproject.toml", "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
for requirement in dependencies:
    match = re.match(r"\s*(lightning|deepspeed)(\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", requirement)
    if match and version(match.group(1)) != match.group(3):
        print(f"{match.group(1)}=={match.group(3)}")
PY
if [ -s .venv-oldest/constraints.txt ]; then
    pip install -q --no-deps --upgrade --target .venv-oldest/site -r .venv-oldest/constraints.txt
fi
export PYTHONPATH="$PWD/.venv-oldest/site${PYTHONPATH:+:$PYTHONPATH}"
# Every lower bound is what is imported now, or the leg stops here.
python - <<'PY'
import re
import tomllib

import deepspeed
import lightning

with open("pyproject.toml", "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
found = {"lightning": lightning.__version__, "deepspeed": deepspeed.__version__}
for requirement in dependencies:
    match = re.match(r"\s*(lightning|deepspeed)(\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", requirement)
    if match:
        assert found[match.group(1)] == match.group(3), (match.group(1), found[match.group(1)], match.group(3))
print("oldest versions:", " ".join(f"{k} {v}" for k, v in found.items()))
PY
# What differs between the versions is their API: the private names the package reads (test_upstream), the adoption
# of optimizers, a Trainer fit through the strategy (one 2-rank fit: training, schedulers, the eval loops, the memory
# log, the warnings), the settings refused at construction, a resume through Lightning's checkpoint hooks, and
# Lightning's sampler injection as data.py corrects it (in one process). Re-partitioning, states in files and the
# front ends' own tests read this package's files and run against the newest versions only, to keep CI short.
python -m pytest -q -p no:cacheprovider tests/test_upstream.py tests/test_adoption.py tests/test_strategy.py \
    tests/test_checkpoint.py tests/test_data.py -k "test_upstream or test_adoption or \
    (test_strategy and (registered or unchanged_module or eval_loops or peak_of_the_fit or third_party or \
    process_group or precision or contradicting or user_config)) or (test_checkpoint and resume_equals) or \
    (test_data and not bit_for_bit and not two_fits)"
