"""Training and evaluation batches from in-memory uint8 arrays, in tf.data.

`poisson_batches` is the default and the sampler the privacy accountant
assumes: at every step each example is included independently with probability
sampling_prob, so batch sizes vary (How to DP-fy ML, Ponomareva et al. 2023,
Sec. 4.3 and 5.3.1; De et al. 2022, Sec. 2 "Privacy accounting" and App. A.1).
`shuffled_batches` (fixed-size batches from per-epoch shuffles) is an explicit,
non-default option whose ε is NOT what the accountant computes.

Randomness is stateless: the batch of step t depends only on (seed, t) (for
shuffling: on (seed, epoch)), so two runs with the same seed see identical
batches and a run resumed at start_step=k sees exactly the batches an
uninterrupted run sees from step k on. Random numbers use the Philox algorithm
on the CPU, so they do not depend on the device. The seed is folded with a
per-sampler salt, so data sampling never shares a random stream with another
stateless op that uses the same integer seed.

The arrays are copied once into non-trainable tf.Variables on the host CPU and
gathered per step (a tf.data graph would otherwise copy them in as constants,
which is slow and fails above 2 GB). So build the datasets outside any
`strategy.scope()` (else the copies would be mirrored onto every device; a
ValueError says so); the returned datasets can then be distributed as usual.
Pixels stay uint8; scaling happens in the model.
"""

import numpy as np
import tensorflow as tf

SAMPLING_SCHEMES = ("poisson", "shuffle")

# Salts folded into the user's seed, one per sampler (arbitrary distinct ints).
_POISSON_SALT = 0x5EED_0001
_SHUFFLE_SALT = 0x5EED_0002
_ALG = "philox"


def poisson_batches(images, labels, *, sampling_prob, num_steps, seed, start_step=0):
    """Poisson-sampled batches: each example is in each batch with prob. sampling_prob.

    The element for step t (start_step <= t < num_steps) is a batch B_t whose
    every example is included independently with probability q = sampling_prob,
    so |B_t| ~ Binomial(num_examples, q) (it can be 0; the DP update divides by the
    expected batch size q * num_examples, never by |B_t|). This is the sampling
    the accountant's ε assumes (Ponomareva et al. 2023, Sec. 5.3.1; De et al. 2022,
    Sec. 2). Examples keep their index order inside a batch.

    Inclusion: u_i < q with u_i ~ U[0, 1) in float64 keyed by (seed, t), so the
    inclusion probability is q to within 2**-52.

    Cost per step: one float64 uniform draw per example (8 * num_examples bytes,
    O(num_examples)) plus a gather of |B_t| images: 20-60 ms per step for
    num_examples = 10**6 (32x32x3, expected batch 4096) on a 2-core CPU, run
    ahead of training by `prefetch`. Building the dataset copies the arrays into
    TF once (about 10 s for those 3 GB).

    Args:
      images: uint8 [num_examples, height, width, channels] (numpy or tensor).
      labels: int32 [num_examples] (any integer dtype; cast to int32).
      sampling_prob: q in (0, 1], the probability that an example is in a batch
        (expected batch size / num_examples).
      num_steps: total optimizer updates of the run (not epochs); the last element
        is for step num_steps - 1.
      seed: int, the data-sampling seed.
      start_step: first step to produce, 0 <= start_step <= num_steps (a run
        resumed from a checkpoint after k updates passes k).

    Returns:
      tf.data.Dataset of num_steps - start_step elements (images uint8
      [None, height, width, channels], labels int32 [None]), prefetched.

    Raises:
      ValueError: images not uint8 [num_examples, height, width, channels]; labels
        not [num_examples] integers; no examples; sampling_prob not in (0, 1];
        num_steps < 0; start_step not in [0, num_steps]; called inside a
        `tf.distribute` strategy scope.
    """
    num_examples = _check_arrays(images, labels)
    if not 0.0 < sampling_prob <= 1.0:
        raise ValueError(
            f"sampling_prob must be in (0, 1], got {sampling_prob}; it is the expected "
            "batch size divided by the number of training examples."
        )
    _check_steps(num_steps, start_step)
    images_var, labels_var = _to_host_variables(images, labels)
    base_seed = tf.constant([seed, _POISSON_SALT], dtype=tf.int64)

    def batch_for_step(step):
        uniforms = tf.random.stateless_uniform(
            [num_examples],
            seed=tf.random.experimental.stateless_fold_in(base_seed, step, alg=_ALG),
            dtype=tf.float64,
            alg=_ALG,
        )
        indices = tf.reshape(tf.where(uniforms < sampling_prob), [-1])
        return tf.gather(images_var, indices), tf.gather(labels_var, indices)

    ds = tf.data.Dataset.range(start_step, num_steps)
    ds = ds.map(batch_for_step, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def shuffled_batches(images, labels, *, batch_size, num_steps, seed, start_step=0):
    """Fixed-size batches from a fresh random permutation every epoch.

    NOT the default, and NOT what the privacy accountant assumes: the accountant's
    ε is for Poisson sampling (`poisson_batches`), and the ε of shuffling with
    fixed-size batches is an open question, so reporting the Poisson ε for this
    sampler is technically incorrect (How to DP-fy ML, Ponomareva et al. 2023,
    Sec. 4.3 and 5.3.1; De et al. 2022, App. A.1 makes the same remark). The
    trainer's privacy report says so when this sampler is used.

    Epoch e (steps e * S ... e * S + S - 1, with S = num_examples // batch_size
    steps per epoch) takes consecutive batch_size slices of permutation P_e, a
    stateless shuffle keyed by (seed, e); the last num_examples % batch_size
    examples of P_e are dropped (a different random set each epoch). So within
    an epoch no example repeats, and when batch_size divides num_examples each
    epoch covers every example exactly once. Cost: one O(num_examples log
    num_examples) shuffle per epoch plus a gather of batch_size images per step.

    Args:
      images: uint8 [num_examples, height, width, channels] (numpy or tensor).
      labels: int32 [num_examples] (any integer dtype; cast to int32).
      batch_size: examples per batch, 1 <= batch_size <= num_examples.
      num_steps: total optimizer updates of the run (not epochs).
      seed: int, the data-sampling seed.
      start_step: first step to produce, 0 <= start_step <= num_steps.

    Returns:
      tf.data.Dataset of num_steps - start_step elements (images uint8
      [None, height, width, channels], labels int32 [None]; each batch has exactly
      batch_size examples), prefetched.

    Raises:
      ValueError: bad arrays or a strategy scope (as in `poisson_batches`); batch_size not in
        [1, num_examples]; num_steps < 0; start_step not in [0, num_steps].
    """
    num_examples = _check_arrays(images, labels)
    _check_batch_size(batch_size, num_examples)
    _check_steps(num_steps, start_step)
    images_var, labels_var = _to_host_variables(images, labels)
    base_seed = tf.constant([seed, _SHUFFLE_SALT], dtype=tf.int64)
    steps_per_epoch = num_examples // batch_size
    first_epoch = start_step // steps_per_epoch
    end_epoch = -(-num_steps // steps_per_epoch)  # ceil: epochs that reach num_steps

    def batch_indices_for_epoch(epoch):
        permutation = tf.random.experimental.stateless_shuffle(
            tf.range(num_examples, dtype=tf.int64),
            seed=tf.random.experimental.stateless_fold_in(base_seed, epoch, alg=_ALG),
            alg=_ALG,
        )
        batches = tf.reshape(
            permutation[: steps_per_epoch * batch_size], [steps_per_epoch, batch_size]
        )
        return tf.data.Dataset.from_tensor_slices(batches)

    ds = tf.data.Dataset.range(first_epoch, max(end_epoch, first_epoch))
    ds = ds.flat_map(batch_indices_for_epoch)
    ds = ds.skip(start_step - first_epoch * steps_per_epoch).take(num_steps - start_step)
    ds = ds.map(
        lambda indices: (tf.gather(images_var, indices), tf.gather(labels_var, indices)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.prefetch(tf.data.AUTOTUNE)


def eval_batches(images, labels, *, batch_size):
    """Batches in the stored order, for evaluation; the last partial batch is kept.

    Args:
      images: uint8 [num_examples, height, width, channels] (numpy or tensor).
      labels: int32 [num_examples] (any integer dtype; cast to int32).
      batch_size: examples per batch (>= 1; the last batch has
        num_examples - (num_batches - 1) * batch_size).

    Returns:
      tf.data.Dataset of ceil(num_examples / batch_size) elements (images uint8
      [None, height, width, channels], labels int32 [None]), prefetched.

    Raises:
      ValueError: bad arrays or a strategy scope (as in `poisson_batches`); batch_size < 1.
    """
    num_examples = _check_arrays(images, labels)
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    images_var, labels_var = _to_host_variables(images, labels)
    num_batches = -(-num_examples // batch_size)

    def batch(i):
        indices = tf.range(i * batch_size, tf.minimum((i + 1) * batch_size, num_examples))
        return tf.gather(images_var, indices), tf.gather(labels_var, indices)

    ds = tf.data.Dataset.range(num_batches)
    ds = ds.map(batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def make_train_batches(images, labels, *, sampling, batch_size, num_steps, seed, start_step=0):
    """Training batches by scheme: "poisson" (the default everywhere) or "shuffle".

    For "poisson", sampling_prob = batch_size / num_examples, so batch_size is the
    expected batch size (the same value the accountant and the DP update use);
    for "shuffle", every batch has exactly batch_size examples and the
    accountant's ε does not apply (see `shuffled_batches`; Ponomareva et al.
    2023, Sec. 5.3.1).

    Args:
      images: uint8 [num_examples, height, width, channels].
      labels: int32 [num_examples].
      sampling: one of SAMPLING_SCHEMES, "poisson" or "shuffle".
      batch_size: expected logical batch size, 1 <= batch_size <= num_examples.
      num_steps: total optimizer updates of the run (not epochs).
      seed: int, the data-sampling seed.
      start_step: first step to produce, 0 <= start_step <= num_steps.

    Returns:
      tf.data.Dataset of (images uint8 [None, height, width, channels],
      labels int32 [None]) for steps start_step .. num_steps - 1.

    Raises:
      ValueError: unknown sampling scheme (the message lists the valid ones);
        batch_size not in [1, num_examples]; the errors of the chosen sampler.
    """
    if sampling not in SAMPLING_SCHEMES:
        raise ValueError(f"Unknown sampling scheme {sampling!r}; use one of {SAMPLING_SCHEMES}.")
    num_examples = _check_arrays(images, labels)
    _check_batch_size(batch_size, num_examples)
    if sampling == "poisson":
        return poisson_batches(
            images,
            labels,
            sampling_prob=batch_size / num_examples,
            num_steps=num_steps,
            seed=seed,
            start_step=start_step,
        )
    return shuffled_batches(
        images, labels, batch_size=batch_size, num_steps=num_steps, seed=seed,
        start_step=start_step,
    )


def _check_arrays(images, labels):
    """Checks shapes and dtypes; returns num_examples."""
    images_shape, labels_shape = tuple(images.shape), tuple(labels.shape)
    images_dtype = tf.as_dtype(images.dtype)
    if len(images_shape) != 4 or images_dtype not in (tf.uint8, tf.float32):
        raise ValueError(
            f"images must be uint8 [num_examples, height, width, channels] (or float32 "
            f"cached features of that rank), got {images_dtype.name} {list(images_shape)}; "
            "keep pixels uint8 (the model scales them) and add a channel axis to "
            "grayscale images."
        )
    if labels_shape != images_shape[:1] or not tf.as_dtype(labels.dtype).is_integer:
        raise ValueError(
            f"labels must be integers [num_examples] = [{images_shape[0]}], got "
            f"{tf.as_dtype(labels.dtype).name} {list(labels_shape)}."
        )
    if images_shape[0] == 0:
        raise ValueError("images and labels hold no examples; check the dataset split.")
    return int(images_shape[0])


def _check_batch_size(batch_size, num_examples):
    if not isinstance(batch_size, (int, np.integer)) or not 1 <= batch_size <= num_examples:
        raise ValueError(
            f"batch_size must be an int in [1, num_examples={num_examples}], got "
            f"{batch_size!r}; lower batch_size or use a larger training split."
        )


def _check_steps(num_steps, start_step):
    if not isinstance(num_steps, (int, np.integer)) or num_steps < 0:
        raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}.")
    if not isinstance(start_step, (int, np.integer)) or not 0 <= start_step <= num_steps:
        raise ValueError(
            f"start_step must be an int in [0, num_steps={num_steps}], got {start_step!r} "
            "(it is the number of updates already done by a resumed run)."
        )


def _to_host_variables(images, labels):
    """Non-trainable host-CPU copies, captured by reference in tf.data functions."""
    if tf.distribute.has_strategy():
        raise ValueError(
            "Build the data pipeline outside `strategy.scope()`: inside it the "
            "dataset arrays would be mirrored onto every device. Distribute the "
            "returned dataset with model.fit or strategy.experimental_distribute_dataset."
        )
    with tf.device("/CPU:0"):
        images_var = tf.Variable(
            images, trainable=False, dtype=tf.as_dtype(images.dtype), name="data_images"
        )
        labels_var = tf.Variable(
            tf.cast(labels, tf.int32), trainable=False, dtype=tf.int32, name="data_labels"
        )
    return images_var, labels_var
