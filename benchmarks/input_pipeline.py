"""imagenet.gin's input pipeline on 224 x 224 JPEGs: throughput and peak RSS at two N.

For each dataset (N = 5,000 and 50,000 synthetic ImageNet-shaped JPEGs) and
each stage, a fresh process builds the pipeline the trainer builds and reads
NUM_STEPS Poisson batches (expected size B), then reports:
  * examples/s after the first batch (steady state; start-up reported apart),
  * its peak resident set size (ru_maxrss), and its RSS right after imports.
Stages:
  decode          data.train_batches: Poisson indices -> ArrayRecord records ->
                  JPEG decode (uint8 [n, 224, 224, 3])
  decode+augment  + imagenet.gin's augmentation, K = AUGMULT views per example
                  (imagenet_resize_crop: 1.2x resize, random crop, flip;
                  float32 [n, K, 224, 224, 3])
  eval            data.eval_batches: the same number of examples (B * NUM_STEPS),
                  read in stored order, as evaluation reads the test split
Rounds are interleaved over (N, stage). With --dp_step it also measures what
the DP step consumes: imagenet.gin's NF-ResNet-50 (width 4, K = 4 views at
224 x 224) in a DPModel, examples per second of train steps (after one warm-up
step), on the same machine.

  python tools/make_synthetic_imagenet.py --data_dir=/tmp/synthetic/n5000 --num_train=5000
  python tools/make_synthetic_imagenet.py --data_dir=/tmp/synthetic/n50000 --num_train=50000
  python benchmarks/input_pipeline.py \
      --data_dirs=/tmp/synthetic/n5000,/tmp/synthetic/n50000 --dp_step
"""

import json
import resource
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from tfdp import host

host.enable_onednn()  # before any worker imports TensorFlow (workers inherit the variable)

_DATA_DIRS = flags.DEFINE_list("data_dirs", None, "TFDS data dirs holding synthetic_imagenet.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Expected (Poisson) batch size B.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 30, "Batches read per measurement.")
_AUGMULT = flags.DEFINE_integer("augmult", 4, "Views per example (imagenet.gin: 4).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved repeats of every measurement.")
_STAGES = flags.DEFINE_list("stages", ["decode", "decode+augment", "eval"], "Stages to run.")
_DP_STEP = flags.DEFINE_bool("dp_step", False, "Also measure the DP step's consumption.")
_DP_BATCH_SIZE = flags.DEFINE_integer("dp_batch_size", 2, "Examples per measured DP step.")
_DP_STEPS = flags.DEFINE_integer("dp_steps", 3, "Measured DP steps (after one warm-up).")
# Internal: run one measurement in this process and print it as JSON.
_WORKER = flags.DEFINE_string("worker", None, "Internal: 'STAGE@DATA_DIR' or 'dp_step'.")

_SEED = 1234  # a benchmark, not a private run: the seed is a fixed constant
_IMAGE_SIZE = 224


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _pipeline(stage, data_dir):
    from tfdp import augment  # pylint: disable=g-import-not-at-top
    from tfdp import data  # pylint: disable=g-import-not-at-top

    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=data_dir,
                             image_size=_IMAGE_SIZE)
    if stage == "eval":  # the same number of examples, read in order
        return data.eval_batches(
            source, batch_size=_BATCH_SIZE.value,
            num_examples=_BATCH_SIZE.value * _NUM_STEPS.value), source.num_examples
    ds = data.train_batches(source, sampling="poisson", batch_size=_BATCH_SIZE.value,
                            num_steps=_NUM_STEPS.value, seed=_SEED)
    if stage == "decode+augment":
        ds = augment.augment_dataset(
            ds, augment_fn=augment.get_augmentation("imagenet_resize_crop",
                                                    image_size=_IMAGE_SIZE),
            augmult=_AUGMULT.value, seed=[_SEED, 1])
    return ds, source.num_examples


def _measure_pipeline(stage, data_dir):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top,unused-import

    rss_after_import = _rss_mb()
    start = time.perf_counter()
    ds, num_examples = _pipeline(stage, data_dir)
    first, examples = None, 0
    for _, labels in ds:
        if first is None:
            first = time.perf_counter()
        else:
            examples += int(labels.shape[0])
    return {"stage": stage, "num_examples": num_examples,
            "examples_per_second": examples / (time.perf_counter() - first),
            "seconds_to_first_batch": first - start,
            "peak_rss_mb": _rss_mb(), "rss_after_import_mb": rss_after_import}


def _measure_dp_step():
    import keras  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    from tfdp import models  # pylint: disable=g-import-not-at-top
    from tfdp.training.dp_model import DPModel  # pylint: disable=g-import-not-at-top

    keras.utils.set_random_seed(0)
    model = models.build_nf_resnet(depth=50, num_classes=1000,
                                   input_shape=(_IMAGE_SIZE, _IMAGE_SIZE, 3))
    dp_model = DPModel(model, l2_clip_norm=1.0, noise_multiplier=2.5, batch_size=16384.0,
                       normalize_update=True, noise_seed=0)
    dp_model.compile(optimizer=keras.optimizers.SGD(4.0), jit_compile=False)
    n, k = _DP_BATCH_SIZE.value, _AUGMULT.value
    views = tf.random.uniform([n, k, _IMAGE_SIZE, _IMAGE_SIZE, 3], 0, 255)
    labels = tf.zeros([n], tf.int32)
    dp_model.train_on_batch(views, labels)  # warm-up: tracing
    start = time.perf_counter()
    for _ in range(_DP_STEPS.value):
        dp_model.train_on_batch(views, labels)
    seconds = (time.perf_counter() - start) / _DP_STEPS.value
    return {"stage": "dp_step", "examples_per_second": n / seconds, "seconds_per_step": seconds,
            "examples_per_step": n, "views_per_example": k, "peak_rss_mb": _rss_mb()}


def _run_worker(spec):
    command = [sys.executable, __file__, f"--worker={spec}",
               f"--batch_size={_BATCH_SIZE.value}", f"--num_steps={_NUM_STEPS.value}",
               f"--augmult={_AUGMULT.value}", f"--dp_batch_size={_DP_BATCH_SIZE.value}",
               f"--dp_steps={_DP_STEPS.value}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values, fmt):
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main(argv):
    del argv
    if _WORKER.value:
        if _WORKER.value == "dp_step":
            result = _measure_dp_step()
        else:
            stage, data_dir = _WORKER.value.split("@", 1)
            result = _measure_pipeline(stage, data_dir)
        print(json.dumps(result))
        return
    if not _DATA_DIRS.value:
        raise app.UsageError("--data_dirs is required.")
    print(host.describe_host())
    cells = [(stage, d) for d in _DATA_DIRS.value for stage in _STAGES.value]
    results = {cell: [] for cell in cells}
    for r in range(_ROUNDS.value):
        for cell in cells[r % len(cells):] + cells[:r % len(cells)]:
            result = _run_worker("@".join(cell))
            results[cell].append(result)
            print(f"round {r}: {cell[0]} N={result['num_examples']}: "
                  f"{result['examples_per_second']:.0f} examples/s, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    print(f"\nB = {_BATCH_SIZE.value} (expected), {_NUM_STEPS.value} batches, K = "
          f"{_AUGMULT.value}, {_ROUNDS.value} rounds; min / median / max")
    print("| stage | N (split) | examples/s | s to 1st batch | peak RSS (MB) | RSS after imports (MB) |")
    print("|---|---|---|---|---|---|")
    for cell in cells:
        rs = results[cell]
        print(f"| {cell[0]} | {rs[0]['num_examples']} "
              f"| {_spread([x['examples_per_second'] for x in rs], '{:.0f}')} "
              f"| {_spread([x['seconds_to_first_batch'] for x in rs], '{:.1f}')} "
              f"| {_spread([x['peak_rss_mb'] for x in rs], '{:.0f}')} "
              f"| {_spread([x['rss_after_import_mb'] for x in rs], '{:.0f}')} |")
    if _DP_STEP.value:
        dp = _run_worker("dp_step")
        print(f"\nDP step (NF-ResNet-50, {dp['views_per_example']} views of 224 x 224, "
              f"{dp['examples_per_step']} examples per step): {dp['seconds_per_step']:.1f} s "
              f"per step = {dp['examples_per_second']:.2f} examples/s; "
              f"peak RSS {dp['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    app.run(main)
