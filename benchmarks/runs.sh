# Sourced by the benchmark scripts that launch tfdp runs one after another
# (fashion_mnist.sh, fashion_mnist_search.sh): `start_runs OUT_DIR [NAME ...]`, then
# `run NAME ARGS...` for each run.
#
# Each run writes OUT_DIR/NAME/ (a normal tfdp workdir), OUT_DIR/NAME.log and
# OUT_DIR/NAME.seconds (wall time of the whole command: data loading, features, training,
# evaluation, export). A finished run (FINISHED present) is skipped, so a script can be
# resumed; with NAMEs, only those run.

start_runs() {
  out=$1
  shift
  mkdir -p "$out"
  wanted=" $* "
  # The host line (CPU flags, oneDNN on or off) that every time depends on.
  python -c "import sys; sys.path.insert(0, sys.argv[1]); from tfdp import host; print(host.describe_host())" \
    "$(dirname "${BASH_SOURCE[0]}")/.." | tee "$out/host.txt"
}

# True if NAME is among the NAMEs given to start_runs (or none were given).
wanted_run() {
  [ "$wanted" = "  " ] || [[ "$wanted" == *" $1 "* ]]
}

run() {
  local name=$1
  shift
  if ! wanted_run "$name"; then return; fi
  if [ -f "$out/$name/FINISHED" ]; then echo "done already: $name"; return; fi
  echo "running $name: python -m tfdp.main $*"
  local start=$SECONDS
  python -m tfdp.main --workdir="$out/$name" "$@" > "$out/$name.log" 2>&1
  echo $((SECONDS - start)) > "$out/$name.seconds"
}
