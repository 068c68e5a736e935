#!/usr/bin/env bash
# The end-to-end acceptance runs and long sweeps that the default suite leaves out
# (`-m slow`; setup.cfg). Each property they check also has a fast unit-level test in the
# default suite (README's command 2). Run from the repository root, in its venv:
#   bash tests/run_slow.sh                 # all of them (over an hour on 2 cores)
#   bash tests/run_slow.sh tests/resume_test.py tests/multi_worker_test.py   # some
#   bash tests/run_slow.sh --durations=40  # all, with pytest options
#
# All of them run in two steps. First everything but the Keras applications' tests, on two
# workers. Then those (ResNet50, EfficientNetB0, ConvNeXtTiny: 7.6 GB at the peak, 5.5 min)
# in one process of their own: a worker keeps much of what its earlier tests allocated, and
# with them on a worker the 24 GB host ran out of memory (2026-11-27: one worker at 15 GB,
# the other at 6.5 GB beside the DP-model fuzzer's process; the host thrashed).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ] && [ -e "${1%%::*}" ]; then
  exec python -m pytest -q -n 2 -m slow "$@"
fi
applications=tests/training/ghost_backbones_test.py
python -m pytest -q -n 2 -m slow --ignore="$applications" "$@"
first=$?
python -m pytest -q -m slow "$applications" "$@"
second=$?
[ $first -eq 0 ] && [ $second -eq 0 ]
