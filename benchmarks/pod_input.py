"""imagenet.gin's per-host input: peak host RSS at two logical batch sizes, views per core.

Each measurement is a fresh process that builds the training input
the trainer builds for one host and reads T logical batches (default 1) of
expected size B (imagenet.gin: ArrayRecord JPEGs decoded at 224 x 224, K = 4
views of `imagenet_resize_crop`, kept as uint8), then reports its peak resident
set size (ru_maxrss), its RSS right after the imports, and the views it made
per CPU-second (user + sys of the process: per-core throughput, which other
jobs on a shared machine do not change the way they change wall time).
Pipelines:
  chunks   the trainer's (`tfdp.inputs.train_dataset`, `tfdp.data.train_chunks`):
           R = 8 replicas x a chunks x n = 72 slots, a = B / 512, so S = 1.125 B
           and every element is one chunk of 72 slots, whatever B;
  batches  the previous one: one element per logical batch (`train_batches`,
           `augment_dataset(as_uint8=True)`, `pad_batches` to S = 1.125 B);
  jpeg     the pure-TF input: the trainer's chunks over the same examples
           in ImageNet's JPEG-folder layout (`JPEGFolderSource`, `--jpeg_dir`), read
           with tf.io.read_file and sampled in the graph; no Python in the pipeline.
A cell is PIPELINE@B, or PIPELINE@BxT for T logical batches (chunks@1024x8 reads as many
chunks as chunks@8192: tf.data's autotuning and the allocator grow with the elements
read, which this separates from B). Rounds are interleaved over the cells.

  python tools/make_synthetic_imagenet.py --data_dir=/tmp/pods_synth/n10000 --num_train=10000
  python benchmarks/pod_input.py --data_dir=/tmp/pods_synth/n10000 \
      --cells=chunks@1024,chunks@1024x8,chunks@8192,batches@256,batches@512 --rounds=2

The pure-TF input against the ArrayRecord one, on the same 10,000 examples:
  python tools/make_synthetic_imagenet.py --layout=jpeg_folder \
      --data_dir=/tmp/pods_synth/jpeg10000 --num_train=10000
  python benchmarks/pod_input.py --data_dir=/tmp/pods_synth/n10000 \
      --jpeg_dir=/tmp/pods_synth/jpeg10000 --cells=chunks@1024,jpeg@1024,jpeg@8192 --rounds=2
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

_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data dir holding synthetic_imagenet.")
_JPEG_DIR = flags.DEFINE_string("jpeg_dir", None, "The same examples as a JPEG folder "
                                "(make_synthetic_imagenet.py --layout=jpeg_folder), for jpeg@B.")
_CELLS = flags.DEFINE_list("cells", ["chunks@1024", "chunks@8192"], "PIPELINE@B to measure.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved repeats of every cell.")
_AUGMULT = flags.DEFINE_integer("augmult", 4, "Views per example (imagenet.gin: 4).")
_WORKER = flags.DEFINE_string("worker", None, "Internal: run one cell, print JSON.")

_SEED = 1234  # a benchmark, not a private run: the seed is a fixed constant
_REPLICAS, _SLOTS = 8, 72  # imagenet.gin on one v3-8 host; n = 72 slots per chunk
_IMAGE_SIZE = 224


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(pipeline, batch_size, num_steps):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    from tfdp import accounting  # pylint: disable=g-import-not-at-top
    from tfdp import augment  # pylint: disable=g-import-not-at-top
    from tfdp import data  # pylint: disable=g-import-not-at-top
    from tfdp import inputs  # pylint: disable=g-import-not-at-top

    rss_after_import = _rss_mb()
    if pipeline == "jpeg":
        source = data.open_split("synthetic_imagenet", "train", data_dir=_JPEG_DIR.value,
                                 image_size=_IMAGE_SIZE, source="jpeg_folder")
    else:
        source = data.TFDSSource("synthetic_imagenet", "train", data_dir=_DATA_DIR.value,
                                 image_size=_IMAGE_SIZE)
    chunks_per_replica = max(1, batch_size // (_REPLICAS * _SLOTS * 8 // 9))  # S = 9/8 B
    static = (_REPLICAS * chunks_per_replica * _SLOTS if pipeline in ("chunks", "jpeg")
              else batch_size * 9 // 8)
    mechanism = accounting.DPMechanism(
        num_examples=source.num_examples, batch_size=batch_size, num_steps=num_steps,
        noise_multiplier=2.5, l2_clip_norm=1.0, delta=1e-6)
    augment_fn = augment.get_augmentation("imagenet_resize_crop", image_size=_IMAGE_SIZE)
    cpu, start = _cpu_seconds(), time.perf_counter()
    if pipeline in ("chunks", "jpeg"):
        ds = inputs.train_dataset(
            source, mechanism, seed=_SEED, start_step=0, augment_fn=augment_fn,
            augment_seed=[_SEED, 1], augmult=_AUGMULT.value, static_batch_size=static,
            num_replicas=_REPLICAS, accumulation_steps=chunks_per_replica)(range(_REPLICAS))
    else:
        ds = data.train_batches(source, sampling="poisson", batch_size=batch_size,
                                num_steps=num_steps, seed=_SEED)
        ds = augment.augment_dataset(ds, augment_fn=augment_fn, augmult=_AUGMULT.value,
                                     seed=[_SEED, 1], as_uint8=True)
        ds = data.pad_batches(ds, static_batch_size=static)
    views, elements, element_mb = 0, 0, 0.0
    for images, _, mask in ds:
        views += int(tf.reduce_sum(mask)) * _AUGMULT.value
        elements += 1
        element_mb = max(element_mb, images.numpy().nbytes / 2**20)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return {"pipeline": pipeline, "batch_size": batch_size, "num_steps": num_steps,
            "static_batch_size": static,
            "elements": elements, "element_mb": element_mb, "views": views,
            "views_per_cpu_second": views / cpu, "cpu_seconds": cpu, "seconds": seconds,
            "peak_rss_mb": _rss_mb(), "rss_after_import_mb": rss_after_import}


def _run_worker(cell):
    command = [sys.executable, __file__, f"--worker={cell}", f"--data_dir={_DATA_DIR.value}",
               f"--augmult={_AUGMULT.value}", f"--jpeg_dir={_JPEG_DIR.value}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{cell} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spread(values, fmt):
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main(argv):
    del argv
    if not _DATA_DIR.value:
        raise app.UsageError("--data_dir is required.")
    if _WORKER.value:
        pipeline, size = _WORKER.value.split("@")
        batch_size, _, num_steps = size.partition("x")
        print(json.dumps(_measure(pipeline, int(batch_size), int(num_steps or 1))))
        return
    print(host.describe_host())
    cells = list(_CELLS.value)
    results = {cell: [] for cell in cells}
    for r in range(_ROUNDS.value):
        for cell in cells[r % len(cells):] + cells[:r % len(cells)]:
            result = _run_worker(cell)
            results[cell].append(result)
            print(f"round {r}: {json.dumps(result)}", flush=True)
    print(f"\nK = {_AUGMULT.value}, {_ROUNDS.value} rounds; min / median / max")
    print("| pipeline | B | S | logical batches | elements | largest element (MB) "
          "| peak RSS (MB) | RSS after imports (MB) | views per CPU-second |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        rs = results[cell]
        print(f"| {rs[0]['pipeline']} | {rs[0]['batch_size']} | {rs[0]['static_batch_size']} "
              f"| {rs[0]['num_steps']} "
              f"| {rs[0]['elements']} | {rs[0]['element_mb']:.0f} "
              f"| {_spread([x['peak_rss_mb'] for x in rs], '{:.0f}')} "
              f"| {_spread([x['rss_after_import_mb'] for x in rs], '{:.0f}')} "
              f"| {_spread([x['views_per_cpu_second'] for x in rs], '{:.0f}')} |")


if __name__ == "__main__":
    app.run(main)
