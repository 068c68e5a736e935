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

`--jit_compile` compiles every step with XLA. `--ablate_kernel_norms` (speed
only, a diagnosis, never a DP step) replaces every dense, conv and WS-conv
kernel's per-example squared norm with zero, so that the ghost step's time
without the kernel norms can be compared with plain:

    python benchmarks/dp_step_speed.py speed --model=wrn16_4 --batch_size=32 \
        --variants=plain,ghost --ablate_kernel_norms
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting
from tfdp import models
from tfdp.dp import ghost_norms
from tfdp.training.dp_model import DPModel

MODELS = {
    # Tramer & Boneh's Fashion-MNIST CNN (fashion_mnist.gin), 26,010 parameters.
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1)),
    # WRN-16-4 with GroupNorm and weight standardization, 2.75M parameters.
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), (32, 32, 3)),
}
VARIANTS = ("plain", "ghost", "vectorized")


def build_step(variant, model_name, batch_size, jit_compile):
    """A `step()` that trains one step of `variant` on a fixed random batch."""
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
    not share.
    """
    def zero_squares(rule):
        def ablated(*args, **kwargs):
            squares, weighted_sum = rule(*args, **kwargs)
            return tf.zeros_like(squares), weighted_sum
        return ablated

    for name in ("kernel_sq_norms", "conv2d_kernel_sq_norms", "ws_kernel_sq_norms"):
        setattr(ghost_norms, name, zero_squares(getattr(ghost_norms, name)))


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
    print(f"{args.model}, B = {args.batch_size}, {args.rounds} interleaved rounds of "
          f"{args.steps} steps, jit_compile={args.jit_compile}"
          + (", kernel norms ablated (not DP)" if args.ablate_kernel_norms else ""))
    print("| variant | ex/s min | ex/s median | ex/s max | time / plain (median over rounds) |")
    print("|---|---|---|---|---|")
    for variant in args.variants:
        rates = sorted(args.batch_size / s for s in seconds[variant])
        ratio = statistics.median(
            s / p for s, p in zip(seconds[variant], seconds.get("plain", seconds[variant])))
        print(f"| {variant} | {rates[0]:,.1f} | {statistics.median(rates):,.1f} | "
              f"{rates[-1]:,.1f} | {ratio:.2f}x |")


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
    print(f"{args.model}, B = {args.batch_size}, peak RSS after {args.steps} steps, "
          f"one process per variant")
    print("| variant | peak RSS (GB) | / plain |")
    print("|---|---|---|")
    for variant, peak in peaks.items():
        print(f"| {variant} | {peak:.2f} | {peak / peaks.get('plain', peak):.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("speed", "memory", "peak_rss"))
    parser.add_argument("--model", choices=sorted(MODELS), default="tramer_cnn")
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--variant", choices=VARIANTS, help="peak_rss only")
    parser.add_argument("--jit_compile", action="store_true")
    parser.add_argument("--ablate_kernel_norms", action="store_true",
                        help="speed only: zero kernel norms, to time the rest (not DP)")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    {"speed": speed, "memory": memory, "peak_rss": peak_rss}[args.mode](args)


if __name__ == "__main__":
    main()
