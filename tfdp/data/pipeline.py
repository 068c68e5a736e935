"""Training and evaluation batches: an index stream, read from a source, in tf.data.

    index_batches (sampling.py: Poisson by default, one index vector per step)
      -> source.read (TFDSSource: ArrayRecord records, decoded in parallel;
                      ArraySource: a gather from memory)
      -> prefetch

A source is a `TFDSSource` (a TFDS split read from disk by index: the default,
for every dataset) or an `ArraySource` (arrays in memory: cached ScatterNet
features). Both give `num_examples`, `num_classes`, `image_shape` and
`read(indices int64 [n]) -> (images [n, ...], labels int32 [n])`.

The batch of step t depends only on (seed, t), so a run resumed at step k sees
the batches an uninterrupted run sees from step k on. Elements are produced in
order, several in parallel, and prefetched, so reading and decoding overlap the
training step (BUILD.md gives the measured throughput).
"""

import numpy as np
import tensorflow as tf

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
    ds = sampling_lib.index_batches(
        sampling=sampling, num_examples=source.num_examples, batch_size=batch_size,
        num_steps=num_steps, seed=seed, start_step=start_step,
    )
    ds = ds.map(source.read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


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
