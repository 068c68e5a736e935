"""Rule: a user-defined gradient (`tf.custom_gradient`) is named, so ghost clipping avoids it."""

from tfdp.models.validation.probe import probe_shape, traced_call


# Modules whose functions may define a trusted gradient: TensorFlow's and Keras' own (e.g.
# TensorFlow's silu, in an EfficientNet's Activation layers).
_TRUSTED_GRADIENT_MODULES = ("tensorflow.", "keras.")


def _gradient_functions(function, seen):
    """`function` and every function in its closures, recursively."""
    if id(function) in seen or not hasattr(function, "__code__"):
        return []
    seen.add(id(function))
    found = [function]
    for cell in function.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value):
            found.extend(_gradient_functions(value, seen))
    return found


def custom_gradient_ops(model, nodes):
    """Names of the ops of `model`'s traced call whose user-defined gradient is not vouched for.

    `tf.custom_gradient` (and `keras.ops.custom_gradient`) mark their op with
    a `_gradient_op_type` attribute, under which the gradient function is
    registered; such a backward pass need not be the transpose of the forward
    one, so a forward probe cannot vouch for it. The op is trusted only if
    every function of its registered gradient, closures included (the
    user's function sits inside TensorFlow's wrappers), comes from
    TensorFlow or Keras. Not the layer it is made in: a Keras layer runs a
    user's function too (`Activation(fn)`, `Dense(activation=fn)`), and a
    name scope can name two layers (a mixing gradient passed as an
    `Activation`, if trusted, would move a ghost-clipped sum by 2.0 C). A
    gradient that cannot be looked up is not trusted.
    """
    del model  # the registered gradient tells, not the layer
    from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top

    untrusted = []
    for node in nodes:
        if "_gradient_op_type" not in node.attr:
            continue
        try:
            registered = ops._gradient_registry.lookup(  # pylint: disable=protected-access
                node.attr["_gradient_op_type"].s.decode())
        except LookupError:
            registered = None
        functions = _gradient_functions(registered, set()) if registered else []
        if not functions or not all(
                (getattr(f, "__module__", None) or "").startswith(_TRUSTED_GRADIENT_MODULES)
                for f in functions):
            untrusted.append(node.name)
    return untrusted


# Ops whose gradient is not the derivative of what they compute: `t - tf.stop_gradient(t)` is
# 0 in the forward pass but passes the gradient on in the backward one, so a mix before it
# reaches only the gradients (the first example added to every row, a conv, then
# `t - stop_gradient(t)` would move the ghost-clipped sum by 4.19 C). Named in the
# refusal only: the backward probe runs for every model, since any op whose output passes a
# value on without a gradient does the same (a bitcast round trip or tf.numpy_function:
# 7.27 C through the ghost path if the probe ran only for these ops).
_GRADIENT_NOT_DERIVATIVE = ("StopGradient", "PreventGradient", "Bitcast", "PyFunc",
                            "PyFuncStateless", "EagerPyFunc")


def gradient_not_derivative_ops(nodes):
    """Names of the ops whose gradient is not their derivative (`_GRADIENT_NOT_DERIVATIVE`,
    and fake quantization's straight-through estimators)."""
    return [node.name for node in nodes
            if node.op in _GRADIENT_NOT_DERIVATIVE or node.op.startswith("FakeQuant")]


def user_defined_gradients(model, example_shape=None, *, training=True):
    """Ops of `model`'s call whose user-defined gradient tfdp cannot vouch for.

    `tf.custom_gradient` (or `keras.ops.custom_gradient`) whose registered
    gradient is not all TensorFlow's and Keras' own code (`custom_gradient_ops`;
    a user's function in a Keras `Activation` counts). Ghost clipping must not run through such a
    model: its norms split one backward pass of the batch into rows, each
    row's output gradient taken as its own example's, and a user-defined
    backward pass need not keep the rows apart (one that adds the batch's mean
    gradient to every row passes `refuse_example_mixing` where the activations
    before it do not depend on the input at the probe's range: the rows then
    only trade gradient, and the total it checks does not move). DPModel takes
    the vectorized path for it, where each example's backward pass runs alone.

    Args:
      model: a built `keras.Model` with one input.
      example_shape: one example's shape; None: the model's input shape.
      training: the mode the model will run in.

    Returns:
      A list of op names (empty for a model without such ops).

    Raises:
      ExampleMixingError: if the input shape is unknown and no `example_shape`
        is given.
    """
    shape, _ = probe_shape(model, example_shape)
    return custom_gradient_ops(model, traced_call(model, shape, training))
