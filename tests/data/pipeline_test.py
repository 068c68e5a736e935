"""Tests for tfdp.data.pipeline over in-memory arrays (ArraySource).

tfds_source_test.py runs the same pipeline over TFDS ArrayRecord files.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import data


def _source(num_examples):
    """Images whose every pixel is index % 251, labels = index: pairs are checkable."""
    labels = np.arange(num_examples, dtype=np.int32)
    images = np.broadcast_to((labels % 251).astype(np.uint8)[:, None, None, None],
                             (num_examples, 2, 2, 1)).copy()
    return data.ArraySource(images, labels, num_classes=num_examples)


def _collect(ds):
    """List of (images, labels) numpy batches; checks every image matches its label."""
    batches = list(ds.as_numpy_iterator())
    for images, labels in batches:
        assert images.dtype == np.uint8 and labels.dtype == np.int32
        np.testing.assert_array_equal(
            images, (labels % 251).astype(np.uint8)[:, None, None, None]
            * np.ones([1, 2, 2, 1], np.uint8))
    return batches


def _train(source, **kwargs):
    args = dict(sampling="poisson", batch_size=10, num_steps=20, seed=3)
    return _collect(data.train_batches(source, **{**args, **kwargs}))


def test_train_batches_read_the_sampled_indices_in_step_order():
    source = _source(100)
    ds = data.train_batches(source, sampling="poisson", batch_size=10, num_steps=20, seed=3)
    assert ds.element_spec == (tf.TensorSpec([None, 2, 2, 1], tf.uint8),
                               tf.TensorSpec([None], tf.int32))
    assert ds.cardinality() == 20
    for t, (_, labels) in enumerate(_collect(ds)):
        np.testing.assert_array_equal(
            labels, data.poisson_indices(3, t, num_examples=100, sampling_prob=0.1))


def test_train_batches_resume_at_start_step():
    source = _source(100)
    full, resumed = _train(source), _train(source, start_step=13)
    assert len(resumed) == 7
    for (_, a), (_, b) in zip(resumed, full[13:]):
        np.testing.assert_array_equal(a, b)


def test_shuffled_train_batches_have_the_fixed_size():
    batches = _train(_source(20), sampling="shuffle", batch_size=5, num_steps=6, start_step=2)
    assert [len(labels) for _, labels in batches] == [5] * 4


def test_float32_features_are_kept_float32():
    labels = np.arange(10, dtype=np.int32)
    features = np.linspace(0.0, 0.05, 10 * 4, dtype=np.float32).reshape(10, 2, 2, 1)
    source = data.ArraySource(features, labels, num_classes=10)
    (batch, _), = data.eval_batches(source, batch_size=10).as_numpy_iterator()
    np.testing.assert_array_equal(batch, features)  # values kept, not cast to uint8
    (batch, _), = data.train_batches(source, sampling="poisson", batch_size=10, num_steps=1,
                                     seed=0).as_numpy_iterator()
    np.testing.assert_array_equal(batch, features)  # q = 1: every example


def test_eval_batches_keep_order_and_the_last_partial_batch():
    batches = _collect(data.eval_batches(_source(10), batch_size=4))
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([b for _, b in batches]), np.arange(10))
    first = _collect(data.eval_batches(_source(10), batch_size=4, num_examples=5))
    assert [list(labels) for _, labels in first] == [[0, 1, 2, 3], [4]]
    assert len(_collect(data.eval_batches(_source(10), batch_size=4, num_examples=99))) == 3


def test_eval_batches_errors():
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        data.eval_batches(_source(10), batch_size=0)
    with pytest.raises(ValueError, match="num_examples must be None or >= 1"):
        data.eval_batches(_source(10), batch_size=2, num_examples=0)


def test_array_source_rejects_bad_arrays():
    images = np.zeros([10, 2, 2, 1], np.uint8)
    labels = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="images must be uint8 .* got float64"):
        data.ArraySource(images.astype(np.float64), labels, 10)
    with pytest.raises(ValueError, match="add a channel axis"):
        data.ArraySource(images[..., 0], labels, 10)
    with pytest.raises(ValueError, match=r"labels must be integers \[num_examples\] = \[10\]"):
        data.ArraySource(images, labels[:9], 10)
    with pytest.raises(ValueError, match="hold no examples"):
        data.ArraySource(images[:0], labels[:0], 10)


def test_array_source_holds_cached_features_of_any_rank():
    # A frozen trunk's features are [N, F] (issue 20); ScatterNet's [N, h, w, K].
    labels = np.arange(10, dtype=np.int32)
    features = np.random.RandomState(0).randn(10, 7).astype(np.float32)
    source = data.ArraySource(features, labels, 10)
    assert source.image_shape == (7,)
    images, read = source.read(tf.constant([3, 1], tf.int64))
    np.testing.assert_array_equal(images, features[[3, 1]])
    np.testing.assert_array_equal(read, [3, 1])
    with pytest.raises(ValueError, match="images must be uint8"):
        data.ArraySource(features[:, 0], labels, 10)  # rank 1: no feature axis
    with pytest.raises(ValueError, match="add a channel axis"):
        data.ArraySource(features.astype(np.uint8), labels, 10)  # pixels must be rank 4


def test_array_source_is_built_outside_a_strategy_scope():
    with tf.distribute.OneDeviceStrategy("/CPU:0").scope():
        with pytest.raises(ValueError, match=r"outside `strategy.scope\(\)`"):
            _source(10)
