"""Tests for validate_dp_model (De et al. 2022, App. C.1; How to DP-fy ML, Sec. 5.5.1)."""

import keras
import numpy as np
import pytest
from keras import ops

from tfdp.models.tramer_cifar_cnn import build_tramer_cifar_cnn
from tfdp.models.validation import iter_layers, validate_dp_model


def _conv_model(norm_layer, name="model"):
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, name="conv")(inputs)
    x = norm_layer(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x), name=name)


class _BlockWithBatchNorm(keras.layers.Layer):
    """A subclassed layer hiding a BatchNorm in an attribute list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = [keras.layers.Dense(4), keras.layers.BatchNormalization(name="hidden_bn")]

    def call(self, x):
        for part in self.parts:
            x = part(x)
        return x


class _BatchMean(keras.layers.Layer):
    """Subtracts the batch mean: mixes examples without being a BatchNorm."""

    def call(self, x):
        return x - ops.mean(x, axis=0, keepdims=True)


def test_rejects_batch_norm_with_a_clear_message():
    model = _conv_model(keras.layers.BatchNormalization(name="bn"))
    with pytest.raises(ValueError) as error:
        validate_dp_model(model)
    message = str(error.value)
    assert "model/bn (BatchNormalization)" in message
    assert "keras.layers.GroupNormalization" in message
    assert "De et al. 2022" in message and "Sec. 5.5.1" in message


def test_a_trainable_batch_norm_is_refused_with_how_to_freeze_it():
    model = _conv_model(keras.layers.BatchNormalization(name="bn"))
    with pytest.raises(ValueError, match=r"model/bn.*layer\.trainable = False"):
        validate_dp_model(model)


@pytest.mark.parametrize("synchronized", [False, True])
def test_accepts_a_frozen_batch_norm(synchronized):
    # Keras 3 runs a BatchNormalization with trainable=False in inference mode even
    # with training=True: it normalizes with its moving statistics, per example.
    bn = keras.layers.BatchNormalization(synchronized=synchronized, name="bn")
    model = _conv_model(bn)
    bn.trainable = False
    images = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(model, check_inputs=images)  # does not raise


def test_a_frozen_batch_norm_subclass_is_still_refused():
    class MyBatchNorm(keras.layers.BatchNormalization):  # may override call
        pass

    bn = MyBatchNorm(name="my_bn")
    model = _conv_model(bn)
    bn.trainable = False
    with pytest.raises(ValueError, match="model/my_bn"):
        validate_dp_model(model)


def test_rejects_synchronized_batch_norm():
    model = _conv_model(keras.layers.BatchNormalization(synchronized=True, name="sync_bn"))
    with pytest.raises(ValueError, match="model/sync_bn"):
        validate_dp_model(model)


def test_rejects_batch_norm_nested_in_models_and_layers():
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="inner_bn"),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    outputs = _BlockWithBatchNorm(name="block")(inner(inputs))
    model = keras.Model(inputs, outputs, name="outer")
    with pytest.raises(ValueError) as error:
        validate_dp_model(model)
    # Both offenders are named, with their nesting path.
    assert "outer/inner/inner_bn (BatchNormalization)" in str(error.value)
    assert "outer/block/hidden_bn (BatchNormalization)" in str(error.value)


@pytest.mark.parametrize(
    "norm_layer",
    [
        keras.layers.GroupNormalization(groups=4),
        keras.layers.LayerNormalization(),
        keras.layers.UnitNormalization(),
    ],
)
def test_accepts_per_example_normalization(norm_layer):
    model = _conv_model(norm_layer)
    images = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(model, check_inputs=images)  # does not raise


def test_functional_check_catches_custom_batch_mixing_and_dropout():
    images = np.random.default_rng(1).normal(size=(3, 8, 8, 3)).astype(np.float32)
    validate_dp_model(_conv_model(_BatchMean()))  # invisible to the structural check
    with pytest.raises(ValueError, match="example 0 differs between a call on the whole batch"):
        validate_dp_model(_conv_model(_BatchMean()), check_inputs=images)
    with pytest.raises(ValueError, match="random in training mode"):
        validate_dp_model(_conv_model(keras.layers.Dropout(0.5)), check_inputs=images)


def test_functional_check_needs_two_examples():
    model = _conv_model(keras.layers.LayerNormalization())
    with pytest.raises(ValueError, match="at least 2"):
        validate_dp_model(model, check_inputs=np.zeros((1, 8, 8, 3), np.float32))


def test_iter_layers_visits_every_layer_once_with_paths():
    model = build_tramer_cifar_cnn(10, size="small")
    paths = [path for path, _ in iter_layers(model)]
    assert paths[0] == model.name
    assert len(paths) == len(set(paths)) == 1 + len(model.layers)
    assert f"{model.name}/logits" in paths


# -- refuse_example_mixing: behaviour on a probe batch, not class names ----------

from tfdp import accounting  # noqa: E402
from tfdp import OptimizationConfig, PrivacyConfig, PrivateTrainingConfig  # noqa: E402
from tfdp import make_private  # noqa: E402
from tfdp.models.validation import ExampleMixingError, refuse_example_mixing  # noqa: E402
from tfdp.training.dp_model import DPModel  # noqa: E402


class _TFRandom(keras.layers.Layer):
    """Random numbers outside Keras' seed generators: not repeatable, so not checkable."""

    def call(self, x):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        return x + tf.random.normal(tf.shape(x))


class _MixingSubclass(keras.Model):
    """A subclassed model (no `inputs`) that subtracts the batch mean."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x - ops.mean(x, axis=0))


def _mixing_cases():
    return {
        # Two variable-less mixing layers: 1.75 C and 1.695 C on the ghost path if accepted.
        "batch_center": keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0),
                                            name="batch_center"),
        "norm_axis0": keras.layers.LayerNormalization(axis=0, center=False, scale=False,
                                                      name="norm_axis0"),
        "only_first": keras.layers.Lambda(  # moves only the others when example 0 changes
            lambda t: t + ops.mean(t[:1], axis=0), name="only_first"),
        "only_last": keras.layers.Lambda(lambda t: t + ops.mean(t[-1:], axis=0),
                                         name="only_last"),
        "tiny": keras.layers.Lambda(lambda t: t + 1e-6 * ops.sum(t, axis=0), name="tiny"),
        "custom": _BatchMean(name="custom"),
    }


@pytest.mark.parametrize("name", sorted(_mixing_cases()))
def test_a_layer_that_mixes_examples_is_named_whatever_its_class(name):
    model = _conv_model(lambda x: _mixing_cases()[name](x))
    with pytest.raises(ExampleMixingError, match=rf"layer model/{name} mixes examples.*"
                                                 r"GroupNormalization"):
        refuse_example_mixing(model)


def test_the_first_mixing_layer_inside_a_nested_model_is_named():
    inner_inputs = keras.Input((6, 6, 16))
    x = keras.layers.Conv2D(4, 1, name="before")(inner_inputs)
    x = keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0), name="center")(x)
    inner = keras.Model(inner_inputs, keras.layers.Conv2D(2, 1, name="after")(x), name="inner")
    model = _conv_model(inner)
    with pytest.raises(ExampleMixingError, match=r"layer model/inner/center mixes examples"):
        refuse_example_mixing(model)


def test_a_batch_size_dependent_layer_is_refused():
    divide = keras.layers.Lambda(lambda t: t / ops.cast(ops.shape(t)[0], "float32"))
    with pytest.raises(ExampleMixingError, match="change when an example is removed"):
        refuse_example_mixing(_conv_model(divide))


def test_unrepeatable_random_layers_are_refused_and_keras_seeded_ones_accepted():
    with pytest.raises(ExampleMixingError, match="two training-mode calls on the same batch"):
        refuse_example_mixing(_conv_model(_TFRandom()))
    refuse_example_mixing(_conv_model(keras.layers.Dropout(0.5)))
    refuse_example_mixing(_conv_model(keras.layers.GaussianNoise(1.0)))


@pytest.mark.parametrize("norm_layer", [
    lambda: keras.layers.GroupNormalization(4), lambda: keras.layers.LayerNormalization(),
    lambda: keras.layers.Activation("relu"), lambda: keras.layers.UnitNormalization()])
def test_per_example_layers_pass_the_probe(norm_layer):
    refuse_example_mixing(_conv_model(norm_layer()))


def test_the_probe_changes_nothing_in_the_model():
    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization()
    bn.trainable = False
    model = _conv_model(bn)
    before = [w.copy() for w in model.get_weights()]
    refuse_example_mixing(model)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_embedding_inputs_are_probed_at_a_smaller_range():
    inputs = keras.Input((5,))
    x = keras.layers.Embedding(7, 4)(inputs)  # ids >= 7 are refused by the gather
    x = keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0), name="center")(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)), name="model")
    with pytest.raises(ExampleMixingError, match="model/center mixes examples"):
        refuse_example_mixing(model)


def _mechanism():
    return accounting.DPMechanism(num_examples=64, batch_size=8, num_steps=2,
                                  noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)


@pytest.mark.parametrize("clipping", ["auto", "ghost", "vectorized"])
def test_dp_model_compile_refuses_a_mixing_layer_on_every_path(clipping):
    model = _conv_model(_mixing_cases()["batch_center"])
    dp = DPModel(model, _mechanism(), clipping=clipping)  # the names pass
    with pytest.raises(ExampleMixingError, match="model/batch_center mixes examples"):
        dp.compile(optimizer="sgd")


def test_make_private_refuses_a_mixing_layer():
    model = _conv_model(_mixing_cases()["norm_axis0"])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (64, 8, 8, 3)).astype(np.uint8)
    y = rng.integers(0, 2, 64)
    with pytest.raises(ExampleMixingError, match="model/norm_axis0 mixes examples"):
        make_private(model, (x, y), PrivateTrainingConfig(
            privacy=PrivacyConfig(target_epsilon=3.0, target_delta=1e-3, l2_clip_norm=1.0),
            optimization=OptimizationConfig(optimizer_fn=keras.optimizers.SGD, batch_size=8,
                                            num_steps=8)))  # one epoch of 64


def test_a_subclassed_model_is_checked_on_its_first_batch():
    model = _MixingSubclass()
    model(np.zeros((2, 3), np.float32))
    dp = DPModel(model, _mechanism())
    dp.compile(optimizer="sgd")  # no input shape to probe yet
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    with pytest.raises(ExampleMixingError, match="mixes examples"):
        dp.train_on_batch(x, np.array([0, 1, 0, 1]))


# -- What an outputs-only probe at the first and last example would miss --

def _zero_head_model(mixing):
    """A mixing layer under a head initialized to zeros (build_finetune_model's default head):
    the outputs are constant, but the head's gradient is made of the mixed features."""
    inputs = keras.Input((6, 6, 2))
    x = mixing(keras.layers.Conv2D(3, 3)(inputs))
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(4, kernel_initializer="zeros")(x),
                       name="model")


@pytest.mark.parametrize("mixing", [
    lambda: keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0), name="mixer"),
    lambda: keras.layers.LayerNormalization(axis=0, center=False, scale=False, name="mixer")])
def test_a_head_of_zeros_does_not_hide_a_mixing_layer(mixing):
    # Before: accepted, then 1.19 C and 1.25 C (leave-one-out by removal) on the ghost path.
    with pytest.raises(ExampleMixingError, match="layer model/mixer mixes examples"):
        refuse_example_mixing(_zero_head_model(mixing()))


@pytest.mark.parametrize("mix", [
    lambda t: t + t[1:2],  # example 1 into every other: before, accepted (2.42 C)
    lambda t: t + ops.sum(t[4:], axis=0),  # examples beyond the fourth: before, 1.27 C
    lambda t: t + t[-2:-1]])
def test_mixing_from_any_position_is_found(mix):
    model = _conv_model(keras.layers.Lambda(mix, name="positional"))
    with pytest.raises(ExampleMixingError, match="layer model/positional mixes examples"):
        refuse_example_mixing(model)


class _RunningCenter(keras.layers.Layer):
    """x minus a running mean of past batches, updated in training (a user's BatchNorm)."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=False):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * ops.mean(x, axis=0))
        return x - self.mean


def test_a_layer_that_stores_a_statistic_of_the_batch_is_refused():
    # Before: accepted; one DP step moved running_mean by 23.4 (private data in the model).
    with pytest.raises(ExampleMixingError, match=r"assigns the non-trainable variables "
                                                 r"\['running_center/running_mean'\]"):
        refuse_example_mixing(_conv_model(_RunningCenter(name="running_center")))


def _mix_gradient(x):
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    @tf.custom_gradient
    def identity(t):
        def grad(dy):
            return dy + 50.0 * tf.reduce_mean(dy, axis=0, keepdims=True)
        return tf.identity(t), grad

    return identity(x)


class _GradientMix(keras.layers.Layer):
    """The identity in the forward pass; its gradient adds the batch's mean gradient."""

    def call(self, x):
        return _mix_gradient(x)


class _GradientScale(keras.layers.Layer):
    """A custom gradient that keeps examples apart (doubles it): not refused."""

    def call(self, x):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        @tf.custom_gradient
        def identity(t):
            return tf.identity(t), lambda dy: 2.0 * dy

        return identity(x)


def test_a_custom_gradient_that_mixes_examples_is_refused():
    # Before: accepted (a documented limitation), 1.50 C on the default path.
    with pytest.raises(ExampleMixingError, match="user-defined gradient"):
        refuse_example_mixing(_conv_model(_GradientMix(name="gradient_mix")))
    refuse_example_mixing(_conv_model(_GradientScale(name="gradient_scale")))


def test_keras_own_custom_gradients_are_trusted_and_cheap():
    # EfficientNet's silu activations have TensorFlow's custom gradient; they are not probed
    # in reverse mode (the probe took 41 s for EfficientNetB0 at 32 x 32 when they were).
    from tfdp.models.validation import gradients, probe  # pylint: disable=g-import-not-at-top

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="silu", name="conv_silu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)), name="model")
    nodes = probe.traced_call(model, (6, 8, 8, 3), True)
    assert gradients.custom_gradient_ops(model, nodes) == []
    model = _conv_model(_GradientMix(name="gradient_mix"))
    nodes = probe.traced_call(model, (6, 8, 8, 3), True)
    assert any("gradient_mix" in name for name in gradients.custom_gradient_ops(model, nodes))


def _keras_ops_mix(x):
    @ops.custom_gradient
    def identity(t):
        def grad(*args, upstream=None):
            dy = args[0] if upstream is None else upstream
            return dy + 50.0 * ops.mean(dy, axis=0, keepdims=True)
        return t * 1.0, grad

    return identity(x)


def _dense_model(*middle):
    inputs = keras.Input((8,))
    x = inputs
    for layer in middle:
        x = layer(x)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(x)))


class _KerasOpsMix(keras.layers.Layer):
    def call(self, x):
        return _keras_ops_mix(x)


@pytest.mark.parametrize("make", [
    lambda: _conv_model(_GradientScale(name="gradient_scale")),
    lambda: _dense_model(keras.layers.Dense(4), keras.layers.Activation(_mix_gradient)),
    lambda: _dense_model(keras.layers.Dense(4, activation=_mix_gradient)),
    lambda: _dense_model(keras.layers.Dense(4), _KerasOpsMix()),
    # A user layer and a Keras layer of the same name: the old owner-by-name rule trusted it.
    lambda: _dense_model(keras.layers.Dense(4), keras.Sequential(
        [_GradientMix(name="act2")], name="inner"), keras.layers.Activation("relu", name="act2")),
], ids=["user_layer", "activation_fn", "dense_activation_fn", "keras_ops", "shared_name"])
def test_user_defined_gradients_are_listed_wherever_they_are_made(make):
    # A mixing gradient passed as an Activation's function must not be trusted because a
    # Keras layer made it (it would skip the backward probe and take the ghost path: 2.0 C).
    # The registered gradient's own functions decide.
    from tfdp import models  # pylint: disable=g-import-not-at-top

    assert models.user_defined_gradients(make())


def test_keras_and_tensorflow_gradients_stay_trusted():
    from tfdp import models  # pylint: disable=g-import-not-at-top

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, activation="silu")(inputs)
    assert models.user_defined_gradients(
        keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))) == []
    with pytest.raises(ExampleMixingError, match="input shape is not known"):
        models.user_defined_gradients(_MixingSubclass())


def test_a_mixing_gradient_passed_as_an_activation_is_refused():
    # The probe now runs its backward check for it (accepted before: 2.0 C on the ghost path).
    with pytest.raises(ExampleMixingError, match="user-defined gradient"):
        refuse_example_mixing(_dense_model(keras.layers.Dense(4),
                                           keras.layers.Activation(_mix_gradient)))


def _first_example_added_then(*layers, beside=None):
    """`Input((1, 1, 3))`, the first example added to every row (a mix), `layers`, then
    `Dense(2)`; `beside(inputs)` is added to the last output when given."""
    inputs = keras.Input((1, 1, 3))
    x = keras.layers.Lambda(lambda t: t + ops.mean(t[:1], axis=0))(inputs)
    for layer in layers:
        x = layer(x)
    if beside is not None:
        x = keras.layers.Add()([x, beside(inputs)])
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


@pytest.mark.parametrize("reach, no_gradient", [
    ("gradient_only", "stop_gradient"), ("beside_a_direct_path", "stop_gradient"),
    ("beside_a_direct_path", "bitcast"), ("beside_a_direct_path", "numpy_function")])
def test_a_mix_that_only_a_stop_gradient_lets_into_the_backward_pass_is_refused(
        reach, no_gradient):
    # The first example added to every row, a conv, then
    # `t - stop_gradient(t)`: 0 in the forward pass (the forward probe sees nothing), the
    # identity in the backward one, so each row's conv gradient read the first example. No
    # user-defined gradient, so the backward probe did not run, and the ghost path took it:
    # removing one example moved the clipped sum by 4.19 C.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    # Escapes from a list of op names: a value passed on without a
    # gradient (a bitcast round trip; tf.numpy_function) moved the sum by 7.27 C.
    without_gradient = {
        "stop_gradient": tf.stop_gradient,
        "bitcast": lambda t: tf.bitcast(tf.bitcast(t, tf.int32), tf.float32),
        "numpy_function": lambda t: tf.ensure_shape(
            tf.numpy_function(lambda a: a, [t], tf.float32, stateful=False), t.shape)}
    model = _first_example_added_then(
        keras.layers.Conv2D(2, 1),
        keras.layers.Lambda(lambda t: t - without_gradient[no_gradient](t)),
        beside=keras.layers.Conv2D(2, 1) if reach == "beside_a_direct_path" else None)
    with pytest.raises(ExampleMixingError, match="without a gradient"):
        refuse_example_mixing(model)


def test_a_mixing_layer_hidden_by_a_saturated_tanh_at_pixel_range_is_refused():
    # The DP-model fuzzer's case: a Lambda adding the first example to every row, before a
    # tanh conv that pixels in [0, 255] saturate (every output the same), passed the probe;
    # on inputs near 1e-3 it moved a clipped sum by 1.83 C. The probe now also runs at a
    # thousandth of the range.
    model = _first_example_added_then(  # saturated by pixels: tanh = 1
        keras.layers.Conv2D(2, (1, 3), padding="same", activation="tanh",
                            kernel_initializer="ones"))
    with pytest.raises(ExampleMixingError, match="mixes examples"):
        refuse_example_mixing(model)


def test_a_mixing_layer_behind_a_relu_dead_for_positive_inputs_is_refused():
    # The first example added to every row, then a ReLU conv whose kernel is
    # negative, dead for every positive input at both ranges; the signed second probe sees it.
    model = _first_example_added_then(
        keras.layers.Conv2D(2, 1, activation="relu", use_bias=False,
                            kernel_initializer=keras.initializers.Constant(-1.0)))
    with pytest.raises(ExampleMixingError, match="mixes examples"):
        refuse_example_mixing(model)


class _OnlyLargeInputs(keras.layers.Layer):
    """Raises on inputs below 1: a model the second probe cannot run."""

    def call(self, x):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        tf.debugging.assert_greater(ops.max(x), 1.0)
        return x


def test_a_model_that_fails_on_the_second_probe_range_is_refused_not_skipped():
    inputs = keras.Input((4,))
    x = keras.layers.Lambda(lambda t: t + ops.mean(t[:1], axis=0))(_OnlyLargeInputs()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="tanh",
                                                   kernel_initializer="ones")(x))
    with pytest.raises(ExampleMixingError, match="fails on one in"):
        refuse_example_mixing(model)


def test_a_model_with_float64_outputs_is_probed_in_both_directions():
    # The backward probe's projections are float32: they are cast to each output's dtype
    # (a float64 head failed at trace time once they became tensors), and a float64
    # model that mixes examples is still refused.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def model(mix):
        inputs = keras.Input((3,))
        x = keras.layers.Dense(4)(inputs)
        if mix:
            x = keras.layers.Lambda(lambda t: t + ops.mean(t, axis=0, keepdims=True))(x)
        return keras.Model(inputs, keras.layers.Lambda(lambda t: tf.cast(t, tf.float64))(x))

    refuse_example_mixing(model(mix=False))
    with pytest.raises(ExampleMixingError):
        refuse_example_mixing(model(mix=True))
