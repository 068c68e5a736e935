"""The cost of one step's Poisson sample at ImageNet's N: in the graph (O(N)) and in numpy (O(qN)).

`tfdp.data.poisson_indices_in_graph` draws one 64-bit word per
example (N = 1,271,167 for imagenet.gin), on every host; `poisson_indices`
(numpy, geometric skips) draws about qN = 16,384. Each is timed over
--steps steps, as CPU time of this process (user + sys: what the host pays,
which other jobs on a shared machine do not change the way they change wall
time) and as wall time; rounds are interleaved.

  python benchmarks/graph_sampler.py --rounds=5
"""

import resource
import statistics
import time

from absl import app
from absl import flags

from tfdp import host

host.enable_onednn()

_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", 1271167, "N (imagenet.gin).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 16384, "Expected batch size B.")
_STEPS = flags.DEFINE_integer("steps", 50, "Steps per measurement.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv):
    del argv
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    from tfdp import data  # pylint: disable=g-import-not-at-top

    print(host.describe_host())
    n, q = _NUM_EXAMPLES.value, _BATCH_SIZE.value / _NUM_EXAMPLES.value
    seed = 1234  # a benchmark: a fixed, public seed
    graph = tf.function(lambda s, t: data.poisson_indices_in_graph(
        s, t, num_examples=n, sampling_prob=q))
    graph(tf.constant(seed, tf.int64), tf.constant(0, tf.int64))  # trace once

    def run_graph(step):
        return graph(tf.constant(seed, tf.int64), tf.constant(step, tf.int64)).shape[0]

    def run_numpy(step):
        return len(data.poisson_indices(seed, step, num_examples=n, sampling_prob=q))

    results = {"graph": [], "numpy": []}
    for r in range(_ROUNDS.value):
        for name, fn in (("graph", run_graph), ("numpy", run_numpy))[::1 if r % 2 else -1]:
            cpu, wall, sizes = _cpu(), time.perf_counter(), 0
            for t in range(_STEPS.value):
                sizes += fn(r * _STEPS.value + t)
            cpu, wall = _cpu() - cpu, time.perf_counter() - wall
            results[name].append((1e3 * cpu / _STEPS.value, 1e3 * wall / _STEPS.value,
                                  sizes / _STEPS.value))
            print(f"round {r} {name}: {results[name][-1]}", flush=True)
    print(f"\nN = {n}, B = {_BATCH_SIZE.value}, {_STEPS.value} steps x {_ROUNDS.value} rounds; "
          "ms per step, min / median / max")
    print("| sampler | CPU ms per step | wall ms per step | mean batch |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        cells = [" / ".join(f"{f(v):.2f}" for f in (min, statistics.median, max))
                 for v in zip(*rows)]
        print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.mean(r[2] for r in rows):.0f} |")


if __name__ == "__main__":
    app.run(main)
