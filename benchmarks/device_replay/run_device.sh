#!/bin/bash
# One-shot GPU replay of tfdp's exported XLA steps (a folder `out` beside this script, written by
# export_steps.py). Copy this folder, with `out` inside it, to a folder that .git/info/exclude ignores
# (e.g. devrun/), name it in the device tool's `carry`, and run `cd devrun && bash run_device.sh`.
# Full log: $OUT/replay.log. Each group runs in its own python3 under `timeout`, capped by a
# global deadline (BUDGET_S), so a hang loses one group only and the log survives.
cd "$(dirname "$0")"
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"; LOG=$OUT/replay.log
unset XLA_FLAGS
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET_S:-340}))
say() { echo "=== $* (t=$(( $(date +%s) - T0 ))s)" | tee -a "$LOG"; }
say "start $(date -u +%FT%TZ) host $(hostname)"
timeout 30 nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee -a "$LOG"
du -sh out 2>&1 | tee -a "$LOG"
run() {  # run SECONDS NAMES [extra replay args]
  local t=$1 names=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < t )) && t=$left
  if (( t < 20 )); then say "skip $names (deadline)"; return; fi
  say "group $names (timeout ${t}s)"
  timeout -k 5 "$t" python3 -u replay.py out --rewrite --seconds 2 --names "$names" "$@" 2>&1 | tee -a "$LOG"
  say "group exit ${PIPESTATUS[0]}"
}
# 1. precision, GPU (TF32) plan, kappa = 1e-3: one-hot masks over every example (64 >= B),
#    C = 1e-4; pass: *_added_over_Cm_max <= 1 + 1e-6 (Cm = C/(1+kappa)); *_added_over_C_max < 1
run 85 wrn_b32_norms,cnn_b64_norms --onehot 64
# 2. the float32-plan controls (kappa = 1e-5): may exceed Cm under TF32, the expected failure
run 70 wrn_b32_norms_f32plan,cnn_b64_norms_f32plan --onehot 64
# 3. WRN-16-4 plain vs DP step (TF32 plan)
run 70 wrn_b32_plain,wrn_b32_dp
run 70 wrn_b128_plain,wrn_b128_dp
# 4. Tramer-Boneh CNN, B = 512
run 40 cnn_b512_plain,cnn_b512_dp
# 5. WRN-16-4, B = 512 (no TF reference for the DP step: ~22 GB on the export host's CPU)
run 80 wrn_b512_plain,wrn_b512_dp
say "end"
