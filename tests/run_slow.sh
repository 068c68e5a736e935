#!/usr/bin/env bash
# The end-to-end acceptance runs, long sweeps and other tests that the default suite leaves
# out: those marked `@pytest.mark.slow` (`-m slow`; setup.cfg). Each property they check also
# has a test in the default suite (README's command 2; tests/slow_cases_test.py).
# Run from the repository root, in its venv:
#   bash tests/run_slow.sh                 # all of them (over an hour on 2 cores)
#   bash tests/run_slow.sh tests/resume_test.py tests/multi_worker_test.py   # some
#   bash tests/run_slow.sh --durations=40 tests/resume_test.py                # some, with options
#   bash tests/run_slow.sh --durations=40  # all, with pytest options
#
# All of them run in two steps. First everything but the two files that need the most
# memory, on two workers. Then those two, each in a process of its own: the Keras
# applications' tests (ResNet50, EfficientNetB0, ConvNeXtTiny: 7.6 GB at the peak, 5.5 min)
# and the XLA compiles (a fine-tuned EfficientNetB0's whole DP step: 13.5 GB at the peak,
# 9 min). On the workers beside the other tests they ran this 24 GB host out of memory
# twice (2026-11-27: one worker at 15.3 GB, then one at 13.9 GB beside 7.4 GB and the DP-model
# fuzzer's process; the host thrashed).
set -uo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do  # a file or test named anywhere among the arguments: run those alone
  if [ -e "${arg%%::*}" ]; then
    exec python -m pytest -q -n 2 -m slow "$@"
  fi
done
alone=(tests/training/ghost_backbones_test.py tests/training/dp_step_xla_test.py)
status=0
python -m pytest -q -n 2 -m slow "${alone[@]/#/--ignore=}" "$@" || status=1
for file in "${alone[@]}"; do
  python -m pytest -q -m slow "$file" "$@" || status=1
done
exit $status
