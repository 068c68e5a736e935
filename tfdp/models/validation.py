"""Checks that a Keras model is compatible with per-example DP-SGD."""

import keras
import numpy as np

from tfdp import graph_checks
from tfdp import host

_FIX_HINT = (
    "DP-SGD clips each example's gradient, so no layer may mix examples across "
    "the batch. Replace it with keras.layers.GroupNormalization (De et al. 2022, "
    "App. C.1: 16 groups) or keras.layers.LayerNormalization, which normalize "
    "each example on its own (Ponomareva et al. 2023, 'How to DP-fy ML', "
    "Sec. 5.5.1)."
)


def _direct_children(layer):
    """Returns the layers directly nested in `layer`, in a stable order."""
    children = list(layer.layers) if isinstance(layer, keras.Model) else []
    for value in vars(layer).values():
        if isinstance(value, keras.layers.Layer):
            children.append(value)
        elif isinstance(value, (list, tuple)):
            children.extend(v for v in value if isinstance(v, keras.layers.Layer))
        elif isinstance(value, dict):
            children.extend(v for v in value.values() if isinstance(v, keras.layers.Layer))
    return children


def iter_layers(layer):
    """Yields (path, layer) for `layer` and every layer nested in it, each once.

    Nested layers are found through `keras.Model.layers` and through the
    attributes of any layer (sub-layers kept in attributes, lists, tuples or
    dicts), so functional, sequential and subclassed models are all covered.
    The walk is depth first; a layer reachable twice is yielded once.

    Args:
      layer: a `keras.layers.Layer` (a `keras.Model` is one).

    Yields:
      (path, layer) pairs, path being the "/"-joined layer names from `layer`
      down, starting with (layer.name, layer).
    """
    seen = set()
    stack = [(layer.name, layer)]
    while stack:
        path, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield path, current
        children = _direct_children(current)
        stack.extend((f"{path}/{child.name}", child) for child in reversed(children))


_FREEZE_HINT = (
    "A pretrained BatchNormalization may stay if it is frozen: set `layer.trainable = "
    "False` on it (or on the model holding it) before building the DPModel; Keras 3 then "
    "normalizes with its moving (public, pretrained) statistics even in training mode."
)


def is_frozen_batch_norm(layer):
    """True for a `keras.layers.BatchNormalization` that runs in inference mode in every call.

    Such a layer normalizes each example with its moving mean and variance,
    which are fixed (public, pretrained) statistics, so it mixes no examples
    and its statistics never change. Keras 3 runs a BatchNormalization with
    `trainable=False` in inference mode even when called with
    `training=True`: its `call` takes the batch moments only under
    `if training and self.trainable:` (keras/src/layers/normalization/
    batch_normalization.py, `BatchNormalization.call`, and the class doc's
    "About setting `layer.trainable = False`"). Only the exact class is
    trusted (synchronized or not: synchronization only changes the batch
    moments, which a frozen layer never computes); a subclass may override
    `call`.

    Args:
      layer: any `keras.layers.Layer`.

    Returns:
      bool.
    """
    return type(layer) is keras.layers.BatchNormalization and not layer.trainable


def _mixes_examples(layer):
    """True for layers that compute statistics over the batch axis."""
    if is_frozen_batch_norm(layer):
        return False
    if isinstance(layer, keras.layers.BatchNormalization):
        # Also covers synchronized BatchNorm (BatchNormalization(synchronized=True),
        # Keras 3's SyncBatchNorm) and any subclass.
        return True
    # Batch norms from other libraries (tf_keras, custom SyncBatchNorm classes).
    return any("BatchNorm" in cls.__name__ for cls in type(layer).__mro__)


def validate_float32(layer):
    """Raises if `layer`, or any layer nested in it, computes in float16 or bfloat16.

    tfdp does not support mixed precision. Its per-example norms and clip
    factors are float32: in float16 a norm is accurate to only about 1e-3, so
    a clipped contribution could exceed C (and on the ghost path the float16
    activations do not even meet the float32 factors). Under "mixed_float16"
    Keras' `compile` also wraps the optimizer in a `LossScaleOptimizer`,
    which would divide the noisy clipped sum by its loss scale.

    Args:
      layer: a `keras.layers.Layer` (a `keras.Model`, or a `DPModel` itself,
        whose own dtype policy decides the loss scaling).

    Raises:
      ValueError: naming every such layer (path and dtype policy), with the fix.
    """
    offenders = [
        f"{path} ({current.dtype_policy.name})"
        for path, current in iter_layers(layer)
        if getattr(current, "compute_dtype", "float32") in ("float16", "bfloat16")
    ]
    if offenders:
        raise ValueError(
            "tfdp does not support mixed precision; these layers compute in float16 or "
            "bfloat16: " + ", ".join(offenders) + ". Per-example norms and clipping must "
            "be float32 (a float16 norm can come out too small, so an example could "
            "contribute more than l2_clip_norm, and Keras' loss scaling would rescale the "
            "update). Call keras.config.set_dtype_policy('float32') before building the "
            "model and the DPModel."
        )


def validate_dp_model(model, *, check_inputs=None, atol=1e-5):
    """Raises if `model` has a layer that mixes examples across the batch.

    DP-SGD needs each example's gradient to depend on that example only: its
    sensitivity analysis clips per-example gradients (Abadi et al. 2016;
    Ponomareva et al. 2023, Sec. 5.5.1). BatchNorm breaks this (its training
    mode normalizes with batch statistics) and must be replaced by GroupNorm
    (De et al. 2022, App. C.1). tfdp computes per-example gradients with
    `tf.vectorized_map`, calling the model on one example at a time, so such a
    layer would also silently compute different statistics than in a batch.

    Two checks:
      1. Structural, always: every layer, recursively through nested models
         and sub-layers, is rejected if it is a `keras.layers.BatchNormalization`
         (including synchronized BatchNorm) or any class whose name contains
         "BatchNorm", unless it is a FROZEN `keras.layers.BatchNormalization`
         (`trainable=False`, `is_frozen_batch_norm`): Keras 3 runs it in
         inference mode even with `training=True`, so it normalizes with its
         public pretrained statistics and mixes no examples (De et al. 2022,
         Sec. 4, fine-tuning pretrained models). `LayerNormalization`, `GroupNormalization`,
         `UnitNormalization` and `Normalization` (fixed statistics) are per
         example and accepted. A layer that computes in float16 or bfloat16
         (mixed precision) is rejected too (`validate_float32`).
      2. Functional, if `check_inputs` is given: the model in training mode on
         the whole batch must equal the model on each example alone (within
         `atol`). This also catches custom layers that reduce over the batch
         axis and layers that are random in training mode (dropout), which
         tfdp's models avoid (De et al. 2022 remove dropout).

    Note: a `keras.layers.Normalization` layer adapted on the private training
    set leaks its statistics; release them with DP instead
    (`tfdp.dp.data_normalization`, Tramer & Boneh 2021, App. B).

    Args:
      model: a `keras.Model` (or any `keras.layers.Layer`).
      check_inputs: optional batch of at least 2 model inputs, e.g. float32
        images [batch, height, width, channels].
      atol: absolute tolerance of the functional check, after scaling by
        max(1, max |output|).

    Returns:
      None.

    Raises:
      ValueError: naming every offending layer (path and class), with the fix;
        naming every mixed-precision layer (`validate_float32`); or, for the
        functional check, naming the first example whose output
        depends on the rest of the batch.
    """
    offenders = [
        f"{path} ({type(layer).__name__})"
        for path, layer in iter_layers(model)
        if _mixes_examples(layer)
    ]
    if offenders:
        raise ValueError(
            "validate_dp_model: these layers mix examples across the batch: "
            + ", ".join(offenders)
            + ". "
            + _FIX_HINT
            + " "
            + _FREEZE_HINT
        )
    validate_float32(model)

    if check_inputs is None:
        return
    inputs = np.asarray(check_inputs)
    if inputs.shape[0] < 2:
        raise ValueError(
            f"validate_dp_model: check_inputs has {inputs.shape[0]} example(s); pass a batch "
            "of at least 2 so that mixing across examples can show."
        )
    batched = np.asarray(model(inputs, training=True))
    single = np.concatenate(
        [np.asarray(model(inputs[i : i + 1], training=True)) for i in range(inputs.shape[0])]
    )
    tolerance = atol * max(1.0, float(np.max(np.abs(batched))))
    for i in range(inputs.shape[0]):
        if not np.allclose(batched[i], single[i], rtol=0.0, atol=tolerance):
            raise ValueError(
                f"validate_dp_model: in training mode, the output of {model.name} for "
                f"example {i} differs between a call on the whole batch and a call on the "
                f"example alone (max |diff| = {np.max(np.abs(batched[i] - single[i])):.3g}). "
                "Some layer mixes examples across the batch or is random in training mode "
                "(e.g. dropout). " + _FIX_HINT
            )


# -- The behavioural check: does one example move another's output? ----------

_PROBE_SIZE = 6  # examples in the probe batch (more than 4: a layer may mix only beyond)
_UNKNOWN_DIM = 32  # probe size of an input dimension the model leaves open
# Probe pixel ranges, tried in order: tfdp's image range, then small values for a model
# whose inputs are ids (an Embedding rejects ids >= its vocabulary).
_PROBE_SCALES = (255.0, 2.0)
_SMALL_PROBE = 1e-3  # the second probe's range, as a fraction of the first's


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


def _probe_shape(model, example_shape):
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


def _seed_states(model):
    """ids of the state variables of every `keras.random.SeedGenerator` in `model`."""
    states = set()
    for _, layer in iter_layers(model):
        for value in vars(layer).values():
            if isinstance(value, keras.random.SeedGenerator):
                states.add(id(value.state))
    return states


def _numpy(tensors):
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in keras.tree.flatten(tensors)]


def _perturbed_weights(model, rng):
    """A `StatelessScope` state mapping: every trainable variable plus random noise.

    Probing at perturbed weights keeps a layer that starts at zero (a
    fine-tuning head initialized to zeros) from hiding a mixing layer below
    it: at the initial weights such a model's outputs are constant, while the
    head's gradient, made of the mixed features, is not. The noise is normal,
    of standard deviation half the variable's root mean square (0.05 for a
    variable of zeros).
    """
    mapping = []
    for v in model.trainable_variables:
        value = np.asarray(keras.ops.convert_to_numpy(v.value))
        rms = float(np.sqrt(np.mean(np.square(value)))) if value.size else 0.0
        noise = rng.normal(size=value.shape) * (0.5 * rms if rms > 0 else 0.05)
        mapping.append((v, keras.ops.convert_to_tensor((value + noise).astype(value.dtype))))
    return mapping


def _call(model, inputs, weights=(), training=True):
    """`(outputs, assigned)` of `model(inputs, training=...)`, changing no variable.

    `outputs`: the model's outputs, flattened to numpy; `weights`: a state
    mapping of the trainable variables (`_perturbed_weights`), or () for
    their values; `assigned`: the non-trainable variables the call assigned.

    Each call runs in a fresh `keras.StatelessScope`: updates of variables
    (a BatchNormalization's moving statistics, a `keras.random.SeedGenerator`'s
    state) are collected there and dropped, so every call starts from the same
    state and a layer that draws random numbers with Keras' seed generators
    (Dropout, GaussianNoise) draws the same ones each time.
    """
    with keras.StatelessScope(state_mapping=list(weights)) as scope:
        outputs = model(inputs, training=training)
    assigned = [v for v in model.non_trainable_variables
                if scope.get_current_value(v) is not None]
    return _numpy(outputs), assigned


def _others_moved(before, after, changed, rows):
    """Whether any output row other than `changed` differs (exactly) between two calls."""
    for a, b in zip(before, after):
        if a.ndim == 0 or a.shape[0] != rows or a.shape != b.shape:
            continue  # not batch-major: cannot be compared row by row
        keep = np.arange(rows) != changed
        if not np.array_equal(a[keep], b[keep], equal_nan=True):
            return True
    return False


def _recorded_calls(model, inputs):
    """`(input, [(layer, args, output)])` of every layer call of a functional or Sequential model.

    Built with `keras.models.clone_model(..., call_function=...)`, the public
    hook into each layer call of a functional model (the same one
    `tfdp.training.GhostClipping` uses), sharing the layers; a Sequential's
    layers are called in order. None for a subclassed model.
    """
    calls = []
    tensor = keras.Input(batch_shape=inputs.shape, dtype="float32")

    def record(layer, *args, **kwargs):
        output = layer(*args, **kwargs)
        calls.append((layer, args, output))
        return output

    if isinstance(model, keras.Sequential):
        x = tensor
        for layer in model.layers:
            x = record(layer, x)
    else:
        try:
            keras.models.clone_model(model, input_tensors=tensor, clone_function=lambda l: l,
                                     call_function=record)
        except (ValueError, TypeError):
            return None
    return tensor, calls


def _first_mixing_layer(model, inputs, changed_inputs, changed, path, training, weights):
    """The path of the first layer call whose output rows move with another example's input.

    Looks inside a nested functional or Sequential model whose inputs do not
    yet move; a subclassed model is named as a whole.
    """
    recorded = _recorded_calls(model, inputs)
    if recorded is None or not recorded[1]:
        return path
    tensor, calls = recorded
    rows = inputs.shape[0]
    wanted = []  # each call's output, then a nested model's input (to look inside it)
    for layer, args, output in calls:
        wanted.append(output)
        if isinstance(layer, keras.Model) and len(args) == 1:
            wanted.append(args[0])
    probe = keras.Model(tensor, wanted)
    outs_a = _call(probe, inputs, weights, training)[0]
    outs_b = _call(probe, changed_inputs, weights, training)[0]
    flat = 0
    for layer, args, output in calls:
        count = len(keras.tree.flatten(output))
        moved = _others_moved(outs_a[flat:flat + count], outs_b[flat:flat + count], changed,
                              rows)
        flat += count
        nested = isinstance(layer, keras.Model) and len(args) == 1
        if nested:
            in_count = len(keras.tree.flatten(args[0]))
            in_a, in_b = outs_a[flat:flat + in_count], outs_b[flat:flat + in_count]
            flat += in_count
        if moved:
            name = f"{path}/{layer.name}"
            if nested and len(in_a) == 1 and not _others_moved(in_a, in_b, changed, rows):
                return _first_mixing_layer(layer, in_a[0], in_b[0], changed, name, training,
                                           weights)
            return name
    return path


def _traced_call(model, shape, training):
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


def _refuse_buggy_matmuls(model, nodes):
    """Raises before the probe runs `model` if its own call forms oneDNN's bad matmul.

    With oneDNN on, TensorFlow 2.21 computes a rank-4 batch matmul that
    broadcasts one operand wrongly or corrupts the heap
    (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`); a model whose forward pass
    forms one on a batch would crash the probe, and no path can train it.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    if host.onednn_enabled() is False or tf.config.list_logical_devices("GPU"):
        return
    risky = graph_checks.broadcast_batch_matmuls(nodes)
    if risky:
        raise ValueError(
            f"{model.name}'s own forward pass forms batch matmuls that TensorFlow 2.21 computes "
            f"wrongly with oneDNN on: {'; '.join(n.describe() for n in risky[:4])}. "
            f"{graph_checks.BROADCAST_MATMUL_BUG} Make the model's matmuls rank 3 (reshape to "
            "[batch, T, C] before a Dense or tf.matmul), or set TF_ENABLE_ONEDNN_OPTS=0 before "
            "TensorFlow is imported (slower: docs/design/dp_step.md, 'oneDNN on, on every host').")


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


def _custom_gradient_ops(model, nodes):
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


def _gradient_not_derivative_ops(nodes):
    """Names of the ops whose gradient is not their derivative (`_GRADIENT_NOT_DERIVATIVE`,
    and fake quantization's straight-through estimators)."""
    return [node.name for node in nodes
            if node.op in _GRADIENT_NOT_DERIVATIVE or node.op.startswith("FakeQuant")]


def user_defined_gradients(model, example_shape=None, *, training=True):
    """Ops of `model`'s call whose user-defined gradient tfdp cannot vouch for.

    `tf.custom_gradient` (or `keras.ops.custom_gradient`) whose registered
    gradient is not all TensorFlow's and Keras' own code (`_custom_gradient_ops`;
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
    shape, _ = _probe_shape(model, example_shape)
    return _custom_gradient_ops(model, _traced_call(model, shape, training))


def _traced_gradient(model, rows, training, weights):
    """A tf.function `(inputs, keep, projections) -> gradients` for `_gradient_moved`.

    The gradient (reverse mode, the model's own backward pass, custom
    gradients included) of `sum_{j: keep_j} <projections_k[j], outputs_k[j]>`
    over the model's batch outputs k, with respect to the trainable variables
    (their perturbed values `weights`). One graph for every call of both probe
    ranges (traced once: the shapes never change), so that the two calls
    compared run the same kernels, and a large model's eager calls are not
    paid 12 times per range.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    values = [value for _, value in weights]

    @tf.function(autograph=False)
    def traced_gradient(inputs, keep, projections):
        with tf.GradientTape() as tape:
            tape.watch(values)
            with keras.StatelessScope(state_mapping=list(zip([v for v, _ in weights], values))):
                outputs = keras.tree.flatten(model(inputs, training=training))
            total = tf.add_n([tf.reduce_sum(tf.boolean_mask(o * tf.cast(p, o.dtype), keep))
                              for o, p in zip(outputs, projections)
                              if o.shape.rank and o.shape[0] == rows])
        return tape.gradient(total, values, unconnected_gradients=tf.UnconnectedGradients.ZERO)

    return traced_gradient


def _gradient_moved(traced_gradient, base, reference, bounds, rng):
    """Whether the gradient of some examples' outputs moves when other examples change.

    For every bit b of the example index, and both of its values v: the
    gradient (`_traced_gradient`) of `sum_{j: bit b of j = v} <u_j, outputs_j>`,
    u random, before and after the examples whose bit b is not v are replaced
    by random ones in `bounds`. Any two examples differ in some bit, so an
    example whose backward pass reads another is caught. Exact comparison.
    `reference` is the model's outputs on `base` (their shapes give u's).
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    rows = base.shape[0]
    projections = [tf.constant(rng.normal(size=r.shape).astype(np.float32)) for r in reference]

    def gradient(inputs, keep):
        return _numpy(traced_gradient(tf.constant(inputs), tf.constant(keep), projections))

    for bit in range(max(1, int(np.ceil(np.log2(rows))))):
        for value in (0, 1):
            keep = ((np.arange(rows) >> bit) & 1) == value
            if keep.all() or not keep.any():
                continue
            changed = base.copy()
            changed[~keep] = _draw(rng, changed[~keep].shape, bounds)
            if any(not np.array_equal(a, b, equal_nan=True)
                   for a, b in zip(gradient(base, keep), gradient(changed, keep))):
                return True
    return False


def _first_probe(model, shape, rng, weights, training):
    """`(base, scale, _call(model, base, ...))` on the first probe range the model accepts.

    `base` is a random batch of `shape` in [0, scale), scale tried in the order
    of `_PROBE_SCALES`.

    Raises:
      ExampleMixingError: if the model fails on every probe range.
    """
    errors = []
    for scale in _PROBE_SCALES:
        base = (rng.random(shape) * scale).astype(np.float32)
        try:
            reference = _call(model, base, weights, training)
        except Exception as error:  # noqa: BLE001 (the model rejects this range; try the next)
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            continue
        return base, scale, reference
    raise ExampleMixingError(
        f"Cannot check that {model.name} keeps examples apart: it fails on a probe batch "
        f"of shape {list(shape)} ({'; '.join(errors)}). Build the model with a fixed "
        "input shape (keras.Input(shape=(H, W, C))) that takes float32 images.")


def _refuse_stored_statistics(model, assigned):
    """Raises if a call assigned a variable other than a `keras.random.SeedGenerator`'s state."""
    seeds = _seed_states(model)
    stored = [v.path for v in assigned if id(v) not in seeds]
    if stored:
        raise ExampleMixingError(
            f"In training mode, {model.name} assigns the non-trainable variables {stored} from "
            "its batch (a running statistic, as BatchNormalization's moving mean): a statistic "
            "of the private data, kept in the model and exported without noise, and shared by "
            "the examples of later batches. Compute it per example, or from public data, or "
            "freeze the layer so that it does not update (trainable = False).")


def _refuse_mixed_outputs(model, base, outputs, bounds, rng, weights, training):
    """Raises if replacing one example of `base` moves another example's `outputs`.

    Each example in turn is replaced by a random one in `bounds` (low, high); if the
    others' outputs move, the model is refused as not repeatable (two calls
    on `base` differ) or as mixing examples (naming the first mixing layer).
    """
    rows = base.shape[0]
    for changed in range(rows):
        other = base.copy()
        other[changed] = _draw(rng, base.shape[1:], bounds)
        if not _others_moved(outputs, _call(model, other, weights, training)[0], changed, rows):
            continue
        if _others_moved(outputs, _call(model, base, weights, training)[0], -1, rows):
            raise ExampleMixingError(
                f"{model.name} gives different outputs in two training-mode calls on the same "
                "batch: it draws random numbers that Keras' seed generators do not control "
                "(e.g. tf.random.* in a custom layer), or a kernel gives different results on "
                "the same input, so tfdp cannot check that it keeps examples apart. Draw them "
                "with keras.random.* and a keras.random.SeedGenerator, as Keras' Dropout does.")
        layer = _first_mixing_layer(model, base, other, changed, model.name, training,
                                    weights)
        raise ExampleMixingError(
            f"In {'training' if training else 'inference'} mode, the output of {model.name} for "
            "one example (or its gradient) "
            f"changes when another example of the batch changes: layer {layer} mixes "
            "examples across the batch (e.g. a batch mean, a normalization over axis 0), so "
            "one example could move the clipped gradient sum by more than l2_clip_norm and the "
            "reported epsilon would not hold. " + _FIX_HINT)


def _refuse_batch_size_dependence(model, base, outputs, weights, training):
    """Raises if removing the last example of `base` moves the others' `outputs` beyond 1e-4.

    The tolerance is relative to the largest output: a different batch size
    may change the kernels' blocking.
    """
    rows = base.shape[0]
    fewer = _call(model, base[:-1], weights, training)[0]
    largest = max((float(np.nanmax(np.abs(r), initial=0.0)) for r in outputs if r.size),
                  default=0.0)
    for full, part in zip(outputs, fewer):
        if full.ndim and full.shape[0] == rows and part.shape == (rows - 1, *full.shape[1:]):
            if not np.allclose(full[:-1], part, rtol=0.0, atol=1e-4 * max(largest, 1e-30),
                               equal_nan=True):
                raise ExampleMixingError(
                    f"In training mode, the outputs of {model.name} change when an example "
                    "is removed from the batch: some layer depends on the batch size (e.g. "
                    "divides by it), so adding or removing one example moves the others' "
                    "gradients and the clip no longer bounds its effect. " + _FIX_HINT)


def refuse_example_mixing(model, example_shape=None, *, training=True):
    """Raises if one example can move another example's output, gradient or the model's state.

    DP-SGD's sensitivity assumes that each example's loss, and so its
    gradient, depends on that example alone: a layer that mixes examples
    (BatchNorm with batch statistics, a `Lambda` that subtracts the batch
    mean, a `LayerNormalization(axis=0)`, a user layer that reduces over the
    batch axis, a custom gradient that does) lets one example move the
    others' gradients, and the clip no longer bounds what it changes; a layer
    that stores a statistic of the batch in a variable (a running mean)
    releases private data in the model without noise (How to DP-fy ML,
    Ponomareva et al. 2023, Sec. 5.5.1). Layer classes and names cannot tell
    (a Lambda has neither), so this checks the behaviour on a probe batch of
    6 random images in [0, 255] (tfdp's input range; [0, 2) where the model
    rejects those, e.g. an Embedding's ids), and again in plus or minus a
    thousandth of that range (large pixels saturate a tanh, whose constant
    outputs would hide a mixing layer before it, and positive inputs keep
    some ReLUs dead), in the model's input shape (an
    open dimension is probed at 32), in training mode (or inference mode,
    for a frozen feature extractor):
    the trainable variables are perturbed at random for the probe
    (`_perturbed_weights`: a head initialized to zeros cannot hide a mixing
    layer below it), then
    1. each example in turn is replaced by another random image: every other
       example's outputs must stay BITWISE equal. Exact equality is
       justified: the two calls run the same ops on inputs of the same shapes
       (the kernels' blocking and reduction orders depend on shapes, not
       values), so a per-example model gives identical rows;
    2. the last example is removed: the others' outputs must stay within
       1e-4 of the largest (a division by the batch size; a different batch
       size may change the kernels' blocking, hence the tolerance), unless
       the model fixes its batch size;
    3. every model is also probed in reverse mode, since a user-defined
       gradient (`tf.custom_gradient`), a `tf.stop_gradient` or any op that
       passes a value on without a gradient (a bitcast round trip,
       `tf.numpy_function`) can make the backward pass differ from the
       derivative: `t - stop_gradient(t)` after a mix is 0 in the forward
       pass and mixes only the gradients. For each bit of the example index, the
       gradient of the outputs of the examples with one value of that bit
       must not move when the others change;
    4. no variable but a trainable one or a `keras.random.SeedGenerator`'s
       state may be assigned by the call (a running statistic of the batch).
    Each call runs in its own `keras.StatelessScope` (nothing of the model
    changes, and Keras' seeded random layers such as Dropout draw the same
    numbers in both calls). A model whose outputs differ between two calls
    on the SAME batch (random ops outside Keras' seed generators) cannot be
    checked and is refused.

    Args:
      model: a built `keras.Model` with one input (the one DPModel wraps).
      example_shape: the shape of one example, without the batch axis (e.g.
        `(28, 28, 1)`); None: the model's input shape (`input_example_shape`).
      training: the mode to probe (True: how DP-SGD trains the model).

    Raises:
      ExampleMixingError (a ValueError): naming the first layer whose output
        mixes examples (its path from the model down; a subclassed model is
        named whole), the variables a call assigns, or the model whose
        outputs are not repeatable, with the fix; if the model cannot run on a
        probe batch at all; or if its input shape is unknown and no
        `example_shape` is given.
      ValueError: with oneDNN on, a model whose own call forms a batch
        matmul that TensorFlow 2.21 computes wrongly (checked on the traced
        call before the probe runs it: it could corrupt the heap).
    """
    shape, fixed_batch = _probe_shape(model, example_shape)
    if shape[0] < 2:
        return  # a batch of one example cannot mix examples
    nodes = _traced_call(model, shape, training)
    _refuse_buggy_matmuls(model, nodes)
    rng = np.random.default_rng(0)
    weights = _perturbed_weights(model, rng)
    base, scale, (outputs, assigned) = _first_probe(model, shape, rng, weights, training)
    _refuse_stored_statistics(model, assigned)
    # Named in a refusal of the backward probe (which runs for every model).
    suspects = _custom_gradient_ops(model, nodes) + _gradient_not_derivative_ops(nodes)
    traced_gradient = _traced_gradient(model, shape[0], training, weights)
    _probe_at(model, base, outputs, (0.0, scale), rng, weights, training, fixed_batch, suspects,
              traced_gradient)
    # Again on signed inputs at a thousandth of the range: pixels in [0, 255] saturate a tanh,
    # whose constant outputs then hide a mixing layer before it (the DP-model fuzzer's case:
    # adding the first example to every row, before a tanh conv, moved a clipped sum by
    # 1.83 C on inputs near 1e-3), and positive inputs alone keep some ReLUs dead.
    small = (-scale * _SMALL_PROBE, scale * _SMALL_PROBE)
    base = _draw(rng, shape, small)
    try:
        outputs, assigned = _call(model, base, weights, training)
    except Exception as error:  # noqa: BLE001 (reported: a model must run on both ranges)
        raise ExampleMixingError(
            f"Cannot check that {model.name} keeps examples apart: it runs on a probe batch in "
            f"[0, {scale:g}) but fails on one in ({small[0]:g}, {small[1]:g}) "
            f"({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}), "
            "where a layer that mixes examples could show. Let the model run on small and "
            "negative inputs.") from error
    _refuse_stored_statistics(model, assigned)
    _probe_at(model, base, outputs, small, rng, weights, training, fixed_batch, suspects,
              traced_gradient)


def _draw(rng, shape, bounds):
    """Random float32 entries of `shape`, uniform in [low, high) for `bounds = (low, high)`."""
    low, high = bounds
    return (low + rng.random(shape) * (high - low)).astype(np.float32)


def _probe_at(model, base, outputs, bounds, rng, weights, training, fixed_batch, suspects,
              traced_gradient):
    """The forward, batch-size and backward checks of `refuse_example_mixing` on `base`,
    replacing examples by random ones in `bounds` (low, high); `traced_gradient` is
    `_traced_gradient`'s function for this model."""
    _refuse_mixed_outputs(model, base, outputs, bounds, rng, weights, training)
    if not fixed_batch:
        _refuse_batch_size_dependence(model, base, outputs, weights, training)
    if _gradient_moved(traced_gradient, base, outputs, bounds, rng):
        raise ExampleMixingError(
            f"In training mode, the gradient of {model.name} for one example changes when "
            f"another example of the batch changes: an op whose gradient is not the "
            f"derivative of its output (a user-defined gradient, a stop_gradient, an op "
            f"without a gradient{': ' + ', '.join(suspects[:3]) if suspects else ''}) "
            "mixes examples across the batch in the backward pass, so one example could move "
            "the clipped gradient sum by more than l2_clip_norm. " + _FIX_HINT)
