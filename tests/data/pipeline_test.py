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
    # A frozen trunk's features are [N, F]; ScatterNet's [N, h, w, K].
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


# -- train_chunks: each host's share of every logical batch, one chunk per element --

def _chunks(source, replicas, **kwargs):
    args = dict(sampling="poisson", batch_size=30, num_steps=4, seed=3, num_replicas=4,
                accumulation_steps=2)
    return list(data.train_chunks(source, replicas=replicas, **{**args, **kwargs})
                .as_numpy_iterator())


@pytest.mark.parametrize("static_batch_size", [None, 48])
def test_hosts_read_disjoint_chunks_whose_union_is_the_truncated_batch(static_batch_size):
    # R = 4 replicas, a = 2 chunks: host 0 owns replicas 0-1, host 1 replicas 2-3. The
    # padded index vector of a step (S = 48: n = 6; variable: n = ceil(|B| / 8)) is cut
    # into 8 slices; replica r's chunk j is slice 2r + j.
    source = _source(100)
    hosts = [_chunks(source, range(0, 2), static_batch_size=static_batch_size),
             _chunks(source, range(2, 4), static_batch_size=static_batch_size)]
    assert len(hosts[0]) == len(hosts[1]) == 4 * 2 * 2  # steps x chunks x local replicas
    for step in range(4):
        batch = data.poisson_indices(3, step, num_examples=100, sampling_prob=0.3)
        kept = batch[:static_batch_size]
        n = static_batch_size // 8 if static_batch_size else max(1, -(-len(batch) // 8))
        for host, elements in enumerate(hosts):
            for j in range(2):
                for local in range(2):
                    images, labels, mask = elements[step * 4 + j * 2 + local]
                    slot = ((2 * host + local) * 2 + j) * n
                    real = kept[slot:slot + n]
                    assert labels.shape == mask.shape == (n,) and images.shape[0] == n
                    np.testing.assert_array_equal(labels[:len(real)], real)
                    np.testing.assert_array_equal(mask, [1.0] * len(real) + [0.0] * (n - len(real)))
                    np.testing.assert_array_equal(labels[len(real):], 0)  # padding: zeros
                    assert not images[len(real):].any()
        read = np.concatenate([e[1][e[2] > 0] for h in hosts for e in h[step * 4:step * 4 + 4]])
        np.testing.assert_array_equal(np.sort(read), np.sort(kept))


def test_static_chunks_have_static_shapes_and_the_map_sees_real_examples_only():
    seen = []

    def map_fn(step, images, labels):
        seen.append(images.shape[0])  # traced: None (real examples only, then padded)
        return tf.cast(images, tf.float32)[:, None] + tf.cast(step, tf.float32), labels

    ds = data.train_chunks(_source(100), sampling="poisson", batch_size=30, num_steps=2,
                           seed=3, num_replicas=2, accumulation_steps=3,
                           static_batch_size=42, map_fn=map_fn)
    assert ds.element_spec == (tf.TensorSpec([7, 1, 2, 2, 1], tf.float32),
                               tf.TensorSpec([7], tf.int32), tf.TensorSpec([7], tf.float32))
    assert seen == [None]
    images, labels, mask = next(ds.skip(2).as_numpy_iterator())  # step 0, chunk 1, replica 0
    real = int(mask.sum())
    np.testing.assert_array_equal(images[:real, 0, 0, 0, 0], labels[:real] % 251)  # step 0


def test_train_chunks_refuses_a_size_or_replicas_that_do_not_fit():
    with pytest.raises(ValueError, match="multiple of replicas x accumulation_steps = 8"):
        data.train_chunks(_source(100), sampling="poisson", batch_size=30, num_steps=2,
                          seed=3, num_replicas=4, accumulation_steps=2, static_batch_size=44)
    with pytest.raises(ValueError, match="contiguous range inside range"):
        data.train_chunks(_source(100), sampling="poisson", batch_size=30, num_steps=2,
                          seed=3, num_replicas=4, replicas=range(3, 5))
