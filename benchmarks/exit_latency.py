r"""How long a `python -m tfdp.main` process lives after its "Done:" line.

Runs the trainer N times, each into a fresh workdir, reads its log as it is
written, and records for each run: the wall time of the whole command, the
moment of the "Done:" line, the moment FINISHED appeared, and the moment the
process exited. What matters is `exit - done`: the time a finished run keeps
its process (and, in the issue, a CPU at 100%) alive.

    python benchmarks/exit_latency.py --runs=10 --out=/tmp/exit \
        -- --gin_file=fashion_mnist.gin --gin_param=NUM_STEPS=300

Everything after `--` is passed to `python -m tfdp.main` (add
`--gin_param=...` as needed; `--workdir` is set per run). `--tree=NAME=DIR`
runs the tfdp of another checkout (e.g. a commit exported with `git archive
COMMIT | tar -x -C DIR`) with the same interpreter; given several times, the
trees take turns, run by run (A B A B ...), so that a before/after
comparison sees the same load.

    python benchmarks/exit_latency.py --runs=10 --out=/tmp/exit \
        --tree=before=/tmp/tfdp_before --tree=after=/tmp/tfdp_after \
        -- --gin_file=fashion_mnist.gin --gin_param=NUM_STEPS=300

Prints one line per run and a summary (median and max of exit - done); with
`--json=FILE` also writes the rows. The host line (CPU flags, oneDNN) and the
load average at the start and end are printed, as the design pages ask beside
any time.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time


def _one_run(command, env, cwd, workdir):
    start = time.monotonic()
    proc = subprocess.Popen(command + [f"--workdir={workdir}"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = {}
    tail = []

    def read():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-40]
            if "Done:" in line and "done" not in seen:
                seen["done"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    finished_at = None
    while proc.poll() is None:
        if finished_at is None and os.path.exists(os.path.join(workdir, "FINISHED")):
            finished_at = time.monotonic()
        time.sleep(0.05)
    end = time.monotonic()
    reader.join(timeout=5)
    row = {"rc": proc.returncode, "total_s": round(end - start, 2)}
    if "done" in seen:
        row["exit_after_done_s"] = round(end - seen["done"], 2)
    if finished_at is not None:
        row["exit_after_finished_s"] = round(end - finished_at, 2)
    if proc.returncode != 0 or "done" not in seen:
        row["log_tail"] = "".join(tail[-15:])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", required=True, help="folder for the runs' workdirs")
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=DIR: run the tfdp found in DIR (default: the installed "
                             "one); repeat to interleave several")
    parser.add_argument("--keep", action="store_true", help="keep the workdirs")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="-- then the arguments of python -m tfdp.main")
    args = parser.parse_args()
    trainer_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    trees = [tuple(t.split("=", 1)) if "=" in t else (t, t) for t in args.tree] or [
        ("installed", None)]
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    sys.path.insert(0, os.path.abspath(trees[0][1] or here))
    from tfdp import host  # pylint: disable=g-import-not-at-top

    print(host.describe_host(), flush=True)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    command = [sys.executable, "-m", "tfdp.main", *trainer_args]
    rows = []
    for i in range(args.runs):
        for name, tree in trees:
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get(
                    "PYTHONPATH", "")
            workdir = os.path.abspath(os.path.join(args.out, f"{name}{i}"))
            shutil.rmtree(workdir, ignore_errors=True)
            row = {"tree": name, "run": i, **_one_run(command, env, tree or os.getcwd(),
                                                      workdir)}
            row["load"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if not args.keep:
                shutil.rmtree(workdir, ignore_errors=True)
    for name, _ in trees:
        gaps = [r["exit_after_done_s"] for r in rows
                if r["tree"] == name and "exit_after_done_s" in r]
        if gaps:
            print(f"{name}: exit after Done: median {statistics.median(gaps):.2f} s, "
                  f"max {max(gaps):.2f} s, min {min(gaps):.2f} s over {len(gaps)} runs",
                  flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
