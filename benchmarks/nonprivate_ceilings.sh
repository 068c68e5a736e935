#!/usr/bin/env bash
# The NON-PRIVATE ceiling of every Fashion-MNIST config: the same data,
# model, batches, steps, augmult, EMA and evaluation as the private config, trained with
# tfdp.train_and_evaluate.privacy = None (plain mean-loss steps: no clipping, no noise).
#
#   bash benchmarks/nonprivate_ceilings.sh [OUT_DIR] [NAME ...]   # default OUT_DIR: workdirs
#
# Each run writes OUT_DIR/ceiling_NAME/ (a tfdp workdir with NOT_PRIVATE.{json,md}, no
# privacy report), OUT_DIR/ceiling_NAME.log and OUT_DIR/ceiling_NAME.seconds (wall time of
# the whole command). A finished run (FINISHED present) is skipped, and a killed one
# resumes from its checkpoint, so the script can simply be run again.
#
# The optimizer is the one change from each config: the configs' learning rates were tuned
# for CLIPPED gradients (per-example norm <= C = 0.1, times 1/C with normalize_update), and
# without clipping they diverge (fashion_mnist.gin's momentum LR 4.0 reached a test loss of
# 16 after 2 steps). Every ceiling uses Adam at 1e-3 instead (set OPTIMIZER below to tune).
# What the other privacy settings mean without privacy (docs/non_private.md):
# accumulation_steps keeps its chunks of one update; normalize_update, num_microbatches,
# C, sigma, epsilon, delta and the accountant are not used, and each run's log and
# NOT_PRIVATE.json list them.
# Measured 2026-11-25 on the shared 2-core AVX-512 host (oneDNN on): see
# docs/non_private.md for the time of a short run of each; the full runs are not
# measured here.
set -euo pipefail
out=${1:-workdirs}
shift || true
mkdir -p "$out"
wanted=" $* "
python -c "import sys; sys.path.insert(0, sys.argv[1]); from tfdp import host; print(host.describe_host())" \
  "$(dirname "$0")/.." | tee "$out/ceilings_host.txt"

OPTIMIZER=(--gin_param='tfdp.training.build_optimizer.name="adam"'
           --gin_param=tfdp.training.build_optimizer.learning_rate=1e-3)

run() {
  local name=$1 config=$2
  shift 2
  if [ "$wanted" != "  " ] && [[ "$wanted" != *" $name "* ]]; then return; fi
  local workdir="$out/ceiling_$name"
  if [ -f "$workdir/FINISHED" ]; then echo "done already: ceiling_$name"; return; fi
  echo "running ceiling_$name: python -m tfdp.main --gin_file=$config (privacy=None) $*"
  local start=$SECONDS
  python -m tfdp.main --gin_file="$config" --gin_param=tfdp.train_and_evaluate.privacy=None \
    "${OPTIMIZER[@]}" "$@" --workdir="$workdir" > "$out/ceiling_$name.log" 2>&1
  echo $((SECONDS - start)) > "$out/ceiling_$name.seconds"
  python - "$workdir" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
last = records[-1]
assert last.get("privacy") == "NOT PRIVATE", "not a non-private run"
extra = "".join(f"  {k} {last[k]:.4f}" for k in ("test_ema_accuracy", "test_augtest_accuracy")
                if k in last)
print(f"{sys.argv[1]}: step {last['step']}  test_accuracy {last['test_accuracy']:.4f}{extra}"
      "  (NOT PRIVATE)")
EOF
}

run fashion_mnist fashion_mnist.gin
run recipe fashion_mnist_recipe.gin
run recipe_cnn fashion_mnist_recipe_cnn.gin
run scatternet_cnn fashion_mnist_scatternet_cnn.gin
run scatternet_linear fashion_mnist_scatternet_linear.gin
run best fashion_mnist_best.gin
