"""TensorFlow 2.21's oneDNN broadcast-matmul bug never reaches the clipped sum.

With oneDNN on, `tf.matmul([8, 1, T, C], [C, O])` returns garbage for its last
batch entry or corrupts the heap (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`);
`tf.vectorized_map` makes that op of an EinsumDense on `[batch, T, C]`. DPModel
checks the traced ops of each chunk's contribution (not the layer list) and
computes the per-example gradients one example at a time where the vectorized
(or ghost) ops would meet it (`clip_paths.checked`). The crash itself is tested in
a process of its own: tests/training/onednn_differential_test.py.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp import host
from tfdp.training.dp_model import DPModel

C = 0.5


def _attention_model():
    """An EinsumDense projection on [batch, T, C]: vectorized_map makes the buggy matmul."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 4))
    x = keras.layers.MultiHeadAttention(2, 3, name="attention")(inputs, inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


def _sequence_model():
    """A Dense on [batch, T, C]: Keras computes it as a rank-2 matmul, which is safe."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 4))
    x = keras.layers.Dense(6, activation="tanh", name="on_sequence")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


class _Rank4Matmul(keras.layers.Layer):
    """Makes the buggy op itself, even for one example: [T/2, 1, 2, C] x [C, O]."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 3), name="kernel")

    def call(self, x):
        pairs = tf.reshape(x, [-1, 1, 2, x.shape[-1]])
        return tf.reshape(tf.matmul(pairs, self.kernel), [-1, x.shape[1], 3])


def _rank4_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4))
    x = _Rank4Matmul(name="rank4")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


def _mechanism(**kwargs):
    return accounting.DPMechanism(num_examples=100, batch_size=4, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=C, delta=1e-5, **kwargs)


def _contribution(builder, clipping, *, execute=True, **kwargs):
    """The DPModel and its chunk contribution; with `execute=False` only traced (this
    process has oneDNN on: the buggy op must not run here)."""
    dp = DPModel(builder(), _mechanism(**kwargs), clipping=clipping)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    rng = np.random.default_rng(0)
    images = rng.normal(size=(4, *dp.model.inputs[0].shape[1:])).astype(np.float32) * 3
    labels = np.array([0, 1, 1, 0], np.int32)
    ids = tf.constant([0, 1, 0, 1])
    if kwargs.get("num_microbatches"):
        run = tf.function(lambda x, y: dp._finish_accumulation(
            dp._chunk_contribution(x, y, tf.ones([4]), ids))[0])
    else:
        run = tf.function(lambda x, y: dp._chunk_contribution(x, y, tf.ones([4]))[0])
    if not execute:
        run.get_concrete_function(images, labels)
        return dp, None
    return dp, [t.numpy() for t in run(images, labels)]


@pytest.mark.parametrize("clipping, microbatches", [("vectorized", None), ("auto", 2)])
def test_the_buggy_vectorized_ops_run_one_example_at_a_time(monkeypatch, caplog, clipping,
                                                          microbatches):
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    with caplog.at_level(logging.WARNING):
        dp, summed = _contribution(_attention_model, clipping, num_microbatches=microbatches)
    assert dp.clipping_path == "loop"
    assert "one example at a time" in caplog.text
    assert "attention" in caplog.text and "BatchMatMulV2" in caplog.text  # names the ops
    # The same sum as TensorFlow's vectorized path where it is correct (oneDNN "off" for
    # the check only: this process still has oneDNN on, so compare with the ghost path,
    # which forms no broadcast matmul, for per-example clipping).
    if microbatches is None:
        ghost, reference = _contribution(_attention_model, "ghost")
        assert ghost.clipping_path == "ghost"
        for a, b in zip(summed, reference):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_model_that_makes_the_buggy_matmul_itself_is_refused(monkeypatch):
    # Refused at compile, from the traced forward pass, before the mixing probe would run
    # the op (in this process, with oneDNN on, running it can corrupt the heap).
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    with pytest.raises(ValueError, match=r"own forward pass forms batch matmuls .*"
                                         r"BatchMatMulV2 .*rank4.*TF_ENABLE_ONEDNN_OPTS=0"):
        _contribution(_rank4_model, "vectorized", execute=False)


def test_a_model_whose_step_alone_forms_the_buggy_matmul_is_refused(monkeypatch):
    # The forward pass on a batch is safe, but each example's is not: refused at the trace
    # of the step (the per-example loop cannot help).
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    dp = DPModel(_rank4_model(), _mechanism(), clipping="vectorized")
    dp._mixing_checked = True  # as if compiled: the probe's own refusal is tested above
    spec = (tf.TensorSpec([4, 4, 4]), tf.TensorSpec([4], tf.int32), tf.TensorSpec([4]))
    with pytest.raises(ValueError, match=r"even one example at a time: BatchMatMulV2 .*rank4"):
        tf.function(lambda x, y, m: dp._chunk_contribution(x, y, m)[0]).get_concrete_function(
            *spec)


@pytest.mark.slow
def test_safe_graphs_keep_their_path_and_onednn_off_checks_nothing(monkeypatch):
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    dp, _ = _contribution(_sequence_model, "vectorized")  # Dense on [batch, T, C]: rank 2
    assert dp.clipping_path == "vectorized"
    dp, _ = _contribution(_attention_model, "ghost")  # the ghost rules form no such op
    assert dp.clipping_path == "ghost"
    monkeypatch.setattr(host, "onednn_enabled", lambda: False)
    dp, _ = _contribution(_attention_model, "vectorized", execute=False)
    assert dp.clipping_path == "vectorized"


def test_a_batch_of_unknown_size_keeps_attention_on_the_ghost_path(monkeypatch, caplog):
    # Poisson batches have an unknown size when the step is traced; two batch axes that
    # both are the batch cannot be proven equal there, and every attention model ran one
    # example at a time. The check re-reads the graph at a known size.
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    dp = DPModel(_attention_model(), _mechanism(), clipping="ghost")
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    spec = (tf.TensorSpec([None, 5, 4]), tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([None]))
    with caplog.at_level(logging.WARNING):
        tf.function(lambda x, y, m: dp._chunk_contribution(x, y, m)[0]).get_concrete_function(
            *spec)
    assert dp.clipping_path == "ghost" and "one example at a time" not in caplog.text
    # The vectorized path's pfor matmul broadcasts at any batch size: still rerouted.
    dp = DPModel(_attention_model(), _mechanism(), clipping="vectorized")
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    tf.function(lambda x, y, m: dp._chunk_contribution(x, y, m)[0]).get_concrete_function(*spec)
    assert dp.clipping_path == "loop"


def test_an_unknown_onednn_state_counts_as_on(monkeypatch):
    monkeypatch.setattr(host, "onednn_enabled", lambda: None)
    dp, _ = _contribution(_attention_model, "vectorized", execute=False)
    assert dp.clipping_path == "loop"
