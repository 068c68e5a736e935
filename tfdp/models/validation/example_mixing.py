"""Rule, by behaviour: no example moves another's output or gradient (`refuse_example_mixing`)."""

import keras
import numpy as np

from tfdp.models.validation.batch_statistics import FIX_HINT
from tfdp.models.validation.gradients import custom_gradient_ops, gradient_not_derivative_ops
from tfdp.models.validation.layers import iter_layers
from tfdp.models.validation.onednn_matmuls import refuse_buggy_matmuls
from tfdp.models.validation.probe import ExampleMixingError, probe_shape, traced_call

# Probe pixel ranges, tried in order: tfdp's image range, then small values for a model
# whose inputs are ids (an Embedding rejects ids >= its vocabulary).
_PROBE_SCALES = (255.0, 2.0)
_SMALL_PROBE = 1e-3  # the second probe's range, as a fraction of the first's


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
            "reported epsilon would not hold. " + FIX_HINT)


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
                    "gradients and the clip no longer bounds its effect. " + FIX_HINT)


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
    shape, fixed_batch = probe_shape(model, example_shape)
    if shape[0] < 2:
        return  # a batch of one example cannot mix examples
    nodes = traced_call(model, shape, training)
    refuse_buggy_matmuls(model, nodes)
    rng = np.random.default_rng(0)
    weights = _perturbed_weights(model, rng)
    base, scale, (outputs, assigned) = _first_probe(model, shape, rng, weights, training)
    _refuse_stored_statistics(model, assigned)
    # Named in a refusal of the backward probe (which runs for every model).
    suspects = custom_gradient_ops(model, nodes) + gradient_not_derivative_ops(nodes)
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
            "the clipped gradient sum by more than l2_clip_norm. " + FIX_HINT)
