"""Ghost clipping equals the vectorized per-example path on every model family."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import accounting
from tfdp import models
from tfdp.dp import clipping
from tfdp.training import ghost_clipping
from tfdp.training.dp_model import DPModel

from tests.training import ghost_testing

RTOL = 1e-5
# The contract (it replaces "equal to the other path at 1e-5" for the norms): the
# ghost norm never comes out below the float32 reference (by more than the two paths'
# own float32 rounding, RTOL) and above it by at most OVERCOUNT on ordinary inputs.
OVERCOUNT = 1e-4
LOSS = ghost_testing.LOSS
FAMILIES = ghost_testing.FAMILIES
LOOP_FAMILIES = ghost_testing.LOOP_FAMILIES
_example_loss_fn = ghost_testing.example_loss_fn
_nf_blocks = ghost_testing.nf_blocks
_vit_block = ghost_testing.vit_block


def _inputs(shape, scale, batch=4, num_views=None, seed=0):
    rng = np.random.default_rng(seed)
    views = () if num_views is None else (num_views,)
    images = rng.uniform(0, scale, (batch, *views, *shape)).astype(np.float32)
    return tf.constant(images), tf.constant(rng.integers(0, 10, batch), tf.int32)


def _ghost_and_vectorized(model, images, labels, mask, l2_clip_norm=0.5):
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    example_loss = _example_loss_fn(model)
    fast = ghost.clipped_sum(images, labels, mask, l2_clip_norm=l2_clip_norm, normalize=False,
                             loss_fn=LOSS, example_loss_fn=example_loss)
    grads, (losses, logits) = clipping.per_example_gradients(
        example_loss, model.trainable_variables, (images, labels))
    _, norms, clipped = clipping.clipped_sum(grads, l2_clip_norm, mask=mask)
    summed = _sum_with_factors(fast[1], grads, l2_clip_norm, mask)
    return ghost, fast, (summed, norms, clipped, losses, logits)


def _assert_norms_bound(fast, slow):
    """The ghost norms: never below `slow` (to RTOL), above it by at most OVERCOUNT."""
    fast, slow = np.asarray(fast, np.float64), np.asarray(slow, np.float64)
    assert np.all(fast >= slow * (1 - RTOL)), (fast, slow)
    assert np.all(fast <= slow * (1 + OVERCOUNT)), (fast, slow)


def _sum_with_factors(norms, grads, l2_clip_norm, mask):
    """The clipped sum of per-example `grads` with the clip factors of `norms` (the ghost
    path's): equal to the ghost sum whatever the norms over-count."""
    factors = clipping.clip_factors(tf.convert_to_tensor(norms), l2_clip_norm) * mask
    return [clipping.weighted_sum(factors, g) for g in grads]


def _assert_same_sum(fast, slow):
    """Equal to RTOL relative to the whole clipped sum (a variable's own sum can cancel)."""
    fast = np.concatenate([t.numpy().ravel() for t in fast])
    slow = np.concatenate([t.numpy().ravel() for t in slow])
    assert np.linalg.norm(fast - slow) <= RTOL * np.linalg.norm(slow)
    np.testing.assert_allclose(fast, slow, rtol=RTOL, atol=RTOL * np.max(np.abs(slow)))


# Under -m slow: the ReLU + GroupNorm WRN, the NF-ResNet blocks without views and the
# GN + WS WRN with views; every other case runs in the default suite.
SLOW_FAMILY_CASES = {("nf_resnet_blocks", None), ("wrn_gn_ws", 2), ("wrn_relu_gn", None),
                     ("wrn_relu_gn", 2)}


@pytest.mark.parametrize("family, num_views", [
    pytest.param(family, num_views,
                 marks=[pytest.mark.slow] if (family, num_views) in SLOW_FAMILY_CASES else [])
    for family in sorted(FAMILIES) for num_views in (None, 2)])
def test_norms_and_clipped_sum_equal_the_vectorized_path(family, num_views):
    builder, shape, scale = FAMILIES[family]
    keras.utils.set_random_seed(0)
    model = builder()
    images, labels = _inputs(shape, scale, num_views=num_views)
    mask = tf.constant([1.0, 1.0, 0.0, 1.0])  # row 2 is padding
    ghost, fast, slow = _ghost_and_vectorized(model, images, labels, mask)
    assert not ghost.fallback_variables  # every layer has a rule
    summed, norms, clipped, losses, logits = fast
    _assert_norms_bound(norms.numpy(), slow[1].numpy())
    np.testing.assert_allclose(losses.numpy(), slow[3].numpy(), rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(logits.numpy(), slow[4].numpy(), rtol=RTOL, atol=1e-5)
    np.testing.assert_array_equal(clipped.numpy(), slow[2].numpy())
    assert clipped.numpy()[2] == 0
    _assert_same_sum(summed, slow[0])


def _per_example_loop(model, images, labels):
    """Per-example gradients `[batch, ...]` and losses and logits, one example at a time."""
    example_loss = _example_loss_fn(model)
    grads, losses, logits = [], [], []
    for i in range(images.shape[0]):
        with tf.GradientTape() as tape:
            loss, (_, mean_logits) = example_loss((images[i], labels[i]))
        grads.append([tf.convert_to_tensor(g) for g in
                      tape.gradient(loss, model.trainable_variables)])
        losses.append(loss)
        logits.append(mean_logits)
    return [tf.stack(g) for g in zip(*grads)], tf.stack(losses), tf.stack(logits)


@pytest.mark.parametrize("num_views", [None, 2])
@pytest.mark.parametrize("family", [  # the ConvNeXt block under -m slow
    pytest.param(family, marks=[pytest.mark.slow] if family == "convnext_block" else [])
    for family in sorted(LOOP_FAMILIES)])
def test_attention_and_embeddings_equal_the_per_example_loop(family, num_views):
    builder, shape, scale = LOOP_FAMILIES[family]
    keras.utils.set_random_seed(0)
    model = builder()
    images, labels = _inputs(shape, scale, num_views=num_views)
    mask = tf.constant([1.0, 1.0, 0.0, 1.0])
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    assert not ghost.fallback_variables  # every layer has a rule
    summed, norms, clipped, losses, logits = ghost.clipped_sum(
        images, labels, mask, l2_clip_norm=0.5, normalize=False, loss_fn=LOSS,
        example_loss_fn=None)
    grads, slow_losses, slow_logits = _per_example_loop(model, images, labels)
    _, slow_norms, slow_clipped = clipping.clipped_sum(grads, 0.5, mask=mask)
    slow_summed = _sum_with_factors(norms, grads, 0.5, mask)
    _assert_norms_bound(norms.numpy(), slow_norms.numpy())
    np.testing.assert_allclose(losses.numpy(), slow_losses.numpy(), rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(logits.numpy(), slow_logits.numpy(), rtol=RTOL, atol=1e-5)
    np.testing.assert_array_equal(clipped.numpy(), slow_clipped.numpy())
    _assert_same_sum(summed, slow_summed)


def test_multi_head_attention_rule_replays_the_layer():
    keras.utils.set_random_seed(0)
    model = _vit_block()
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    images, _ = _inputs((6, 5), 1.0)
    np.testing.assert_allclose(ghost.tapped_model(images)[0].numpy(), model(images).numpy(),
                               rtol=1e-5, atol=1e-6)
    attention = model.get_layer("attention")
    for dense in (attention.query_dense, attention.key_dense, attention.value_dense,
                  attention.output_dense):  # kernel and bias sites of each projection
        assert sum(site.layer_name == dense.name for site in ghost.sites) == 2


def _causal_attention(num_classes=10):
    inputs = keras.Input((5, 4))
    x = keras.layers.MultiHeadAttention(2, 3, name="attention")(inputs, inputs,
                                                                 use_causal_mask=True)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(x)))


def test_causal_attention_has_a_rule_that_replays_the_layer_and_equals_the_loop():
    # MultiHeadAttention(use_causal_mask=True) has a rule: the vectorized path's per-example
    # ops would meet oneDNN's broadcast-matmul bug (1.72 C).
    keras.utils.set_random_seed(0)
    model = _causal_attention()
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    assert not ghost.fallback_variables
    images, labels = _inputs((5, 4), 3.0)
    np.testing.assert_allclose(ghost.tapped_model(images)[0].numpy(), model(images).numpy(),
                               rtol=1e-5, atol=1e-6)
    # Causal: the first position's output does not depend on the later positions.
    changed = images.numpy().copy()
    changed[:, 1:] += 1.0
    first = lambda x: model.get_layer("attention")(x, x, use_causal_mask=True)[:, 0]  # noqa
    np.testing.assert_allclose(first(images).numpy(), first(changed).numpy(), atol=1e-6)
    mask = tf.constant([1.0, 1.0, 0.0, 1.0])
    summed, norms, _, _, _ = ghost.clipped_sum(images, labels, mask, l2_clip_norm=0.5,
                                               normalize=False, loss_fn=LOSS,
                                               example_loss_fn=None)
    grads, _, _ = _per_example_loop(model, images, labels)
    slow_summed, slow_norms, _ = clipping.clipped_sum(grads, 0.5, mask=mask)
    np.testing.assert_allclose(norms.numpy(), slow_norms.numpy(), rtol=RTOL)
    _assert_same_sum(summed, slow_summed)


@pytest.mark.parametrize("layer, call", [
    (lambda: keras.layers.MultiHeadAttention(2, 4, dropout=0.1), lambda l, x: l(x, x)),
    (lambda: keras.layers.MultiHeadAttention(2, 4), lambda l, x: l(
        x, x, return_attention_scores=False)),  # a call argument the rule does not take
    (lambda: keras.layers.Embedding(7, 4, mask_zero=True), lambda l, x: l(x[:, :, 0])),
    (lambda: keras.layers.EinsumDense("abc,dc->abd", (5, 3)), lambda l, x: l(x)),
])
def test_layers_outside_the_new_rules_fall_back(layer, call):
    inputs = keras.Input((5, 4))
    instance = layer()
    x = call(instance, inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(x)))
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    assert ghost.fallback_variables
    assert instance.name in [name for name, _ in ghost.uncovered_layers]


def test_a_masked_input_keeps_attention_unchanged_and_on_the_fallback():
    # Masking upstream: MultiHeadAttention reads the mask inside its call, which the
    # replay would drop (the tapped model would compute another function).
    inputs = keras.Input((5, 4))
    x = keras.layers.Masking(0.0)(inputs)
    x = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(x)))
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    assert ("attention", "called with a mask, keyword arguments or several inputs") in \
        ghost.uncovered_layers
    images = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    images[:, 3:] = 0.0  # masked positions
    np.testing.assert_allclose(ghost.tapped_model(images)[0].numpy(), model(images).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_the_other_examples():
    # A masked row of huge garbage: the real rows' norms and the clipped sum are those of
    # the real rows alone.
    keras.utils.set_random_seed(0)
    model = models.build_tramer_cnn(10)
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    images, labels = _inputs((28, 28, 1), 255.0, batch=3)
    garbage = tf.concat([images, 1e4 * tf.ones([1, 28, 28, 1])], 0)
    run = lambda x, y, m: ghost.clipped_sum(x, y, m, l2_clip_norm=0.1, normalize=True,
                                            loss_fn=LOSS, example_loss_fn=None)
    alone = run(images, labels, tf.ones([3]))
    padded = run(garbage, tf.concat([labels, [7]], 0), tf.constant([1.0, 1.0, 1.0, 0.0]))
    np.testing.assert_allclose(padded[1].numpy()[:3], alone[1].numpy(), rtol=RTOL)
    _assert_same_sum(padded[0], alone[0])


def test_nf_res_block_rule_replays_the_block():
    keras.utils.set_random_seed(0)
    model = _nf_blocks()
    ghost = ghost_clipping.GhostClipping(model, model.trainable_variables)
    images, _ = _inputs((8, 8, 3), 1.0)
    np.testing.assert_allclose(ghost.tapped_model(images)[0].numpy(), model(images).numpy(),
                               rtol=1e-5, atol=1e-6)
    # One site per variable: every kernel, gain and bias, and each block's skip gain.
    assert len(ghost.sites) == len(model.trainable_variables)
    assert not ghost.fallback_variables


class _Scale(keras.layers.Layer):
    """A layer without a ghost-norm rule."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale


def _model_with_unruled_layer():
    inputs = keras.Input((6, 6, 1))
    x = keras.layers.Conv2D(3, 3, activation="tanh")(inputs)
    x = _Scale(name="unruled")(keras.layers.Flatten()(x))
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def _model_with_shared_layer():
    inputs = keras.Input((5,))
    shared = keras.layers.Dense(5, activation="tanh", name="shared")
    return keras.Model(inputs, keras.layers.Dense(10)(shared(shared(inputs))))


class _CallsDense(keras.layers.Layer):
    """A layer without a rule that calls a Dense layer which is also called outside it."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return x + self.dense(x)


def _model_with_dense_inside_a_custom_layer():
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(5, activation="tanh", name="twice")
    x = _CallsDense(dense, name="custom")(dense(inputs))
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def _model_with_lambda_weight_tying():
    # The Lambda reads the encoder's kernel (a tied decoder): a second use of it.
    inputs = keras.Input((5,))
    encoder = keras.layers.Dense(4, activation="tanh", name="encoder")
    decoder = keras.layers.Lambda(lambda h: keras.ops.matmul(h, keras.ops.transpose(
        encoder.kernel)), name="tied_decoder")
    return keras.Model(inputs, keras.layers.Dense(10)(decoder(encoder(inputs))))


def _model_with_an_op_on_a_kernel():
    # The same tying with a Keras op in the functional graph instead of a Lambda.
    inputs = keras.Input((5,))
    encoder = keras.layers.Dense(5, activation="tanh", name="encoder")
    tied = keras.ops.matmul(encoder(inputs), encoder.kernel)
    return keras.Model(inputs, keras.layers.Dense(10)(tied))


def _model_sharing_a_layer_with_a_nested_model():
    shared = keras.layers.Dense(5, activation="tanh", name="shared")
    inner_inputs = keras.Input((5,))
    inner = keras.Model(inner_inputs, keras.layers.Dense(5, name="inner_dense")(
        shared(inner_inputs)), name="inner")
    inputs = keras.Input((5,))
    return keras.Model(inputs, keras.layers.Dense(10)(inner(shared(inputs))))


@pytest.mark.parametrize("builder, shape, fallback", [
    (_model_with_unruled_layer, (6, 6, 1), ["unruled/scale"]),
    (_model_with_shared_layer, (5,), ["shared/kernel", "shared/bias"]),
    # A gradient that also flows through a use no rule taps.
    (_model_with_dense_inside_a_custom_layer, (5,), ["twice/kernel", "twice/bias"]),
    (_model_with_lambda_weight_tying, (5,), ["encoder/kernel"]),
    (_model_with_an_op_on_a_kernel, (5,), ["encoder/kernel"]),
    (_model_sharing_a_layer_with_a_nested_model, (5,), ["shared/kernel", "shared/bias"]),
])
def test_layers_without_a_usable_rule_keep_the_vectorized_path(builder, shape, fallback):
    keras.utils.set_random_seed(0)
    model = builder()
    images, labels = _inputs(shape, 1.0)
    ghost, fast, slow = _ghost_and_vectorized(model, images, labels, tf.ones([4]))
    assert [v.path for v in ghost.fallback_variables] == fallback
    _assert_norms_bound(fast[1].numpy(), slow[1].numpy())
    _assert_same_sum(fast[0], slow[0])


def _dense_then(norm, **kwargs):
    def build():
        inputs = keras.Input((4, 6))
        x = norm(**kwargs)(keras.layers.Dense(8, activation="tanh")(inputs))
        return keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(x)))
    return build


def _nested_models(scale_inputs=False):
    # A functional and a Sequential model inside a functional one.
    inner_inputs = keras.Input((6,))
    inner = keras.Model(inner_inputs, keras.layers.Dense(5, activation="tanh")(inner_inputs),
                        name="inner")
    sequential = keras.Sequential([keras.Input((5,)), keras.layers.Dense(5, activation="tanh"),
                                   keras.layers.LayerNormalization()], name="sequential")
    inputs = keras.Input((6,))
    x = sequential(inner(inputs / 2.0 if scale_inputs else inputs))  # a Keras op node
    return keras.Model(inputs, keras.layers.Dense(10)(x))


@pytest.mark.parametrize("builder, shape", [
    # Normalizations with one of their two variables.
    (_dense_then(keras.layers.LayerNormalization, scale=False), (4, 6)),
    (_dense_then(keras.layers.LayerNormalization, center=False), (4, 6)),
    (_dense_then(keras.layers.GroupNormalization, groups=2, center=False), (4, 6)),
    (_dense_then(keras.layers.GroupNormalization, groups=2, scale=False), (4, 6)),
    # Nested models are inlined, so their layers get rules.
    (_nested_models, (6,)),
    # A Keras op in the functional graph (`inputs / 2`) is called unchanged.
    (lambda: _nested_models(scale_inputs=True), (6,)),
], ids=["ln_no_scale", "ln_no_center", "gn_no_center", "gn_no_scale", "nested", "op_node"])
def test_rule_covered_variants_equal_the_vectorized_path(builder, shape):
    keras.utils.set_random_seed(0)
    model = builder()
    images, labels = _inputs(shape, 1.0)
    ghost, fast, slow = _ghost_and_vectorized(model, images, labels, tf.constant([1., 0, 1, 1]))
    assert not ghost.fallback_variables
    _assert_norms_bound(fast[1].numpy(), slow[1].numpy())
    np.testing.assert_allclose(fast[4].numpy(), slow[4].numpy(), rtol=RTOL, atol=1e-5)
    _assert_same_sum(fast[0], slow[0])


def _model_without_a_rule():
    inputs = keras.Input((6, 6, 1))
    return keras.Model(inputs, _Scale(name="unruled")(keras.layers.Flatten()(inputs)))


def test_ghost_on_a_model_without_any_rule_equals_the_vectorized_path():
    # The tapped model's only output is the logits.
    keras.utils.set_random_seed(0)
    images, labels = _inputs((6, 6, 1), 1.0)
    ghost, fast, slow = _ghost_and_vectorized(_model_without_a_rule(), images, labels,
                                              tf.ones([4]))
    assert not ghost.sites
    _assert_norms_bound(fast[1].numpy(), slow[1].numpy())
    np.testing.assert_allclose(fast[3].numpy(), slow[3].numpy(), rtol=RTOL)
    np.testing.assert_allclose(fast[4].numpy(), slow[4].numpy(), rtol=RTOL)
    _assert_same_sum(fast[0], slow[0])


# -- DPModel ---------------------------------------------------------------------


class _Noiseless(DPModel):
    def add_noise(self, summed):
        return summed


def _mechanism(batch_size=4, **kwargs):
    return accounting.DPMechanism(num_examples=1000, batch_size=batch_size, num_steps=10,
                                  noise_multiplier=1.0, l2_clip_norm=0.5, delta=1e-5, **kwargs)


def _update(builder, clipping_path, data, *, cls=_Noiseless, jit_compile=False, **kwargs):
    keras.utils.set_random_seed(0)
    model = builder()
    dp = cls(model, _mechanism(), clipping=clipping_path, **kwargs)
    dp.compile(optimizer=keras.optimizers.SGD(1.0), jit_compile=jit_compile)
    before = [v.numpy() for v in model.trainable_variables]
    dp.train_on_batch(*data)
    return dp, [v.numpy() - w for v, w in zip(model.trainable_variables, before)]


def _assert_same_update(a, b):
    a = np.concatenate([x.ravel() for x in a])
    b = np.concatenate([y.ravel() for y in b])
    assert np.linalg.norm(a - b) <= RTOL * np.linalg.norm(b)


@pytest.mark.slow
def test_auto_takes_the_ghost_path_and_gives_the_vectorized_update():
    data = _inputs((28, 28, 1), 255.0, batch=5, num_views=2)
    dp, ghost = _update(lambda: models.build_tramer_cnn(10), "auto", data,
                        accumulation_steps=2)  # chunks in a tf.while_loop
    assert dp.clipping_path == "ghost"
    _, vectorized = _update(lambda: models.build_tramer_cnn(10), "vectorized", data)
    _assert_same_update(ghost, vectorized)


@pytest.mark.parametrize("builder, shape, named", [
    (_model_with_unruled_layer, (6, 6, 1), "unruled"),
    (_model_with_dense_inside_a_custom_layer, (5,), "twice"),
    (_model_with_lambda_weight_tying, (5,), "encoder"),
    (_model_sharing_a_layer_with_a_nested_model, (5,), "shared"),
])
def test_auto_takes_the_vectorized_path_when_a_layer_has_no_rule(builder, shape, named, caplog):
    with caplog.at_level(logging.WARNING):
        dp, _ = _update(builder, "auto", _inputs(shape, 1.0))
    assert dp.clipping_path == "vectorized"
    assert named in caplog.text


@pytest.mark.slow
def test_ghost_logs_the_fallback_layers_once(caplog):
    with caplog.at_level(logging.WARNING):
        dp, _ = _update(_model_with_unruled_layer, "ghost", _inputs((6, 6, 1), 1.0))
        dp.train_on_batch(*_inputs((6, 6, 1), 1.0, seed=1))
    assert dp.clipping_path == "ghost"
    assert caplog.text.count("keep tf.vectorized_map") == 1
    assert "unruled (no rule for _Scale)" in caplog.text


def test_microbatches_and_subclassed_models_use_the_vectorized_path():
    keras.utils.set_random_seed(0)
    dp = DPModel(models.build_tramer_cnn(10), _mechanism(num_microbatches=2), clipping="ghost")
    dp.compile(optimizer="sgd")
    assert dp.clipping_path == "vectorized"

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(tf.zeros([1, 3]))
    dp = DPModel(model, _mechanism(), clipping="auto")
    dp.compile(optimizer="sgd")
    assert dp.clipping_path == "vectorized"


@pytest.mark.parametrize("model_policy, wrapper_policy", [
    ("mixed_float16", "float32"),  # the model computes in float16
    ("float32", "mixed_float16"),  # compile would wrap the optimizer in loss scaling
    ("mixed_bfloat16", "float32"),
])
def test_mixed_precision_is_refused_with_a_message(model_policy, wrapper_policy):
    # It would crash the ghost path (float16 logits against float32
    # norms) and divide the vectorized update by Keras' loss scale.
    previous = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(model_policy)
        model = models.build_tramer_cnn(10)
        keras.config.set_dtype_policy(wrapper_policy)
        with pytest.raises(ValueError, match=r"mixed precision.*set_dtype_policy\('float32'\)"):
            DPModel(model, _mechanism())
    finally:
        keras.config.set_dtype_policy(previous)


def test_clipping_is_validated_and_in_the_config():
    with pytest.raises(ValueError, match="clipping must be one of"):
        DPModel(models.build_tramer_cnn(10), _mechanism(), clipping="fast")
    dp = DPModel(models.build_tramer_cnn(10), _mechanism(), clipping="ghost")
    assert dp.get_config()["clipping"] == "ghost"


def _small_cnn():
    """The Tramer & Boneh CNN's layer kinds (strided convolutions, max pooling, tanh, dense)
    on 12x12 images with a few channels: its XLA-against-graph check took 8.9 s alone on the
    2-core host, the Tramer CNN's 12.1 s."""
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(6, 3, strides=2, padding="valid", activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(10)])


@pytest.mark.parametrize("clipping_path",
                         ["ghost", pytest.param("vectorized", marks=pytest.mark.slow)])
def test_xla_step_of_the_cnn_equals_the_graph_step(clipping_path):
    data = _inputs((12, 12, 1), 255.0, batch=4)
    _, compiled = _update(_small_cnn, clipping_path, data, jit_compile=True)
    _, graph = _update(_small_cnn, clipping_path, data)
    assert any(np.any(u != 0) for u in graph)
    _assert_same_update(compiled, graph)


# Slow-only: the default suite compiles a GN + WS WRN's DP step with XLA in
# tests/training/dp_step_xla_test.py, and this one took 13 s more.
@pytest.mark.slow
@pytest.mark.parametrize("clipping_path", ["ghost", "vectorized"])
def test_xla_compiles_the_wrn16_4_step_at_a_tiny_batch(clipping_path):
    data = _inputs((32, 32, 3), 255.0, batch=2)
    dp, update = _update(lambda: models.build_wide_resnet(16, 4, 10), clipping_path, data,
                         cls=DPModel, jit_compile=True, noise_seed=0)
    assert dp.clipping_path == clipping_path
    assert all(np.all(np.isfinite(u)) for u in update)
    assert any(np.any(u != 0) for u in update)


@pytest.mark.parametrize("clipping_path, fallback", [
    pytest.param("auto", False, marks=pytest.mark.slow), ("vectorized", True)])
def test_no_sequential_conv_gradients_on_the_ghost_path(clipping_path, fallback,
                                                      tensorflow_warnings):
    # Every shipped config of the default suite is checked the same way in configs_test.py.
    _update(lambda: models.build_tramer_cnn(10), clipping_path,
            _inputs((28, 28, 1), 255.0, batch=3))
    assert any("Conv2DBackpropFilter uses a while_loop" in m
               for m in tensorflow_warnings) == fallback


# -- Gin switches --------------------------------------------------------------


@pytest.mark.slow
def test_gin_switches_compile_the_step_with_static_poisson_batches(run_smoke, tmp_path):
    report = run_smoke(tmp_path, ["fashion_mnist.gin"], [
        "tfdp.RuntimeConfig.jit_compile = True",
        "tfdp.RuntimeConfig.static_batch_size = 'auto'",
        "tfdp.PrivacyConfig.clipping = 'ghost'",
    ])
    assert report["steps"] == 2


def test_an_unknown_clipping_path_is_refused_before_the_workdir_is_touched(run_smoke, tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match="clipping must be one of"):
        run_smoke(workdir, ["fashion_mnist.gin"], ["tfdp.PrivacyConfig.clipping = 'fast'"])
    assert not workdir.exists()


# -- Frozen BatchNorm -----------------------------------------


def _model_with_frozen_batch_norm(num_classes=10):
    """Conv -> frozen BatchNorm (pretrained-looking moving statistics) -> Dense."""
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    bn = keras.layers.BatchNormalization(name="frozen_bn")
    x = keras.layers.ReLU()(bn(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(num_classes)(x))
    rng = np.random.default_rng(3)
    for variable in (bn.gamma, bn.beta, bn.moving_mean):
        variable.assign(rng.normal(size=4).astype(np.float32))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 4).astype(np.float32))
    bn.trainable = False
    return model


def _brute_force_norms(model, images, labels):
    """Per-example gradient norms, one example at a time."""
    norms = []
    for i in range(images.shape[0]):
        with tf.GradientTape() as tape:
            loss = LOSS(labels[i:i + 1], model(images[i:i + 1], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        norms.append(np.sqrt(sum(np.sum(g.numpy() ** 2) for g in grads)))
    return np.array(norms)


def test_frozen_batch_norm_is_a_layer_without_trainable_variables_on_the_ghost_path():
    keras.utils.set_random_seed(0)
    model = _model_with_frozen_batch_norm()
    images, labels = _inputs((6, 6, 2), 1.0)
    ghost, fast, slow = _ghost_and_vectorized(model, images, labels, tf.ones([4]))
    assert not ghost.fallback_variables
    expected = _brute_force_norms(model, images, labels)
    _assert_norms_bound(fast[1].numpy(), expected)
    np.testing.assert_allclose(slow[1].numpy(), expected, rtol=RTOL)
    _assert_same_sum(fast[0], slow[0])


def test_a_frozen_batch_norm_trains_under_dp_model_and_keeps_its_statistics():
    data = _inputs((6, 6, 2), 1.0, batch=4)
    updates = {}
    for clipping_path in ("ghost", "vectorized"):
        dp, updates[clipping_path] = _update(_model_with_frozen_batch_norm, clipping_path, data)
        assert dp.clipping_path == clipping_path
        bn = dp.model.get_layer("frozen_bn")
        keras.utils.set_random_seed(0)
        fresh = _model_with_frozen_batch_norm().get_layer("frozen_bn")
        for name in ("moving_mean", "moving_variance", "gamma", "beta"):
            np.testing.assert_array_equal(getattr(bn, name).numpy(),
                                          getattr(fresh, name).numpy())
        assert any(np.any(u != 0) for u in updates[clipping_path])
    _assert_same_update(updates["ghost"], updates["vectorized"])


def test_a_trainable_batch_norm_is_refused_by_dp_model():
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.BatchNormalization(name="bn")(keras.layers.Conv2D(4, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Flatten()(x)))
    with pytest.raises(ValueError, match=r"bn \(BatchNormalization\).*layer\.trainable = False"):
        DPModel(model, _mechanism())


@pytest.mark.slow
def test_a_vit_block_trains_under_dp_model_on_the_ghost_path(caplog):
    # clipping='auto' takes the ghost path: every layer, attention included, has a rule
    # (no per-example loop warning).
    with caplog.at_level(logging.WARNING):
        dp, update = _update(_vit_block, "auto", _inputs((6, 5), 1.0, batch=4))
    assert dp.clipping_path == "ghost"
    assert "keep tf.vectorized_map" not in caplog.text
    assert all(np.all(np.isfinite(u)) for u in update) and any(np.any(u != 0) for u in update)


@pytest.mark.slow
def test_xla_step_of_the_vit_block_equals_the_graph_step():
    # Static shapes in the attention and embedding rules: XLA compiles the ghost step.
    data = _inputs((6, 5), 1.0, batch=4)
    _, compiled = _update(_vit_block, "ghost", data, jit_compile=True)
    _, graph = _update(_vit_block, "ghost", data)
    _assert_same_update(compiled, graph)
