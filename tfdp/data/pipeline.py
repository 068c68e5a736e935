"""Training and evaluation batches: an index stream, read from a source, in tf.data.

    index stream (one index vector per step, Poisson by default):
      sampling.index_batches (numpy, in a tf.numpy_function), or
      graph_sampling.index_batches_in_graph (TensorFlow ops) for a pure-TF source
      -> source.read (TFDSSource: ArrayRecord records, decoded in parallel;
                      ArraySource: a gather from memory;
                      JPEGFolderSource: tf.io.read_file of a gathered path, decoded)
      -> prefetch

A source is a `TFDSSource` (a TFDS split read from disk by index), an
`ArraySource` (arrays in memory: a small dataset, or cached ScatterNet
features) or a `JPEGFolderSource` (one JPEG file per example). All give
`num_examples`, `num_classes`, `image_shape`, `pure_tf` and
`read(indices int64 [n]) -> (images [n, ...], labels int32 [n])`. A source
with `pure_tf` True reads with TensorFlow ops only, and its index stream is
then drawn in the graph too, so the whole input runs without Python (as a
TPU pod's per-host input graphs must; `tfdp.data.open_split` chooses).

The batch of step t depends only on (seed, t), so a run resumed at step k sees
the batches an uninterrupted run sees from step k on. Elements are produced in
order, several in parallel, and prefetched, so reading and decoding overlap the
training step (docs/design/input_pipeline.md gives the measured throughput).
"""

import numpy as np
import tensorflow as tf

from tfdp.data import graph_sampling
from tfdp.data import padding as padding_lib
from tfdp.data import sampling as sampling_lib


def train_batches(source, *, sampling, batch_size, num_steps, seed, start_step=0):
    """Training batches by scheme: "poisson" (the default everywhere) or "shuffle".

    For "poisson", each example is in each step's batch independently with
    probability sampling_prob = batch_size / num_examples, so batch_size is the
    expected batch size (the value the accountant and the DP update use) and
    the batch size varies (`tfdp.data.poisson_indices`). For "shuffle", every
    batch has exactly batch_size examples and no amplification by sampling is
    claimed: `tfdp.accounting.DPMechanism` accounts for it at replace-one
    adjacency (`tfdp.data.shuffled_indices`; Ponomareva et al. 2023, Sec. 5.3.1).
    Examples keep their index order inside a Poisson batch.

    Args:
      source: a `TFDSSource` or `ArraySource`.
      sampling: one of SAMPLING_SCHEMES, "poisson" or "shuffle".
      batch_size: expected (Poisson) or fixed (shuffle) logical batch size,
        1 <= batch_size <= source.num_examples.
      num_steps: total optimizer updates of the run (not epochs).
      seed: int in [0, 2**63), the secret sampling seed (never logged).
      start_step: first step to produce, 0 <= start_step <= num_steps (a run
        resumed from a checkpoint after k updates passes k).

    Returns:
      tf.data.Dataset of num_steps - start_step elements `(images, labels)`:
      images [None, *source.image_shape] (uint8 pixels, or float32 features),
      labels int32 [None].

    Raises:
      ValueError: as `tfdp.data.index_batches` (unknown scheme, bad seed,
        batch_size not in [1, N], bad steps).
    """
    ds = index_stream(source, sampling=sampling, batch_size=batch_size, num_steps=num_steps,
                      seed=seed, start_step=start_step)
    ds = ds.map(source.read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def index_stream(source, *, sampling, batch_size, num_steps, seed, start_step=0):
    """The index vectors of `source`'s training steps: in the graph when `source.pure_tf`.

    `tfdp.data.index_batches` (numpy, `tf.numpy_function`) for a source that
    reads through Python anyway (`TFDSSource`), else
    `tfdp.data.index_batches_in_graph` (TensorFlow ops; the same mechanism,
    another random stream: `tfdp.data.graph_sampling`).

    Returns:
      tf.data.Dataset of num_steps - start_step elements, int64 [None].

    Raises:
      ValueError: as `tfdp.data.index_batches`.
    """
    make = (graph_sampling.index_batches_in_graph if source.pure_tf
            else sampling_lib.index_batches)
    return make(sampling=sampling, num_examples=source.num_examples, batch_size=batch_size,
                num_steps=num_steps, seed=seed, start_step=start_step)


def train_chunks(source, *, sampling, batch_size, num_steps, seed, num_replicas=1,
                 accumulation_steps=1, replicas=None, static_batch_size=None, start_step=0,
                 map_fn=None):
    """This host's share of every logical batch, one accumulation chunk per element.

    Layout (the same on every host; `tfdp.training.distribute` derives the
    sensitivity for it). The index vector of step t is a function of
    (seed, t) alone (`index_stream`: in the graph for a pure-TF source), so
    every host computes the same one. It is truncated to
    its first S indices and padded with masked slots to S, the static logical
    batch (`tfdp.data.pad_batch`), or, without a static size, to the smallest
    positive multiple of R a that holds it; S = R a n. Replica r's chunk j is
    the contiguous slice of slots [(r a + j) n, (r a + j + 1) n). Only the
    slices of `replicas` are read, and of each only its real indices: padding
    is never read, and no other host's examples are. Real slots come first
    in the padded vector, so each slice is real indices, then padding.

    Elements come in the order a train step consumes them: step by step, and
    in each step chunk 0 of every local replica, then chunk 1, and so on
    (`tf.distribute` deals consecutive elements to a host's replicas in
    turn). One host's memory holds a few chunks, never a logical batch.

    Args:
      source: a `TFDSSource` or `ArraySource`.
      sampling, batch_size, num_steps, seed, start_step: as `train_batches`.
      num_replicas: R, replicas over all hosts.
      accumulation_steps: a, chunks per replica and logical batch.
      replicas: the global ids of this host's replicas, a contiguous
        `range` (None: all R, one host).
      static_batch_size: None, or S, a multiple of R a (static shapes: every
        chunk has n = S / (R a) slots).
      map_fn: None, or `fn(step int64 [], images [k, ...], labels int32 [k])
        -> (images, labels)` applied to a chunk's k real examples before
        padding (augmult views); it must treat each example on its own.

    Returns:
      tf.data.Dataset of (num_steps - start_step) * a * len(replicas) elements
      `(images [n, ...], labels int32 [n], mask float32 [n])`, mask 1.0 on real
      examples and 0.0 on padding (zero images, label 0); n is static when S
      is given.

    Raises:
      ValueError: as `train_batches`; R or a < 1; `replicas` not a contiguous
        range inside [0, R); S not a positive multiple of R a.
    """
    num_replicas, accumulation_steps = int(num_replicas), int(accumulation_steps)
    if num_replicas < 1 or accumulation_steps < 1:
        raise ValueError(f"num_replicas={num_replicas} and accumulation_steps="
                         f"{accumulation_steps} must both be >= 1.")
    replicas = range(num_replicas) if replicas is None else replicas
    if (not isinstance(replicas, range) or replicas.step != 1 or not len(replicas)
            or replicas.start < 0 or replicas.stop > num_replicas):
        raise ValueError(f"replicas must be a non-empty contiguous range inside "
                         f"range({num_replicas}), got {replicas!r}.")
    unit = num_replicas * accumulation_steps
    chunk_size = None
    if static_batch_size is not None:
        if static_batch_size < 1 or static_batch_size % unit:
            raise ValueError(
                f"static_batch_size={static_batch_size} must be a positive multiple of "
                f"replicas x accumulation_steps = {unit}.")
        chunk_size = static_batch_size // unit
    first, local = replicas.start, len(replicas)
    indices = index_stream(source, sampling=sampling, batch_size=batch_size,
                           num_steps=num_steps, seed=seed, start_step=start_step)

    def layout(step, batch):
        padded, _, mask = padding_lib.pad_batch(
            batch, batch, static_batch_size=static_batch_size, multiple=unit)

        def mine(t):  # [S] -> this host's [a * local, n], chunk-major
            grid = tf.reshape(t, [num_replicas, accumulation_steps, -1])[first:first + local]
            return tf.reshape(tf.transpose(grid, [1, 0, 2]), [accumulation_steps * local, -1])

        count = accumulation_steps * local
        return tf.data.Dataset.from_tensor_slices(
            (tf.fill([count], step), mine(padded), mine(mask)))

    def read(step, chunk, mask):
        real = tf.cast(tf.reduce_sum(mask), tf.int32)
        images, labels = source.read(chunk[:real])
        if map_fn is not None:
            images, labels = map_fn(step, images, labels)
        size = tf.shape(chunk)[0]
        images, labels = (_pad_rows_to(t, size, chunk_size) for t in (images, labels))
        return images, labels, tf.ensure_shape(mask, [chunk_size])

    ds = indices.enumerate(start=start_step).flat_map(layout)
    ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def _pad_rows_to(t, size, static_size):
    """`t` [k, ...] padded with zero rows to `size` rows (static `static_size` or None)."""
    pad = size - tf.shape(t)[0]
    paddings = tf.concat([[[0, pad]], tf.zeros([t.shape.rank - 1, 2], tf.int32)], 0)
    return tf.ensure_shape(tf.pad(t, paddings), [static_size, *t.shape[1:]])


def eval_batches(source, *, batch_size, num_examples=None):
    """Batches in the stored order, for evaluation; the last partial batch is kept.

    Args:
      source: a `TFDSSource` or `ArraySource`.
      batch_size: examples per batch (>= 1).
      num_examples: evaluate on the first this-many examples (None: all of
        them; more than the source holds means all of them).

    Returns:
      tf.data.Dataset of ceil(n / batch_size) elements `(images [None,
      *source.image_shape], labels int32 [None])`, n the examples used, the
      last batch holding n - (num_batches - 1) * batch_size; prefetched.

    Raises:
      ValueError: batch_size < 1 or num_examples < 1.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
            or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    total = source.num_examples
    if num_examples is not None:
        if int(num_examples) < 1:
            raise ValueError(f"num_examples must be None or >= 1, got {num_examples}.")
        total = min(int(num_examples), total)
    num_batches = -(-total // batch_size)

    def indices(i):
        return tf.range(i * batch_size, tf.minimum((i + 1) * batch_size, total))

    ds = tf.data.Dataset.range(num_batches).map(indices)
    ds = ds.map(source.read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)
