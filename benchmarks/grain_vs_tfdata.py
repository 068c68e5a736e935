"""Grain or tf.data for tfdp's streaming input? Examples/s of the same job, side by side.

The job: the Poisson batches (`tfdp.data.poisson_indices`, expected size B) of
`synthetic_imagenet` (224 x 224 JPEGs), read from ArrayRecord and decoded to
uint8 [n, 224, 224, 3] batches, delivered as TensorFlow tensors (what the DP step
consumes). Variants:

  tfdata         tfdp.data.train_batches: the index stream in tf.data; records
                 fetched by `__getitems__` in a tf.numpy_function, JPEGs decoded
                 by tf.io in the graph (parallel map over batches, map_fn inside).
  grain_threads  Grain MapDataset over steps -> read + decode a batch in Python
                 (TFDS's numpy decoding: PIL) -> to_iter_dataset with a thread
                 pool -> tf.data.Dataset.from_generator.
  grain_procs    the same with Grain's multiprocessing prefetch (one worker per core).

Runs are interleaved (variant order rotates each round) and each prints
min/median/max over the rounds. Needs `pip install grain` (not a tfdp dependency).

  python tools/make_synthetic_imagenet.py --data_dir=/tmp/synthetic/n5000 --num_train=5000
  python benchmarks/grain_vs_tfdata.py --data_dir=/tmp/synthetic/n5000
"""

import os
import statistics
import time

from absl import app
from absl import flags

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from tfdp import data  # noqa: E402

_DATA_DIR = flags.DEFINE_string("data_dir", None, "Where synthetic_imagenet is.", required=True)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Expected (Poisson) batch size B.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 20, "Batches per measured run.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved repeats of every variant.")
_VARIANTS = flags.DEFINE_list("variants", ["tfdata", "grain_threads", "grain_procs"],
                              "Variants to run.")
_SEED = 1234  # a benchmark, not a private run: the seed is a fixed constant


class _ReadDecodedBatch:
    """Grain map: step -> (images uint8 [n, H, W, 3], labels int32 [n]), decoded in Python."""

    def __init__(self, source, num_examples, sampling_prob):
        self._source = source
        self._num_examples = num_examples
        self._sampling_prob = sampling_prob

    def __call__(self, step):
        indices = data.poisson_indices(_SEED, int(step), num_examples=self._num_examples,
                                       sampling_prob=self._sampling_prob)
        examples = self._source.__getitems__(indices.tolist())
        images = np.stack([e["image"] for e in examples])
        labels = np.array([e["label"] for e in examples], np.int32)
        return images, labels


def _grain_dataset(processes):
    import grain  # pylint: disable=g-import-not-at-top

    builder = tfds.builder("synthetic_imagenet", data_dir=_DATA_DIR.value)
    source = builder.as_data_source(split="train")  # decodes with numpy/PIL
    n = len(source)
    ds = grain.MapDataset.range(_NUM_STEPS.value).map(
        _ReadDecodedBatch(source, n, _BATCH_SIZE.value / n))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=os.cpu_count(),
                                              prefetch_buffer_size=4))
    if processes:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=os.cpu_count()))
    return tf.data.Dataset.from_generator(
        lambda: iter(ds),
        output_signature=(tf.TensorSpec([None, 224, 224, 3], tf.uint8),
                          tf.TensorSpec([None], tf.int32)),
    ).prefetch(2)


def _tfdata_dataset():
    source = data.TFDSSource("synthetic_imagenet", "train", data_dir=_DATA_DIR.value,
                             image_size=224)
    return data.train_batches(source, sampling="poisson", batch_size=_BATCH_SIZE.value,
                              num_steps=_NUM_STEPS.value, seed=_SEED)


_BUILDERS = {
    "tfdata": _tfdata_dataset,
    "grain_threads": lambda: _grain_dataset(processes=False),
    "grain_procs": lambda: _grain_dataset(processes=True),
}


def _measure(variant):
    """(seconds to the first batch, examples/s after it): start-up and steady state."""
    start = time.perf_counter()
    first, examples = None, 0
    for _, labels in _BUILDERS[variant]():
        if first is None:
            first = time.perf_counter()  # building, tracing, worker start-up: paid once
        else:
            examples += int(labels.shape[0])
    return first - start, examples / (time.perf_counter() - first)


def main(argv):
    del argv
    print(host.describe_host())
    variants = list(_VARIANTS.value)
    startup = {v: [] for v in variants}
    speed = {v: [] for v in variants}
    for r in range(_ROUNDS.value):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            seconds, rate = _measure(variant)
            startup[variant].append(seconds)
            speed[variant].append(rate)
            print(f"round {r}: {variant}: first batch after {seconds:.2f} s, then "
                  f"{rate:.0f} examples/s", flush=True)
    print(f"\nexpected batch {_BATCH_SIZE.value}, {_NUM_STEPS.value} batches per run, "
          f"{_ROUNDS.value} rounds, {os.cpu_count()} cores; min / median / max")
    print(f"  {'variant':14s} {'examples/s after the first batch':>34s} "
          f"{'seconds to the first batch':>30s}")
    for variant in variants:
        v, s = speed[variant], startup[variant]
        print(f"  {variant:14s} {min(v):10.0f} {statistics.median(v):7.0f} {max(v):7.0f}"
              f"       {min(s):10.2f} {statistics.median(s):6.2f} {max(s):6.2f}")


if __name__ == "__main__":
    app.run(main)
