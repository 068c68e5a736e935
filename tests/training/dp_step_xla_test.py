"""The whole DP train step compiles with XLA, with no float64 op and no host callback.

A TPU has no float64 and cannot run a Python callback; XLA compiles the step
as a TPU needs it (`jit_compile=True`, static shapes). For every shipped model
family, one DP step runs through `DPModel.train_on_batch` with
`jit_compile=True` (XLA compiles and runs it on this CPU), and the traced
step (`DPModel.train_step`'s concrete function, nested functions included,
read with `tfdp.graph_checks`) and its HLO are inspected: no node computes,
holds or casts to float64, no `PyFunc`/`EagerPyFunc`, and no `f64` in the HLO.

The default suite checks the Tramer & Boneh CNN and a small GN + WS WRN; the
other families (WRN-16-4, a small NF-ResNet, ScatterNet heads and classifier,
a keras.applications backbone fine-tuned `head` and `all`) run under
`-m slow` (their result is in docs/design/ghost_norms_and_precision.md, "XLA, as a
TPU needs it").
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp import models
from tfdp import graph_checks
from tfdp.training.dp_model import DPModel

from tests.training import ghost_testing


def _mechanism(batch_size):
    return accounting.DPMechanism(num_examples=1000, batch_size=batch_size, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)


def compiled_dp_step(model, shape, *, batch=4, scale=255.0, num_views=None, cls=DPModel,
                     run=True):
    """Runs one XLA-compiled DP step of `model`; returns `(dp, nodes, hlo, logs)`.

    `nodes`: `graph_checks.graph_nodes` of the traced train step; `hlo`: the
    text of its XLA HLO (before optimization); `logs`: the step's, or None
    with `run=False` (traced and lowered, not compiled or run).
    """
    rng = np.random.default_rng(0)
    views = () if num_views is None else (num_views,)
    x = rng.uniform(0, scale, (batch, *views, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)
    dp = cls(model, _mechanism(batch), clipping="auto", noise_seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
    logs = dp.train_on_batch(x, y, return_dict=True) if run else None
    step = tf.function(dp.train_step, jit_compile=True, autograph=False)
    data = (tf.constant(x), tf.constant(y))
    concrete = step.get_concrete_function(data)
    hlo = step.experimental_get_compiler_ir(data)(stage="hlo")
    return dp, graph_checks.graph_nodes(concrete), hlo, logs


def assert_tpu_ready(nodes, hlo):
    """No float64 node, no host callback, no f64 in the HLO; the messages name them."""
    float64 = graph_checks.nodes_of_dtype(nodes, tf.float64)
    assert not float64, "float64 in the DP step: " + "; ".join(n.describe() for n in float64[:8])
    callbacks = graph_checks.host_callbacks(nodes)
    assert not callbacks, "host callbacks in the DP step: " + "; ".join(
        n.describe() for n in callbacks)
    assert "f64" not in hlo


FAST = {
    "tramer_cnn": (lambda: models.build_tramer_cnn(10), (28, 28, 1), 255.0),
    "wrn_gn_ws": ghost_testing.FAMILIES["wrn_gn_ws"],
}


@pytest.mark.parametrize("family", [
    # The WRN (63 s) under -m slow (tests/run_slow.sh), like the other families.
    pytest.param(family, marks=[pytest.mark.slow] if family == "wrn_gn_ws" else [])
    for family in sorted(FAST)])
def test_the_compiled_dp_step_has_no_float64_and_no_host_callback(family):
    builder, shape, scale = FAST[family]
    keras.utils.set_random_seed(0)
    dp, nodes, hlo, logs = compiled_dp_step(builder(), shape, scale=scale)
    assert dp.clipping_path == "ghost"
    assert np.isfinite(logs["loss"])
    assert len(nodes) > 100  # the whole step, with the norms' nested functions
    assert_tpu_ready(nodes, hlo)


def test_the_check_sees_a_float64_op_inside_the_step():
    # The check can fail: a step that widens the clipped sum to float64 is caught.
    class Widening(DPModel):
        def add_noise(self, summed):
            return [tf.cast(tf.cast(s, tf.float64) * 1.0, tf.float32)
                    for s in super().add_noise(summed)]

    # Any model shows it: a one-conv model compiles in about 1 s, the Tramer CNN in 12 s.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(2, 3),
                              keras.layers.Flatten(), keras.layers.Dense(10)])
    _, nodes, hlo, _ = compiled_dp_step(model, (6, 6, 1), cls=Widening, run=False)
    assert graph_checks.nodes_of_dtype(nodes, tf.float64)
    with pytest.raises(AssertionError, match="float64 in the DP step"):
        assert_tpu_ready(nodes, hlo)


# The WRN's XLA compile with views took 19-23 s (2 cores): it runs under -m slow, and so does
# the CNN's (24 s in the suite). The default suite traces the WRN's step with views without
# compiling it (below): every node of its graph is checked as here.
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAST))
def test_augmult_views_compile_without_float64(family):
    keras.utils.set_random_seed(0)
    builder, shape, scale = FAST[family]
    dp, nodes, hlo, logs = compiled_dp_step(builder(), shape, scale=scale, num_views=2)
    assert dp.clipping_path == "ghost"
    assert np.isfinite(logs["loss"])
    assert_tpu_ready(nodes, hlo)


def test_the_wrn_step_with_views_has_no_float64_node_and_no_host_callback():
    # The GN + WS WRN's ghost rules (weight standardization, group norm) in the DP step on
    # augmult views, traced as XLA would get it but not compiled: the graph checks of
    # `assert_tpu_ready`, less the HLO's (the CNN's compiled step above checks those).
    builder, shape, scale = FAST["wrn_gn_ws"]
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, scale, (4, 2, *shape)).astype(np.float32)
    y = rng.integers(0, 10, 4).astype(np.int32)
    dp = DPModel(builder(), _mechanism(4), clipping="auto", noise_seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
    step = tf.function(dp.train_step, jit_compile=True, autograph=False)
    nodes = graph_checks.graph_nodes(step.get_concrete_function((tf.constant(x), tf.constant(y))))
    assert dp.clipping_path == "ghost"
    assert len(nodes) > 1000  # the whole step, with the norms' nested functions
    assert not graph_checks.nodes_of_dtype(nodes, tf.float64)
    assert not graph_checks.host_callbacks(nodes)


def _scatternet_classifier():
    pytest.importorskip("kymatio")
    head = models.build_scatternet_cnn((7, 7, 81), 10, groups=27)
    return models.build_scatternet_classifier(head, (28, 28, 1))


SLOW = {
    "wrn16_4": (lambda: models.build_wide_resnet(16, 4, 10), (32, 32, 3), 255.0, 2),
    "nf_resnet_small": (lambda: models.build_nf_resnet(50, 10, input_shape=(32, 32, 3),
                                                       width=1), (32, 32, 3), 1.0, 2),
    "nf_resnet_blocks": (*ghost_testing.FAMILIES["nf_resnet_blocks"], 4),
    "scatternet_linear": (*ghost_testing.FAMILIES["scatternet_linear"], 4),
    "scatternet_cnn": (*ghost_testing.FAMILIES["scatternet_cnn"], 4),
    "scatternet_cnn_classifier": (_scatternet_classifier, (28, 28, 1), 255.0, 4),
    "tramer_cifar_cnn": (*ghost_testing.FAMILIES["tramer_cifar_cnn"], 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SLOW))
def test_every_family_compiles_without_float64(family):
    builder, shape, scale, batch = SLOW[family]
    keras.utils.set_random_seed(0)
    dp, nodes, hlo, logs = compiled_dp_step(builder(), shape, scale=scale, batch=batch)
    print(f"{family}: clipping path {dp.clipping_path}, {len(nodes)} nodes, loss {logs['loss']}")
    assert np.isfinite(logs["loss"])
    assert_tpu_ready(nodes, hlo)


@pytest.fixture(scope="module")
def efficientnet(tmp_path_factory):
    """keras.applications.EfficientNetB0 (random weights, 32x32x3) saved as a .keras file."""
    keras.utils.set_random_seed(0)
    backbone = keras.applications.EfficientNetB0(weights=None, classes=10,
                                                 input_shape=(32, 32, 3))
    path = str(tmp_path_factory.mktemp("efficientnet") / "efficientnet.keras")
    backbone.save(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("trainable", ["head", "all"])
def test_a_fine_tuned_keras_application_compiles_without_float64(efficientnet, trainable):
    keras.utils.set_random_seed(0)
    model = models.build_finetune_model(10, (32, 32, 3), backbone=efficientnet,
                                        trainable=trainable)
    dp, nodes, hlo, logs = compiled_dp_step(model, (32, 32, 3), batch=2)
    print(f"EfficientNetB0 {trainable}: clipping path {dp.clipping_path}, {len(nodes)} nodes, "
          f"loss {logs['loss']}")
    assert dp.clipping_path == "ghost"
    assert np.isfinite(logs["loss"])
    assert_tpu_ready(nodes, hlo)
