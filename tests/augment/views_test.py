"""Tests for tfdp.augment.views (augmult views), eagerly AND inside tf.data."""

import functools

import numpy as np
import pytest
import tensorflow as tf

from tfdp import augment

MODES = ("eager", "tf_data")


def _views(mode, images, seed, **kwargs):
    """augmult_views eagerly, or as a Dataset.map over one batch."""
    fn = functools.partial(augment.augmult_views, **kwargs)
    if mode == "eager":
        return fn(images, seed).numpy()
    ds = tf.data.Dataset.from_tensors((images, seed)).map(fn)
    return ds.get_single_element().numpy()


def _uint8_images(batch, height=8, width=8, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    return tf.constant(
        rng.integers(0, 256, size=(batch, height, width, channels), dtype=np.uint8)
    )


SEED = tf.constant([3, 4], tf.int64)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("augmult", [1, 3])
def test_shape_dtype_range(mode, augmult):
    images = _uint8_images(2)
    views = _views(mode, images, SEED, augment_fn=augment.cifar_crop_flip, augmult=augmult)
    assert views.shape == (2, augmult, 8, 8, 3)
    assert views.dtype == np.float32
    assert views.min() >= 0 and views.max() <= 255


@pytest.mark.parametrize("mode", MODES)
def test_output_size_follows_augment_fn(mode):
    fn = augment.get_augmentation("imagenet_resize_crop", image_size=6)
    views = _views(mode, _uint8_images(2, 10, 12), SEED, augment_fn=fn, augmult=2)
    assert views.shape == (2, 2, 6, 6, 3)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.uint8, tf.float32])
def test_augmult_zero_is_the_input_as_one_view(mode, dtype):
    images = tf.cast(_uint8_images(3), dtype)
    views = _views(mode, images, SEED, augment_fn=augment.cifar_crop_flip, augmult=0)
    assert views.shape == (3, 1, 8, 8, 3) and views.dtype == np.float32
    np.testing.assert_array_equal(views[:, 0], images.numpy().astype(np.float32))


@pytest.mark.parametrize("mode", MODES)
def test_identity_with_four_views_repeats_the_input(mode):
    images = _uint8_images(2)
    views = _views(mode, images, SEED, augment_fn=augment.identity, augmult=4)
    expected = np.repeat(images.numpy()[:, None].astype(np.float32), 4, axis=1)
    np.testing.assert_array_equal(views, expected)  # [2, 4, 8, 8, 3]


@pytest.mark.parametrize("mode", MODES)
def test_random_views_differ_within_and_across_examples(mode):
    # Three copies of the same image: only the per-view seeds differ.
    images = tf.repeat(_uint8_images(1), 3, axis=0)
    views = _views(mode, images, SEED, augment_fn=augment.cifar_crop_flip, augmult=4)
    for i in range(3):
        assert len({views[i, k].tobytes() for k in range(4)}) > 1
    assert not np.array_equal(views[0], views[1])
    assert not np.array_equal(views[1], views[2])


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_given_seed_and_seed_dependent(mode):
    images = _uint8_images(4)
    kw = dict(augment_fn=augment.cifar_crop_flip, augmult=2)
    first = _views(mode, images, SEED, **kw)
    np.testing.assert_array_equal(first, _views(mode, images, SEED, **kw))
    np.testing.assert_array_equal(first, _views("eager", images, SEED, **kw))
    other = _views(mode, images, tf.constant([3, 5], tf.int64), **kw)
    assert not np.array_equal(first, other)


def test_view_k_of_example_i_uses_split_seed_i_times_k_plus_k():
    # Documented contract: seeds = split(seed, batch * K); view (i, k) uses
    # seeds[i * K + k].
    images = _uint8_images(2)
    views = augment.augmult_views(
        images, SEED, augment_fn=augment.cifar_crop_flip, augmult=3
    ).numpy()
    seeds = tf.random.split(SEED, 6)
    for i in range(2):
        for k in range(3):
            expected = augment.cifar_crop_flip(
                tf.cast(images[i], tf.float32), seeds[i * 3 + k]
            )
            np.testing.assert_array_equal(views[i, k], expected.numpy())


def test_int_seed_equals_pair_seed():
    images = _uint8_images(2)
    kw = dict(augment_fn=augment.cifar_crop_flip, augmult=2)
    np.testing.assert_array_equal(
        augment.augmult_views(images, 7, **kw), augment.augmult_views(images, [0, 7], **kw)
    )


def _labelled_dataset(num_examples=10, batch_size=4):
    images = _uint8_images(num_examples)
    labels = tf.range(num_examples, dtype=tf.int32)
    return tf.data.Dataset.from_tensor_slices((images, labels)).batch(batch_size)


def test_map_fn_on_variable_batch_sizes_passes_labels_through():
    ds = _labelled_dataset().enumerate().map(
        augment.make_augmult_map_fn(augment_fn=augment.cifar_crop_flip, augmult=2, seed=0)
    )
    views_spec, labels_spec = ds.element_spec
    assert views_spec == tf.TensorSpec([None, 2, 8, 8, 3], tf.float32)
    assert labels_spec == tf.TensorSpec([None], tf.int32)
    batches = list(ds.as_numpy_iterator())
    assert [v.shape[0] for v, _ in batches] == [4, 4, 2]  # 10 = 4 + 4 + 2
    np.testing.assert_array_equal(np.concatenate([l for _, l in batches]), np.arange(10))


def test_each_step_gets_fresh_views_and_resume_reproduces_them():
    one_batch = _labelled_dataset(num_examples=4).take(1)
    kw = dict(augment_fn=augment.cifar_crop_flip, augmult=2, seed=[1, 2])
    full = [v for v, _ in augment.augment_dataset(one_batch.repeat(3), **kw)]
    # Same images at steps 0, 1, 2 -> different views.
    assert not np.array_equal(full[0], full[1])
    assert not np.array_equal(full[1], full[2])
    # A second run is identical; a run resumed at step 2 sees step 2's views.
    again = [v for v, _ in augment.augment_dataset(one_batch.repeat(3), **kw)]
    for a, b in zip(full, again):
        np.testing.assert_array_equal(a, b)
    resumed = [v for v, _ in augment.augment_dataset(one_batch, start_step=2, **kw)]
    np.testing.assert_array_equal(resumed[0], full[2])
    # make_augmult_map_fn + enumerate is the same pipeline.
    manual = one_batch.repeat(3).enumerate().map(augment.make_augmult_map_fn(**kw))
    np.testing.assert_array_equal(next(iter(manual))[0], full[0])


def test_errors():
    images = _uint8_images(1)
    fn = augment.cifar_crop_flip
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"augmult must be an int >= 0.*got"):
            augment.augmult_views(images, SEED, augment_fn=fn, augmult=bad)
    with pytest.raises(ValueError, match=r"augmult must be an int >= 0"):
        augment.make_augmult_map_fn(augment_fn=fn, augmult=-2, seed=0)
    with pytest.raises(ValueError, match=r"\[batch, height, width, channels\]"):
        augment.augmult_views(images[0], SEED, augment_fn=fn, augmult=1)
    with pytest.raises(ValueError, match=r"uint8 or float32.*int32"):
        augment.augmult_views(tf.cast(images, tf.int32), SEED, augment_fn=fn, augmult=1)
    with pytest.raises(ValueError, match=r"seed must be an int or an integer tensor"):
        augment.augmult_views(images, [1, 2, 3], augment_fn=fn, augmult=1)
    with pytest.raises(ValueError, match=r"start_step must be an int >= 0"):
        augment.augment_dataset(
            _labelled_dataset(), augment_fn=fn, augmult=1, seed=0, start_step=-1
        )


def test_uint8_views_are_the_float_views_rounded():
    # The trainer keeps views as uint8 (4x less memory): each is the float view rounded,
    # also through a resize whose output is not whole pixel values.
    one_batch = _labelled_dataset(num_examples=4).take(1)
    for name in ("cifar_crop_flip", "imagenet_resize_crop"):
        fn = augment.get_augmentation(name, **({"image_size": 8} if "imagenet" in name else {}))
        kw = dict(augment_fn=fn, augmult=3, seed=[1, 2])
        (floats, _), = augment.augment_dataset(one_batch, **kw).as_numpy_iterator()
        (pixels, _), = augment.augment_dataset(one_batch, as_uint8=True, **kw).as_numpy_iterator()
        assert floats.dtype == np.float32 and pixels.dtype == np.uint8
        np.testing.assert_array_equal(pixels, np.clip(np.round(floats), 0, 255))
        assert np.abs(pixels - floats).max() <= 0.5


def test_example_keyed_views_do_not_depend_on_the_other_examples_or_the_position():
    # Three distinct images; x's views alone, first of [x, y] and last of [z, y, x] are
    # the same (position-keyed `augmult_views` gives x other views at another position:
    # adding an example to a batch would change the views of every later one).
    rng = np.random.default_rng(0)
    x, y, z = (rng.integers(0, 256, [1, 12, 12, 3]).astype(np.uint8) for _ in range(3))
    fn = augment.get_augmentation("cifar_crop_flip")
    seed = tf.random.fold_in(augment.as_seed([5, 1]), 7)  # the seed of step 7
    views = lambda images: augment.example_keyed_views(  # noqa: E731
        np.concatenate(images), seed, augment_fn=fn, augmult=3).numpy()
    alone = views([x])[0]
    np.testing.assert_array_equal(views([x, y])[0], alone)
    np.testing.assert_array_equal(views([z, y, x])[2], alone)
    assert alone.shape == (3, 12, 12, 3)
    assert not np.array_equal(alone[0], alone[1])  # K different views
    by_position = augment.augmult_views(np.concatenate([z, y, x]), seed, augment_fn=fn,
                                        augmult=3).numpy()
    assert not np.array_equal(by_position[2], augment.augmult_views(
        x, seed, augment_fn=fn, augmult=3).numpy()[0])
    # Another step, other views.
    other = augment.example_keyed_views(x, tf.random.fold_in(augment.as_seed([5, 1]), 8),
                                        augment_fn=fn, augmult=3).numpy()[0]
    assert not np.array_equal(other, alone)


def test_example_keyed_views_in_tf_data_equal_eager():
    x = np.random.default_rng(1).integers(0, 256, [4, 12, 12, 3]).astype(np.uint8)
    fn = augment.get_augmentation("cifar_crop_flip")
    eager = augment.example_keyed_views(x, [0, 3], augment_fn=fn, augmult=2).numpy()
    ds = tf.data.Dataset.from_tensors(x).map(
        lambda images: augment.example_keyed_views(images, [0, 3], augment_fn=fn, augmult=2))
    np.testing.assert_array_equal(next(ds.as_numpy_iterator()), eager)


def test_augment_dataset_keys_views_by_example_not_by_position():
    # The public training-input API (augment_dataset / make_augmult_map_fn) must not let
    # one added example shift the views of the others: its seed is public.
    rng = np.random.default_rng(2)
    x, y = (rng.integers(0, 256, [1, 12, 12, 3]).astype(np.uint8) for _ in range(2))
    kw = dict(augment_fn=augment.get_augmentation("cifar_crop_flip"), augmult=2, seed=[5, 1])

    def views(images):
        ds = tf.data.Dataset.from_tensors((np.concatenate(images), np.zeros(len(images))))
        return next(iter(augment.augment_dataset(ds, **kw)))[0].numpy()

    np.testing.assert_array_equal(views([y, x])[1], views([x])[0])
