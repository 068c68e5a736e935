#!/usr/bin/env bash
# The empirical privacy audits of fashion_mnist.gin quoted in docs/design/empirical_audit.md, one run after another.
#
#   bash benchmarks/audit_fashion_mnist.sh OUT_DIR [NAME ...]   # all runs, or only the named ones
#
# Needs the prepared dataset (python tools/prepare_fashion_mnist.py); set DATA_DIR to its
# --data_dir if it is not TFDS's default. Each run writes OUT_DIR/NAME/ (a tfdp workdir whose
# privacy_report.md has the "Empirical audit" section), OUT_DIR/NAME.out (the tool's output,
# ending in the --json line), OUT_DIR/NAME.log (TensorFlow's), OUT_DIR/NAME.json (the audit)
# and OUT_DIR/NAME.seconds. A finished run is skipped.
set -euo pipefail
out=${1:?usage: bash benchmarks/audit_fashion_mnist.sh OUT_DIR [NAME ...]}
shift
mkdir -p "$out"
wanted=" $* "
# The host line (CPU flags, oneDNN on or off) that every time below depends on.
python -c "import sys; sys.path.insert(0, sys.argv[1]); from tfdp import host; print(host.describe_host())" \
  "$(dirname "$0")/.." | tee "$out/host.txt"
data=()
if [ -n "${DATA_DIR:-}" ]; then data=("--gin_param=tfdp.DataConfig.data_dir='$DATA_DIR'"); fi

run() {
  local name=$1 kind=$2
  shift 2
  if [ "$wanted" != "  " ] && [[ "$wanted" != *" $name "* ]]; then return; fi
  if [ -f "$out/$name.json" ]; then echo "done already: $name"; return; fi
  echo "running $name: python tools/audit.py $kind $*"
  local start=$SECONDS
  python "$(dirname "$0")/../tools/audit.py" "$kind" --workdir="$out/$name" "${data[@]}" "$@" \
    --json > "$out/$name.out" 2> "$out/$name.log"
  tail -n 1 "$out/$name.out" > "$out/$name.json"
  echo $((SECONDS - start)) > "$out/$name.seconds"
}

# White box: 10000 Dirac canaries on dedicated coordinates (2 m delta = 0.2), at the
# config's claimed epsilon = 3 and at epsilon = 20 (sigma calibrated to it).
run gradient_eps3 gradient --gin_file=fashion_mnist.gin --num_canaries=10000
run gradient_eps20 gradient --gin_file=fashion_mnist.gin --gin_param=TARGET_EPSILON=20.0 \
  --num_canaries=10000
# Black box: 1000 mislabelled training images, scored by their loss under the final model.
run input_eps3 input --gin_file=fashion_mnist.gin --num_canaries=1000
