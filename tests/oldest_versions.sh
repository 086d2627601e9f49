#!/usr/bin/env bash
# The parts of the suite that touch DeepSpeed and Lightning, run against the oldest versions pyproject.toml allows
# (the lower bounds of lightning and deepspeed, read from it) with torch 2.13, in a virtual environment of their own
# (.venv-oldest). CI runs it after the main suite:  bash tests/oldest_versions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-oldest
. .venv-oldest/bin/activate
python - > .venv-oldest/constraints.txt <<'PY'
import re
import tomllib

with open("pyproject.toml", "rb") as f:
    dependencies = tomllib.load(f)["project"]["dependencies"]
for requirement in dependencies:
    match = re.match(r"\s*(lightning|deepspeed)(\[[^\]]*\])?\s*>=\s*([0-9][0-9.]*)", requirement)
    if match:
        print(f"{match.group(1)}=={match.group(3)}")
PY
echo "oldest versions: $(tr '\n' ' ' < .venv-oldest/constraints.txt)"
# Its own extension cache: DeepSpeed's CPU ops and the fused loop built against these versions, not the main venv's.
export TORCH_EXTENSIONS_DIR="$PWD/.venv-oldest/torch_extensions"
pip install -q torch==2.13.0
pip install -q -e ".[test]" -c .venv-oldest/constraints.txt
python -c "import deepspeed, lightning, torch; print('installed:', 'lightning', lightning.__version__, 'deepspeed', deepspeed.__version__, 'torch', torch.__version__)" 2>/dev/null
# The oldest DeepSpeed is the tested one (pyproject.toml), so what differs here is Lightning: its private names, the
# adoption of optimizers, the Trainer fits, and the checkpoint hooks a resume goes through. The tests of states in
# files (mmap), of re-partitioning and of the rest of the checkpoint format are left to the main suite, newest
# versions only, to keep CI short.
python -m pytest -q -p no:cacheprovider tests/test_upstream.py tests/test_adoption.py tests/test_strategy.py \
    tests/test_checkpoint.py tests/test_repartition.py -k "not mmap and not state_files and \
    (not test_repartition or saved_again) and (not test_checkpoint or resume_equals or interrupted_save)"
# Lightning's sampler injection as data.py corrects it (in one process; the 2-process resumes run in the main suite).
python -m pytest -q -p no:cacheprovider tests/test_data.py -k "not bit_for_bit and not two_fits"
