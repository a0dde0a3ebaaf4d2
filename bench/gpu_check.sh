#!/usr/bin/env bash
# The GPU check of #15 (bench/gpu_check.py), as one prepared command for a machine with a GPU:
#   bash bench/gpu_check.sh [gpu_check.py options]
# Installs the two pure-Python packages the learner imports if they are missing (from .whl/ when
# it is there: a machine without a package registry), then runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import omegaconf" 2>/dev/null; then
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site
    else
        python3 -m pip install -q omegaconf
    fi
fi
PYTHONUNBUFFERED=1 timeout 480 python3 bench/gpu_check.py "$@"
