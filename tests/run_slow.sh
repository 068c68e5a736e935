#!/usr/bin/env bash
# The end-to-end acceptance runs and long sweeps that the default suite leaves out
# (`-m slow`; setup.cfg). Each property they check also has a fast unit-level test in the
# default suite (README's command 2). Run from the repository root, in its venv:
#   bash tests/run_slow.sh                 # all of them (over an hour on 2 cores)
#   bash tests/run_slow.sh tests/resume_test.py tests/multi_worker_test.py   # some
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -n 2 -m slow "$@"
