"""Fine-tuning modes side by side: steps/s and peak RSS of head (cached), head (augmult), all.

Three ways to fine-tune one pretrained backbone with DP-SGD:

  head_cached    only the head trains, on features the frozen trunk computed
                 ONCE for all N examples (what `python -m tfdp.main` does for
                 trainable="head" and augmult 0); the step sees [B, F] features.
  head_augmult   only the head trains; the frozen trunk runs forward on each
                 of K views ([B, K, H, W, C] uint8), with no backward pass
                 through it (the model's stop_gradient gate).
  all            every layer trains, ghost-norm clipping, [B, H, W, C].

Each variant runs in a FRESH process (so its peak resident set,
`resource.getrusage(...).ru_maxrss` of the whole process, TensorFlow runtime
included, is its own), with the same model, batch size, sigma = 1 and C = 1.
It times `--steps` DPModel steps on a fixed random batch after warm-up; for
head_cached it also times the one-time feature computation over
`--num_examples` random images (`cache_s`), and its RSS includes that cache.
The processes are interleaved: round r runs every variant once, in an order
rotated by r, so load from other jobs on the machine hits all alike; the
script prints the medians over rounds and the median of each round's
steps/s ratio to "all".

    python benchmarks/finetune_modes.py --backbone=tramer_cnn --batch_size=2048 --rounds=3
    python benchmarks/finetune_modes.py --backbone=wrn16_4 --batch_size=64 --rounds=3

`--backbone` is "tramer_cnn" (Fashion-MNIST's CNN, 28x28x1, as in
fashion_mnist_finetune.gin), "wrn16_4" (32x32x3), or a path (a `.keras` file or
a tfdp workdir, with `--image_shape`). The weights do not change the speed, so
the named ones are randomly initialized and saved to a temporary `.keras` file.
The host line (CPU flags, oneDNN) is printed first.
"""

import argparse
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

from tfdp import accounting  # noqa: E402
from tfdp import models  # noqa: E402
from tfdp.training.dp_model import DPModel  # noqa: E402

VARIANTS = ("head_cached", "head_augmult", "all")
BUILDERS = {
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1)),
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), (32, 32, 3)),
}


def child(args):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    shape = tuple(args.image_shape)
    model = models.build_finetune_model(
        10, shape, backbone=args.backbone_path,
        trainable="all" if args.variant == "all" else "head")
    mechanism = accounting.DPMechanism(
        num_examples=args.num_examples, batch_size=args.batch_size, num_steps=1000,
        noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
    y = rng.integers(0, 10, args.batch_size).astype(np.int32)
    cache_s = None
    if args.variant == "head_cached":
        extractor = models.frozen_feature_extractor(model)
        images = rng.integers(0, 256, (args.num_examples, *shape), dtype=np.uint8)
        start = time.perf_counter()
        features = extractor.compute_features(images)
        cache_s = time.perf_counter() - start
        trained, x = extractor.head, features[:args.batch_size]
    elif args.variant == "head_augmult":
        trained = model
        x = rng.integers(0, 256, (args.batch_size, args.augmult, *shape), dtype=np.uint8)
    else:
        trained = model
        x = rng.integers(0, 256, (args.batch_size, *shape), dtype=np.uint8)
    dp = DPModel(trained, mechanism, noise_seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01))
    for _ in range(args.warmup):
        dp.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(args.steps):
        dp.train_on_batch(x, y)
    seconds = time.perf_counter() - start
    print(json.dumps({
        "variant": args.variant, "steps_per_s": args.steps / seconds,
        "clipping_path": dp.clipping_path, "trainable_parameters": int(sum(
            np.prod(v.shape) for v in dp.trainable_variables)),
        "cache_s": cache_s,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbone", default="tramer_cnn")
    parser.add_argument("--image_shape", type=int, nargs=3, default=None)
    parser.add_argument("--batch_size", type=int, default=2048)
    parser.add_argument("--augmult", type=int, default=2)
    parser.add_argument("--num_examples", type=int, default=58000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--backbone_path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return child(args)

    print(host.describe_host())
    with tempfile.TemporaryDirectory() as tmp:
        if args.backbone in BUILDERS:
            builder, shape = BUILDERS[args.backbone]
            keras.utils.set_random_seed(0)
            path = os.path.join(tmp, f"{args.backbone}.keras")
            builder().save(path)
            image_shape = args.image_shape or shape
        else:
            path, image_shape = args.backbone, args.image_shape
            if image_shape is None:
                parser.error("--image_shape is required with a backbone path")
        variants = args.variants.split(",")
        results = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                command = [sys.executable, __file__, f"--variant={variant}",
                           f"--backbone_path={path}",
                           "--image_shape", *map(str, image_shape),
                           f"--batch_size={args.batch_size}", f"--augmult={args.augmult}",
                           f"--num_examples={args.num_examples}", f"--steps={args.steps}",
                           f"--warmup={args.warmup}"]
                out = subprocess.run(command, check=True, capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": os.getcwd()})
                result = json.loads(out.stdout.strip().splitlines()[-1])
                results[variant].append(result)
                print(f"round {r}: {json.dumps(result)}", flush=True)
    print(f"\n{args.backbone}, images {tuple(image_shape)}, B = {args.batch_size}, augmult = "
          f"{args.augmult} (head_augmult), N = {args.num_examples} cached (head_cached), "
          f"{args.rounds} interleaved rounds of {args.steps} steps, one process each")
    print(f"{'variant':14s} {'steps/s (median)':>17s} {'x all (median)':>15s} "
          f"{'peak RSS MB':>12s} {'cache s':>8s} {'trained params':>15s} path")
    for variant in variants:
        runs = results[variant]
        ratios = ([run["steps_per_s"] / base["steps_per_s"]
                   for run, base in zip(runs, results["all"])] if "all" in results else [])
        cache = [run["cache_s"] for run in runs if run["cache_s"] is not None]
        print(f"{variant:14s} {statistics.median(r['steps_per_s'] for r in runs):17.2f} "
              f"{statistics.median(ratios) if ratios else float('nan'):15.2f} "
              f"{statistics.median(r['peak_rss_mb'] for r in runs):12.0f} "
              f"{statistics.median(cache) if cache else float('nan'):8.1f} "
              f"{runs[0]['trainable_parameters']:15d} {runs[0]['clipping_path']}")


if __name__ == "__main__":
    main()
