"""Augmentation multiplicity: K independently augmented views per example.

De et al. 2022 (Sec. 3.1, eq. (4); App. A.1, Algorithm 1) average each
example's gradient over K augmented views *before* clipping, so the
sensitivity, hence the privacy cost, does not grow with K. The input pipeline
produces the views on the host, inside `tf.data`:

    (images: uint8 [batch, H, W, C], labels: int32 [batch])
        -> (views: float32 [batch, K, H', W', C], labels: int32 [batch])

with K = max(augmult, 1). The trainer flattens `views` to `[batch * K, ...]` for
the forward pass, and averages the per-view gradients per example (over
axis 1) before clipping. augmult = 0 means "no augmentation" (De et al. 2022,
App. C.2): the single view is the un-augmented image.

Seeds. One base seed per run; it is public. The batch at dataset position
`step` uses `step_seed = tf.random.fold_in(seed, step)`, and in the training
input (`make_augmult_map_fn`, `augment_dataset`, `tfdp.data.train_chunks`) an
example's K views are keyed by that step seed and the example's own pixels
(`example_keyed_views`), never by its position in the batch: with a public
seed, position keys would let one added example shift every later example's
views, beyond the sensitivity C. All ops are stateless, so a restarted or
resumed run sees exactly the same views, eagerly or in tf.data.

Typical use in the trainer (the dataset yields `(images, labels)` per step):

    augment_fn = get_augmentation("cifar_crop_flip")
    train_ds = augment_dataset(
        train_ds, augment_fn=augment_fn, augmult=16, seed=seed,
        start_step=initial_step)      # the step a resumed run restarts at
    for views, labels in train_ds: ...  # views: [batch, 16, 32, 32, 3]

or, equivalently,
`train_ds.enumerate(start=initial_step).map(make_augmult_map_fn(...))`.
"""

from typing import Callable, Sequence, Union

import tensorflow as tf

AugmentFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
Seed = Union[int, Sequence[int], tf.Tensor]

# Views augmented concurrently by tf.map_fn in graph mode (tf.data, tf.function).
PARALLEL_ITERATIONS = 32


def _check_augmult(augmult, fn_name: str) -> int:
    if isinstance(augmult, bool) or not isinstance(augmult, int) or augmult < 0:
        raise ValueError(
            f"{fn_name}: augmult must be an int >= 0 (0 = no augmentation, one "
            f"un-augmented view; K >= 1 = K augmented views), got {augmult!r}."
        )
    return augmult


def as_seed(seed: Seed) -> tf.Tensor:
    """Converts a seed to the `int64 [2]` form stateless ops take.

    Args:
      seed: a Python int `s` (becomes `[0, s]`), a pair of ints, or an int32 /
        int64 tensor of shape [2].

    Returns:
      int64 [2] (int32 tensors are widened; the values are unchanged).

    Raises:
      ValueError: if `seed` is not an int, a pair, or an integer tensor of
        shape [2].
    """
    if isinstance(seed, int) and not isinstance(seed, bool):
        return tf.constant([0, seed], tf.int64)
    seed = tf.convert_to_tensor(seed)
    if not seed.dtype.is_integer or (
        seed.shape.rank is not None and seed.shape.as_list() != [2]
    ):
        raise ValueError(
            "seed must be an int or an integer tensor of shape [2] (as taken by "
            f"tf.random.stateless_*), got {seed.dtype.name} {seed.shape}."
        )
    return tf.cast(seed, tf.int64)


def augmult_views(
    images: tf.Tensor, seed: Seed, *, augment_fn: AugmentFn, augmult: int
) -> tf.Tensor:
    """K independently augmented views of every image in a batch.

    De et al. 2022, Sec. 3.1, eq. (4): the set of K augmentations of example i
    at step t. View k of example i is `augment_fn(image_i, seeds[i * K + k])`
    with `seeds = tf.random.split(seed, batch * K)`, so views differ across
    examples and across k, and are reproducible from `seed`. Works eagerly and
    inside `tf.data` / `tf.function` with an unknown (None) batch size.

    Args:
      images: uint8 or float32 [batch, height, width, channels], values in
        [0, 255] (uint8 is cast to float32, not rescaled).
      seed: int, pair of ints, or int32/int64 tensor [2]; one per batch (see
        `make_augmult_map_fn` for one per step).
      augment_fn: `fn(image: float32 [H, W, C], seed: int64 [2]) ->
        float32 [H', W', C]`, e.g. from `get_augmentation`.
      augmult: K, the number of views per example (De et al. 2022, Sec. 3.1).
        0 means no augmentation: `augment_fn` is not called and the image is
        returned as one view.

    Returns:
      float32 [batch, max(augmult, 1), H', W', C] in [0, 255]; for augmult = 0,
      `images[:, None]` cast to float32 (so `H' = H`, `W' = W`).

    Raises:
      ValueError: if `augmult` is not an int >= 0, if `images` is not rank 4,
        or if its dtype is neither uint8 nor float32.
    """
    augmult = _check_augmult(augmult, "augmult_views")
    images = tf.cast(_check_images(images, "augmult_views"), tf.float32)
    if augmult == 0:
        return images[:, tf.newaxis]
    seed = as_seed(seed)
    batch = tf.shape(images)[0]
    seeds = tf.random.split(seed, batch * augmult)  # [batch * K, 2]
    return _views(images, seeds, augment_fn=augment_fn, augmult=augmult)


def _check_images(images, fn_name):
    images = tf.convert_to_tensor(images)
    if images.shape.rank != 4:
        raise ValueError(
            f"{fn_name}: images must be [batch, height, width, channels], got "
            f"shape {images.shape}."
        )
    if images.dtype not in (tf.uint8, tf.float32):
        raise ValueError(
            f"{fn_name}: images must be uint8 or float32 with values in "
            f"[0, 255], got {images.dtype.name}."
        )
    return images


def example_keyed_views(
    images: tf.Tensor, step_seed: Seed, *, augment_fn: AugmentFn, augmult: int
) -> tf.Tensor:
    """K views per example, each example's seeds keyed by its own pixels, not its position.

    View k of example i is `augment_fn(image_i, tf.random.split(s_i, K)[k])`
    with `s_i = tf.random.fold_in(step_seed, fingerprint(image_i))`
    (`tf.fingerprint`, farmhash64 of the pixels). So an example's views at a
    step depend only on (seed, step, the example), never on which other
    examples were sampled, nor on the chunk, replica or host that processes
    it. That is what the sensitivity argument of DP-SGD with a PUBLIC
    augmentation seed needs: the update is a sum over the sampled examples of
    a function of each example alone, so adding one example adds one term of
    norm <= C (`tfdp.training.distribute`, module docstring). Position-keyed
    seeds (`augmult_views`) shift the views of every later example when one is
    added. Identical images get identical views (each still counts once).

    Args:
      images: uint8 or float32 [batch, height, width, channels] in [0, 255].
      step_seed: int, pair of ints or int tensor [2]: the run's augmentation
        seed folded with the step.
      augment_fn, augmult: as `augmult_views`.

    Returns:
      float32 [batch, max(augmult, 1), H', W', C], as `augmult_views`.

    Raises:
      ValueError: as `augmult_views`.
    """
    augmult = _check_augmult(augmult, "example_keyed_views")
    images = tf.cast(_check_images(images, "example_keyed_views"), tf.float32)
    if augmult == 0:
        return images[:, tf.newaxis]
    step_seed = as_seed(step_seed)
    keys = tf.bitcast(tf.fingerprint(images), tf.int64)  # [batch], from the pixels alone
    per_example = tf.map_fn(
        lambda key: tf.random.split(tf.random.fold_in(step_seed, key), augmult),
        keys, fn_output_signature=tf.TensorSpec([augmult, 2], tf.int64))
    seeds = tf.reshape(per_example, [-1, 2])  # example-major: i * K + k
    return _views(images, seeds, augment_fn=augment_fn, augmult=augmult)


def _views(images, seeds, *, augment_fn, augmult):
    """`augment_fn(images[i], seeds[i * K + k])` as float32 [batch, K, H', W', C]."""
    batch = tf.shape(images)[0]
    repeated = tf.repeat(images, augmult, axis=0)  # example-major: i * K + k

    def augment_one(image_and_seed):
        return augment_fn(*image_and_seed)

    # tf.map_fn rather than tf.vectorized_map: pfor has no converters for the
    # stateless random / MirrorPad / resize ops and its while-loop fallback was
    # ~4x slower (and fails on crops of varying size inside RRC).
    views = tf.map_fn(
        augment_one,
        (repeated, seeds),
        fn_output_signature=tf.float32,
        parallel_iterations=PARALLEL_ITERATIONS,
    )
    views = tf.reshape(
        views, tf.concat([[batch, augmult], tf.shape(views)[1:]], axis=0)
    )
    views.set_shape([images.shape[0], augmult] + views.shape.as_list()[2:])
    return views


def to_uint8_pixels(views: tf.Tensor) -> tf.Tensor:
    """float32 views in [0, 255] rounded to uint8 pixels (clipped): 4x less memory.

    The rounding error is below half a pixel level; the model casts back to
    float32.
    """
    return tf.cast(tf.clip_by_value(tf.round(views), 0.0, 255.0), tf.uint8)


def make_augmult_map_fn(
    *, augment_fn: AugmentFn, augmult: int, seed: Seed
) -> Callable[[tf.Tensor, tuple], tuple]:
    """A `Dataset.map` function for `dataset.enumerate()` of (images, labels).

    The batch at position `step` gets `tf.random.fold_in(seed, step)` as its
    seed, so every step sees fresh augmentations and a run restarted from step
    s (`dataset.enumerate(start=s)`) sees the same ones as the original run.
    Each example's views are keyed by that seed and its own pixels
    (`example_keyed_views`), not by its position in the batch.
    Use a different `seed` for evaluation (AugTest) than for training.

    Example:

        map_fn = make_augmult_map_fn(augment_fn=cifar_crop_flip, augmult=16,
                                     seed=seed)
        ds = ds.enumerate(start=initial_step).map(map_fn)
        # elements: (float32 [batch, 16, H, W, C], int32 [batch])

    Args:
      augment_fn: per-image augmentation, see `augmult_views`.
      augmult: K >= 0, see `augmult_views`.
      seed: the run's base seed: int, pair of ints, or int tensor [2].

    Returns:
      `map_fn(step: int64 [], (images: uint8|float32 [batch, H, W, C],
      labels: [batch])) -> (views: float32 [batch, max(augmult, 1), H', W', C],
      labels)`, labels passed through unchanged.

    Raises:
      ValueError: if `augmult` is not an int >= 0 or `seed` is malformed (at
        construction), or as `augmult_views` (when traced).
    """
    augmult = _check_augmult(augmult, "make_augmult_map_fn")
    base_seed = as_seed(seed)

    def map_fn(step, batch):
        images, labels = batch
        step_seed = tf.random.fold_in(base_seed, tf.cast(step, tf.int64))
        views = example_keyed_views(
            images, step_seed, augment_fn=augment_fn, augmult=augmult
        )
        return views, labels

    return map_fn


def augment_dataset(
    dataset: tf.data.Dataset,
    *,
    augment_fn: AugmentFn,
    augmult: int,
    seed: Seed,
    start_step: int = 0,
    num_parallel_calls: int | None = tf.data.AUTOTUNE,
    as_uint8: bool = False,
) -> tf.data.Dataset:
    """Maps a dataset of (images, labels) batches to (views, labels).

    Equals `dataset.enumerate(start=start_step).map(make_augmult_map_fn(...))`
    with deterministic element order. A resumed run passes the number of
    dataset elements (batches) already consumed as `start_step` to see the same
    augmentations as an uninterrupted run (De et al. 2022, Sec. 3.1, eq. (4)).

    Args:
      dataset: elements `(images: uint8|float32 [batch, H, W, C],
        labels: [batch])`; the batch size may vary (None).
      augment_fn: per-image augmentation, see `augmult_views`.
      augmult: K >= 0, see `augmult_views`.
      seed: base seed: int, pair of ints, or int tensor [2].
      start_step: index of the first element (>= 0), used for its seed.
      num_parallel_calls: passed to `Dataset.map`.
      as_uint8: round the views to uint8 pixels (clipped to [0, 255]): 4x
        less memory than float32 on the host, in the transfer and on the
        device, for a rounding error below half a pixel level (the inputs
        are uint8 pixels; the model casts to float32). For `imagenet.gin`'s
        logical batch of 16384 x 4 views of 224 x 224 x 3: 9.9 GB, not 39 GB.

    Returns:
      `tf.data.Dataset` of `(views: float32 (or uint8) [batch, max(augmult, 1),
      H', W', C], labels: [batch])`.

    Raises:
      ValueError: if `start_step < 0`, or as `make_augmult_map_fn`.
    """
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(
            f"augment_dataset: start_step must be an int >= 0, got {start_step!r}."
        )
    map_fn = make_augmult_map_fn(augment_fn=augment_fn, augmult=augmult, seed=seed)
    if as_uint8:
        float_map_fn = map_fn

        def map_fn(step, batch):  # pylint: disable=function-redefined
            views, labels = float_map_fn(step, batch)
            return to_uint8_pixels(views), labels

    return dataset.enumerate(start=start_step).map(
        map_fn, num_parallel_calls=num_parallel_calls, deterministic=True
    )
