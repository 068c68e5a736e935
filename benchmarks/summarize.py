"""Prints the table of a benchmarks/fashion_mnist.sh output directory.

    python benchmarks/summarize.py OUT_DIR

Per run: epsilon (at delta), steps, final and max-over-evaluations test accuracy of the
last parameters (Tramer & Boneh select the max; tfdp reports both), the EMA and AugTest
accuracy where the run evaluated them, and the wall time of the whole command.

First the host line(s) the runs logged (`tfdp.host.describe_host()`: CPU flags,
oneDNN on or off), which every wall time depends on.

Then, for runs repeated with other seeds (`NAME` and `NAME_seed<k>`), the mean and sample
standard deviation of their final accuracy: the run-to-run noise.
"""

import collections
import json
import os
import re
import statistics
import sys


def _records(out, name):
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _final(records, key):
    values = [r[key] for r in records if key in r]
    return values[-1] if values else None


def _row(out, name):
    workdir = os.path.join(out, name)
    with open(os.path.join(workdir, "privacy_report.json")) as f:
        report = json.load(f)
    records = _records(out, name)
    seconds_path = os.path.join(out, name + ".seconds")
    seconds = int(open(seconds_path).read()) if os.path.exists(seconds_path) else None

    def pct(key, how=lambda v: v[-1]):
        values = [r[key] for r in records if key in r]
        return f"{100 * how(values):.2f}" if values else "-"

    return (f"| {name} | {report['epsilon']:.3f} | {report['steps']} | {report['batch_size']} "
            f"| {report['noise_multiplier']:.4g} | {pct('test_accuracy')} "
            f"| {pct('test_accuracy', max)} | {pct('test_ema_accuracy')} "
            f"| {pct('test_augtest_accuracy')} "
            f"| {'-' if seconds is None else f'{seconds // 60}m{seconds % 60:02d}s'} |")


def _repeat_table(out, names):
    groups = collections.defaultdict(list)
    for name in names:
        groups[re.sub(r"_seed\d+$", "", name)].append(name)
    rows = []
    for group, members in sorted(groups.items()):
        if len(members) < 2:
            continue
        cells = []
        for key in ("test_accuracy", "test_ema_accuracy"):
            values = [_final(_records(out, m), key) for m in members]
            if None in values:
                cells.append("-")
                continue
            values = [100 * v for v in values]
            cells.append(f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f} "
                         f"({', '.join(f'{v:.2f}' for v in values)})")
        rows.append(f"| {group} | {len(members)} | {cells[0]} | {cells[1]} |")
    if rows:
        print()
        print("| runs | n | test acc (final): mean ± std (each) | EMA acc (final): mean ± std |")
        print("|---|---|---|---|")
        print("\n".join(rows))


def _hosts(out, names):
    """Maps each host line found in the runs' NAME.log to the runs that logged it."""
    hosts = collections.defaultdict(list)
    for name in names:
        try:
            with open(os.path.join(out, name + ".log"), errors="replace") as f:
                found = re.search(r"host: .*", f.read())
        except OSError:
            found = None
        hosts[found.group(0) if found else "host not recorded in the run's log"].append(name)
    return hosts


def main(out):
    names = [name for name in sorted(os.listdir(out))
             if os.path.exists(os.path.join(out, name, "privacy_report.json"))]
    for line, runs in _hosts(out, names).items():
        print(f"{line} ({', '.join(runs)})")
    print()
    print("| run | epsilon | steps | B | sigma | test acc (final) | test acc (max) "
          "| EMA acc (final) | AugTest acc (final) | wall time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        print(_row(out, name))
    _repeat_table(out, names)


if __name__ == "__main__":
    main(sys.argv[1])
