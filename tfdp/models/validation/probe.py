"""What the behavioural checks share: the probe batch's shape and the traced forward pass."""

import keras

from tfdp import graph_checks

_PROBE_SIZE = 6  # examples in the probe batch (more than 4: a layer may mix only beyond)
_UNKNOWN_DIM = 32  # probe size of an input dimension the model leaves open


class ExampleMixingError(ValueError):
    """A model whose output for one example depends on the other examples of its batch."""


def input_example_shape(model):
    """The shape of one example of `model`'s input, or None if the model does not say.

    Functional and Sequential models say (`model.inputs`); a subclassed model
    does not, until it is called on data.

    Raises:
      ExampleMixingError: a model with several inputs (DP-SGD takes one batch of images).
    """
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return None
    if len(inputs) != 1:
        raise ExampleMixingError(
            f"{model.name} must have exactly one input (a batch of images) for DP-SGD; it has "
            f"{len(inputs)}.")
    return tuple(inputs[0].shape)


def probe_shape(model, example_shape):
    """The probe batch's shape, and whether its batch size is fixed by the model."""
    batch = None
    if example_shape is None:
        shape = input_example_shape(model)
        if shape is None:
            raise ExampleMixingError(
                f"Cannot check that {model.name} keeps examples apart: its input shape is not "
                "known. Pass example_shape, or build it as a functional model.")
        batch, example_shape = shape[0], shape[1:]
    fixed = batch is not None
    return (batch if fixed else _PROBE_SIZE,
            *(_UNKNOWN_DIM if d is None else int(d) for d in example_shape)), fixed


def traced_call(model, shape, training):
    """The nodes (`tfdp.graph_checks.graph_nodes`) of `model`'s call on a batch of `shape`."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    def call(x):
        # Under a scope of its own: a model named "_..." is no valid root name scope.
        with tf.name_scope("probe"):
            return model(x, training=training)

    concrete = tf.function(call, autograph=False)
    with keras.StatelessScope():
        traced = concrete.get_concrete_function(tf.TensorSpec(shape, tf.float32))
    return graph_checks.graph_nodes(traced)
