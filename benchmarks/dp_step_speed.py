"""Plain Keras step vs DP step, side by side in one process; and their peak memory.

Speed: the plain step (`keras.Model.train_on_batch` with a mean loss) and the
DP steps (`tfdp.training.DPModel.train_on_batch`, C = 1, sigma = 1, on the
ghost and the vectorized clipping paths) train on the same random in-memory
batch. Each round times `--steps` steps of every variant, one after another
(interleaved, so that load from other processes hits all of them alike);
after `--rounds` rounds the script prints min / median / max examples per
second and the median over rounds of each variant's time / plain time.

    python benchmarks/dp_step_speed.py speed --model=tramer_cnn --batch_size=512
    python benchmarks/dp_step_speed.py speed --model=wrn16_4 --batch_size=32

Memory: each variant runs `--steps` steps in a fresh process, which reports
its peak resident set (`resource.getrusage(...).ru_maxrss`: the whole
process, TensorFlow runtime included); the script prints the ratios to plain.

    python benchmarks/dp_step_speed.py memory --model=wrn16_4 --batch_size=64

oneDNN on and off: TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, at import, so
each round runs one `speed` process with it set to 0 and one with 1 (in
alternating order), each timing `--steps` steps of every variant after warm-up;
the script prints the medians over rounds and the median of the paired on/off
ratios (docs/design/dp_step.md, "oneDNN on, on every host"):

    python benchmarks/dp_step_speed.py onednn --model=tramer_cnn --batch_size=512 --rounds=3

Where a step's time goes: `profile` traces `--steps` steps of one variant with
`tf.profiler` (after warm-up) and prints the share of each op type, and of each
op-name prefix (`--scope_depth` components), in the summed op time (all threads):

    python benchmarks/dp_step_speed.py profile --model=wrn16_4 --batch_size=32 --variant=ghost

Every mode prints the host line first (`tfdp.host.describe_host()`: CPU flags,
oneDNN on or off and why).

`--jit_compile` compiles every step with XLA; a variant named with `+xla`
(`--variants=plain,ghost,plain+xla,ghost+xla`) compiles only that one, so that
XLA on and off are timed interleaved in one process (its ratio is to
`plain+xla` when that variant runs, else to `plain`). `--ablate_kernel_norms` (speed
only, a diagnosis, never a DP step) replaces every dense, conv and WS-conv
kernel's per-example squared norm with zero, so that the ghost step's time
without the kernel norms can be compared with plain:

    python benchmarks/dp_step_speed.py speed --model=wrn16_4 --batch_size=32 \
        --variants=plain,ghost --ablate_kernel_norms
"""

import argparse
import collections
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp import accounting  # noqa: E402
from tfdp import models  # noqa: E402
from tfdp.dp.ghost_norms import conv as conv_norms  # noqa: E402
from tfdp.dp.ghost_norms import dense as dense_norms  # noqa: E402
from tfdp.dp.ghost_norms import weight_standardized as ws_norms  # noqa: E402
from tfdp.training.dp_model import DPModel  # noqa: E402

MODELS = {
    # Tramer & Boneh's Fashion-MNIST CNN (fashion_mnist.gin), 26,010 parameters.
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1)),
    # WRN-16-4 with GroupNorm and weight standardization, 2.75M parameters.
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), (32, 32, 3)),
    # Heads on Fashion-MNIST's 7x7x81 ScatterNet features: Tramer & Boneh's CNN (33,066
    # parameters) and the GN-WS head at width 128 (261,770) and at fashion_mnist_best.gin's
    # width 64 (94,026).
    "scatternet_cnn": (lambda: models.build_scatternet_cnn((7, 7, 81), 10, groups=27),
                       (7, 7, 81)),
    "scatternet_gnws_cnn": (lambda: models.build_scatternet_gnws_cnn((7, 7, 81), 10),
                            (7, 7, 81)),
    "scatternet_gnws_cnn_w64": (
        lambda: models.build_scatternet_gnws_cnn((7, 7, 81), 10, width=64), (7, 7, 81)),
}
VARIANTS = ("plain", "ghost", "vectorized")
XLA = "+xla"  # variant suffix: that variant's step compiled with XLA


def build_step(variant, model_name, batch_size, jit_compile):
    """A `step()` that trains one step of `variant` on a fixed random batch."""
    if variant.endswith(XLA):
        variant, jit_compile = variant[:-len(XLA)], True
    keras.utils.set_random_seed(0)
    builder, shape = MODELS[model_name]
    model = builder()
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (batch_size, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch_size).astype(np.int32)
    optimizer = keras.optimizers.SGD(0.01)
    if variant == "plain":
        model.compile(optimizer=optimizer, jit_compile=jit_compile,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        trainer = model
    else:
        mechanism = accounting.DPMechanism(
            num_examples=60000, batch_size=batch_size, num_steps=1000, noise_multiplier=1.0,
            l2_clip_norm=1.0, delta=1e-5)
        trainer = DPModel(model, mechanism, clipping=variant, noise_seed=0)
        trainer.compile(optimizer=optimizer, jit_compile=jit_compile)
        assert trainer.clipping_path == variant
    return lambda: trainer.train_on_batch(x, y)


def ablate_kernel_norms():
    """Benchmark-only: every kernel's per-example squared norm becomes 0 (wrong clipping).

    The rules' weighted sums are kept; TensorFlow prunes the norm work they do
    not share. Each rule is replaced on the module that defines it, where the tap rules and
    the other rules read it (`conv2d_kernel_sq_norms` and `einsum_kernel_sq_norms` call
    `dense.kernel_sq_norms`).
    """
    def zero_squares(rule):
        def ablated(*args, **kwargs):
            squares, weighted_sum = rule(*args, **kwargs)
            return tf.zeros_like(squares), weighted_sum
        return ablated

    for module, name in ((dense_norms, "kernel_sq_norms"), (conv_norms, "conv2d_kernel_sq_norms"),
                         (ws_norms, "ws_kernel_sq_norms")):
        setattr(module, name, zero_squares(getattr(module, name)))


def speed(args):
    if args.ablate_kernel_norms:
        ablate_kernel_norms()
    steps = {v: build_step(v, args.model, args.batch_size, args.jit_compile)
             for v in args.variants}
    for step in steps.values():  # trace and warm up
        step()
        step()
    seconds = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for variant, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            seconds[variant].append((time.perf_counter() - start) / args.steps)
    if args.json:  # for `onednn`: the host line and each round's seconds per step
        print(json.dumps({"host": host.describe_host(), "seconds": seconds}))
        return
    print(host.describe_host())
    print(f"{args.model}, B = {args.batch_size}, {args.rounds} interleaved rounds of "
          f"{args.steps} steps, jit_compile={args.jit_compile}"
          + (", kernel norms ablated (not DP)" if args.ablate_kernel_norms else ""))
    print("| variant | ex/s min | ex/s median | ex/s max | time / plain (median over rounds) |")
    print("|---|---|---|---|---|")
    for variant in args.variants:
        rates = sorted(args.batch_size / s for s in seconds[variant])
        plain = seconds.get("plain" + XLA) if variant.endswith(XLA) else None
        plain = plain or seconds.get("plain", seconds[variant])
        ratio = statistics.median(s / p for s, p in zip(seconds[variant], plain))
        print(f"| {variant} | {rates[0]:,.1f} | {statistics.median(rates):,.1f} | "
              f"{rates[-1]:,.1f} | {ratio:.2f}x |")


def onednn(args):
    rates = {setting: {v: [] for v in args.variants} for setting in ("0", "1")}
    hosts = {}
    for round_index in range(args.rounds):
        for setting in ("0", "1") if round_index % 2 == 0 else ("1", "0"):
            env = dict(os.environ, **{host.ENV_VAR: setting})
            env.pop(host.SET_BY_TFDP_VAR, None)  # this script, not tfdp's default, sets it
            command = [sys.executable, __file__, "speed", "--json", "--rounds=1",
                       f"--steps={args.steps}", f"--model={args.model}",
                       f"--batch_size={args.batch_size}", f"--variants={','.join(args.variants)}"
                       ] + (["--jit_compile"] if args.jit_compile else [])
            out = subprocess.run(command, check=True, capture_output=True, text=True,
                                 env=env).stdout
            result = json.loads(out.strip().splitlines()[-1])
            hosts[setting] = result["host"]
            for variant in args.variants:
                rates[setting][variant].append(args.batch_size / result["seconds"][variant][0])
    print(hosts["0"])
    print(hosts["1"])
    print(f"{args.model}, B = {args.batch_size}, {args.rounds} rounds, each one process with "
          f"{host.ENV_VAR}=0 and one with =1 (alternating order), {args.steps} steps of every "
          f"variant per process, jit_compile={args.jit_compile}")
    print("| variant | ex/s, oneDNN off (median) | ex/s, oneDNN on (median) | on / off "
          "(median of paired rounds) | each round: off, on |")
    print("|---|---|---|---|---|")
    for variant in args.variants:
        off, on = rates["0"][variant], rates["1"][variant]
        ratio = statistics.median(b / a for a, b in zip(off, on))
        rounds = "; ".join(f"{a:,.1f}, {b:,.1f}" for a, b in zip(off, on))
        print(f"| {variant} | {statistics.median(off):,.1f} | {statistics.median(on):,.1f} | "
              f"{ratio:.2f}x | {rounds} |")


def profile(args):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top

    step = build_step(args.variant, args.model, args.batch_size, args.jit_compile)
    step()
    step()
    logdir = tempfile.mkdtemp(prefix="dp_step_profile_")
    start = time.perf_counter()
    tf.profiler.experimental.start(logdir)
    for _ in range(args.steps):
        step()
    tf.profiler.experimental.stop()
    seconds = (time.perf_counter() - start) / args.steps
    space = xplane_pb2.XSpace()
    [path] = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    by_type, by_scope = collections.Counter(), collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                op_name, _, op_type = name.rpartition(":")  # TF op events: "op_name:OpType"
                if not op_name or " " in name or "::" in name:  # not runtime events
                    continue
                by_type[op_type] += event.duration_ps
                by_scope["/".join(op_name.split("/")[:args.scope_depth])] += event.duration_ps
    total = sum(by_type.values())
    print(host.describe_host())
    print(f"{args.model}, B = {args.batch_size}, {args.variant}: {args.steps} profiled steps, "
          f"{seconds:.2f} s per step (profiler on); summed op time {total / 1e12 / args.steps:.2f} "
          "s per step over all threads")
    tables = (("op type", by_type), (f"op-name prefix ({args.scope_depth})", by_scope))
    for title, counter in tables:
        print(f"| {title} | share of op time | s per step |")
        print("|---|---|---|")
        for key, ps in counter.most_common(args.top):
            print(f"| {key} | {100 * ps / total:.1f}% | {ps / 1e12 / args.steps:.3f} |")
        print()


def peak_rss(args):
    step = build_step(args.variant, args.model, args.batch_size, args.jit_compile)
    for _ in range(args.steps):
        step()
    # ru_maxrss is in KiB on Linux.
    print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def memory(args):
    peaks = {}
    for variant in args.variants:
        command = [sys.executable, __file__, "peak_rss", f"--variant={variant}",
                   f"--model={args.model}", f"--batch_size={args.batch_size}",
                   f"--steps={args.steps}"] + (["--jit_compile"] if args.jit_compile else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        peaks[variant] = json.loads(out.strip().splitlines()[-1])["peak_rss_gb"]
    print(host.describe_host())
    print(f"{args.model}, B = {args.batch_size}, peak RSS after {args.steps} steps, "
          f"one process per variant")
    print("| variant | peak RSS (GB) | / plain |")
    print("|---|---|---|")
    for variant, peak in peaks.items():
        print(f"| {variant} | {peak:.2f} | {peak / peaks.get('plain', peak):.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("speed", "onednn", "profile", "memory", "peak_rss"))
    parser.add_argument("--model", choices=sorted(MODELS), default="tramer_cnn")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--variant", choices=VARIANTS + tuple(v + XLA for v in VARIANTS),
                        help="profile and peak_rss only")
    parser.add_argument("--top", type=int, default=15, help="profile only: rows per table")
    parser.add_argument("--scope_depth", type=int, default=2,
                        help="profile only: op-name components that make a prefix")
    parser.add_argument("--jit_compile", action="store_true")
    parser.add_argument("--ablate_kernel_norms", action="store_true",
                        help="speed only: zero kernel norms, to time the rest (not DP)")
    parser.add_argument("--json", action="store_true",
                        help="speed only: print the raw seconds as one JSON line (for onednn)")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    modes = {"speed": speed, "onednn": onednn, "profile": profile, "memory": memory,
             "peak_rss": peak_rss}
    modes[args.mode](args)


if __name__ == "__main__":
    main()
