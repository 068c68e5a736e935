"""TensorFlow 2.21's oneDNN broadcast-matmul bug keeps off the vectorized path.

With oneDNN on, `tf.matmul([B, 1, T, C], [C, O])` returns garbage for its last batch
entry (BUILD.md, issue 20 section); `tf.vectorized_map` makes exactly that op of a Dense
on `[batch, T, C]`, so DPModel refuses that case (`refuse_onednn_broadcast_matmul`).
"""

import keras
import pytest

from tfdp import accounting
from tfdp import host
from tfdp.training.dp_model import DPModel

C = 0.5


def _sequence_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5, 4))
    x = keras.layers.Dense(6, activation="tanh", name="on_sequence")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


def _sequence_mechanism(**kwargs):
    return accounting.DPMechanism(num_examples=100, batch_size=2, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=C, delta=1e-5, **kwargs)


@pytest.mark.parametrize("clipping, microbatches", [("vectorized", None), ("auto", 2)])
def test_the_vectorized_path_through_a_buggy_onednn_matmul_is_refused(monkeypatch, clipping,
                                                                     microbatches):
    # With oneDNN on, tf.matmul([B, 1, T, C], [C, O]) (what vectorized_map makes of a Dense
    # on [batch, T, C]) returns garbage for the last batch entry in TF 2.21.
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    dp = DPModel(_sequence_model(), _sequence_mechanism(num_microbatches=microbatches),
                 clipping=clipping)
    with pytest.raises(ValueError, match=r"\['on_sequence'\].*TF_ENABLE_ONEDNN_OPTS=0"):
        dp.compile(optimizer=keras.optimizers.SGD(1.0))


def test_the_ghost_path_and_onednn_off_are_not_refused(monkeypatch):
    monkeypatch.setattr(host, "onednn_enabled", lambda: True)
    dp = DPModel(_sequence_model(), _sequence_mechanism(), clipping="ghost")
    dp.compile(optimizer=keras.optimizers.SGD(1.0))  # every Dense has a rule
    assert dp.clipping_path == "ghost"
    monkeypatch.setattr(host, "onednn_enabled", lambda: False)
    dp = DPModel(_sequence_model(), _sequence_mechanism(), clipping="vectorized")
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
