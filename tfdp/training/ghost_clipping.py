"""GhostClipping: DPModel's per-example clipping without per-example gradients.

The clipped sum of a batch, `sum_i min(1, C / |g_i|) g_i`, needs every
example's gradient NORM, but not its gradient. Each layer's contribution to
`|g_i|^2` follows from its input activations and its output gradients, which
one forward and one backward pass of the summed loss give for the whole batch
(`tfdp.dp.ghost_norms`: Goodfellow 2015; Li et al. 2022; Bu et al. 2022).
With the clip factors known, each layer's share of the clipped sum is
`sum_i factor_i * gradient_i`, which its rule gives from the same activations
and output gradients as the norm ("book-keeping", Bu et al. 2022, Sec. 3.2):
from the per-example gradients it held, or from the same rows as its norm. So
the backward pass through the network runs only once, and every norm bounds
the vector actually added for its example (`tfdp.dp.ghost_norms.forms`, "Rounding":
float32 norms that never come out too small at the device's matmul precision).

How the activations and output gradients are captured. The wrapped Keras
model is re-built with `keras.models.clone_model(..., call_function=...)`
(the public hook for intervening in each layer call of a functional model),
sharing its layers and variables. Every layer with trainable variables and a
registered rule is called through a `TappedLayer`, which computes the layer's
output from its variables in explicit pieces ("sites": a kernel product, a
bias, a gain, a normalization's scale and offset), and returns, beside the
output, each site's inputs and output. The re-built model therefore returns
the logits and every site's tensors; `tape.gradient` of the summed loss with
respect to the site outputs gives the output gradients. Nested functional
and Sequential models are inlined (`_inline_nested`), unless called with a
mask or an explicit `training`. A layer without a rule (or an instance its
rule cannot handle, e.g. a LoRA kernel) is called unchanged and its variables
keep the vectorized per-example gradients of `tfdp.dp.clipping`; the log says
so once.

Which variables may use a site. A site's norms and weighted sum see only
the gradient that flows through that site. So a variable keeps its site only
if (1) no other site holds it (a shared layer falls back) and (2) the
gradient of the logits reaches it through no other path: a layer without a
rule that calls a tapped layer, a `Lambda` or a Keras op that reads
`layer.kernel` (weight tying), a subclassed model sharing a layer. (2) is
checked on the tapped model's own graph, with the sites cut, not by listing
cases (`GhostClipping._sole_uses`); every other variable falls back, and
`clipping="auto"` then takes the vectorized path for the whole model.

Rules (`tfdp.training.ghost_taps`, one module per layer family; `register`):
Dense, Conv2D (also grouped), WSConv2D, ScaledWSConv2D,
DepthwiseConv2D, ConvNeXt's LayerScale, EinsumDense, Embedding, GroupNormalization,
LayerNormalization, NFResBlock and MultiHeadAttention (whose rules replay
their `call` with every sub-layer tapped). A layer without trainable
variables (a frozen BatchNormalization, a pooling) is called unchanged: it
costs only the backward pass through it. A rule matches its exact class only: a
subclass may change the forward pass, so it needs a rule of its own.
"""

import dataclasses
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf
from absl import logging

from tfdp.dp import clipping
from tfdp.dp import ghost_norms
from tfdp.dp import precision
from tfdp.training import ghost_taps  # noqa: F401  (registers the tap rules)
from tfdp.training.ghost_taps import register  # noqa: F401  (the public decorator)


class UnsupportedModel(ValueError):
    """The model's layer graph cannot be re-built (e.g. a subclassed model)."""


@dataclasses.dataclass(frozen=True)
class Site:
    """One place where trainable variables enter the forward pass.

    Attributes:
      variables: the variables; their gradient flows only through `forward`.
      forward: `(*inputs) -> output`, the site's computation.
      norms: `(inputs, output, output_grad, num_views) -> (squares, weighted_sum)`:
        the per-example squared gradient norm of `variables`, float32
        `[batch]`, an upper bound on the squared norm of what `weighted_sum` adds
        per unit factor (`tfdp.dp.ghost_norms.forms`, "Rounding"), and
        `weighted_sum(factors) -> [sum_i factors[i] * gradient_i]` (float32,
        aligned with `variables`).
      num_inputs: how many input tensors `forward` takes.
      layer_name: for messages.
    """

    variables: Tuple[Any, ...]
    forward: Callable[..., tf.Tensor]
    norms: Callable[..., Any]
    num_inputs: int
    layer_name: str


class _Backward:
    """One `clipped_sum` call's sites, whose norms the backward pass computes.

    Every site's output passes through an identity whose gradient function
    computes the site's norms from its inputs and output gradient, keeps
    them here, and passes the gradient on only once they are computed. So
    the backward pass cannot run ahead of the norms: a layer's output
    gradient and activations are used as soon as they exist and are then
    freed (or kept only as the site's weighted sum needs), instead of piling
    up while the norms of later layers are computed.
    """

    def __init__(self, num_views):
        self.num_views = num_views
        self.outputs: List[tf.Tensor] = []  # every site's output, in creation order
        self.results: List[Optional[tuple]] = []  # (output_grad, (squares, weighted_sum))

    def tap(self, spec, inputs, output):
        index = len(self.outputs)
        self.outputs.append(output)
        self.results.append(None)

        @tf.custom_gradient
        def identity(z):
            def grad(dz):
                # Without the dependency TensorFlow would build the norms' patches as
                # soon as the activations exist, in the forward pass, and hold all of
                # them (150 MB per WRN-16-4 stage-1 conv at B = 64).
                with tf.control_dependencies([dz]):
                    computed = spec.norms(inputs, z, dz, self.num_views)
                self.results[index] = (dz, computed)
                with tf.control_dependencies([computed[0]]):
                    return tf.identity(dz)

            return tf.identity(z), grad

        return identity(output)

    def result(self, index, spec, inputs):
        """`(output_grad, (squares, weighted_sum))` of site `index`."""
        if self.results[index] is None:  # the loss does not depend on this site
            grad = tf.zeros_like(self.outputs[index])
            return grad, spec.norms(inputs, self.outputs[index], grad, self.num_views)
        return self.results[index]


class _Recorder:
    """Collects the sites of one tapped call and the layers left to the fallback.

    With `cut`, every site's forward pass reads its variables through
    `tf.stop_gradient` (a `keras.StatelessScope`), so that no gradient reaches
    them through a site: `GhostClipping._sole_uses` then sees only
    the other uses.
    """

    def __init__(self, backward=None, cut=False):
        self.sites: List[Tuple[Site, List[tf.Tensor], tf.Tensor]] = []
        self.uncovered: List[Tuple[str, str]] = []
        self.backward = backward
        self.cut = cut

    def call(self, layer, inputs, **options):
        """Calls `layer` on `inputs`, through its rule if it has trainable variables.

        `options` are call arguments that the layer's rule takes
        (`call_options`, e.g. MultiHeadAttention's `use_causal_mask`); the
        layer gets them too when it is called unchanged.
        """
        if not layer.trainable_variables:
            return layer(inputs, **options)
        rule = ghost_norms.find_layer_rule(layer)
        if rule is None:
            self.uncovered.append((layer.name, f"no rule for {type(layer).__name__}"))
            return layer(inputs, **options)
        try:
            return rule(layer, inputs, self, **options)
        except ghost_norms.UnsupportedLayer as reason:
            self.uncovered.append((layer.name, str(reason)))
            if isinstance(inputs, list) and getattr(rule, "takes_several_inputs", False):
                return layer(*inputs, **options)  # the positional arguments of `_call_layer`
            return layer(inputs, **options)

    def site(self, layer, variables, inputs, forward, norms, *, listed=False):
        """Runs `forward(*inputs)`, records it as a site, and returns its output.

        `norms` returns a `tfdp.dp.ghost_norms` rule's `(squares, weighted_sum)`
        for one variable; with `listed`, `weighted_sum` returns a list, one
        sum per variable (see `Site`), for any number of variables.
        """
        if self.cut:
            with keras.StatelessScope(
                    state_mapping=[(v, tf.stop_gradient(v.value)) for v in variables]):
                output = forward(*inputs)
        else:
            output = forward(*inputs)
        if not listed:
            if len(variables) != 1:  # a rule's bug, not an unsupported layer
                raise ValueError(f"{layer.name}: a site of {len(variables)} variables needs "
                                 "listed=True (a weighted_sum that returns one sum each).")
            norms = _as_list(norms)
        spec = Site(tuple(variables), forward, norms, len(inputs), layer.name)
        self.sites.append((spec, list(inputs), output))
        if self.backward is not None:
            return self.backward.tap(spec, list(inputs), output)
        return output


def _as_list(norms):
    """Makes a one-variable rule's `weighted_sum` return a list."""

    def wrapped(*args):
        squares, weighted_sum = norms(*args)
        return squares, lambda factors: [weighted_sum(factors)]

    return wrapped


class _Record:
    """The site specs and fallback layers of a TappedLayer's latest call (not tracked)."""

    def __init__(self):
        self.sites: List[Site] = []
        self.uncovered: List[Tuple[str, str]] = []


class TappedLayer(keras.layers.Layer):
    """Calls one layer through its rule; returns `[output, *site inputs and outputs]`.

    `options`: the layer call's arguments that its rule takes (`call_options`),
    fixed when the functional graph was built (e.g. `use_causal_mask=True`).
    """

    def __init__(self, layer, context, options=None, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer
        self.options = dict(options or {})
        self.record = _Record()
        self.context = context  # threading.local: `.backward` of the current clipped_sum

    def call(self, inputs):
        recorder = _Recorder(getattr(self.context, "backward", None),
                             cut=getattr(self.context, "cut", False))
        output = recorder.call(self.layer, inputs, **self.options)
        self.record.sites = [spec for spec, _, _ in recorder.sites]
        self.record.uncovered = recorder.uncovered
        return [output] + [t for _, site_inputs, out in recorder.sites for t in (*site_inputs, out)]


# -- The tapped model and the clipped sum -------------------------------------


class GhostClipping:
    """The clipped gradient sum of a batch from ghost norms (see the module doc).

    Built once per DPModel (in `compile`); not a Keras object, so it adds
    nothing to checkpoints or saved models.

    Args:
      model: the functional (or sequential) `keras.Model` that DPModel wraps.
      variables: the variables to clip and sum, in the order of the returned sums.

    Raises:
      UnsupportedModel: if the model's layer graph cannot be re-built (a
        subclassed model, several inputs); every variable would fall back.
    """

    def __init__(self, model, variables: Sequence[Any]):
        self.variables = list(variables)
        self.input_rank = len(_single_input(model).shape)
        inputs = keras.Input(batch_shape=_single_input(model).shape, dtype="float32")
        self._context = threading.local()  # per replica thread
        self._tapped: List[Tuple[TappedLayer, list]] = []
        self._uncovered: List[Tuple[str, str]] = []
        logits = self._inline(model, inputs)
        site_tensors = [t for _, outputs in self._tapped for t in outputs[1:]]
        self.tapped_model = keras.Model(inputs, [logits, *site_tensors],
                                        name=f"{model.name}_tapped")
        self.sites = [site for layer, _ in self._tapped for site in layer.record.sites]
        for layer, _ in self._tapped:
            self._uncovered += layer.record.uncovered
        self._keep = self._unshared_sites()
        self._keep = self._sole_uses(self._keep)
        covered = {id(v) for site, keep in zip(self.sites, self._keep) if keep
                   for v in site.variables}
        self.fallback_variables = [v for v in self.variables if id(v) not in covered]

    @property
    def uncovered_layers(self) -> List[Tuple[str, str]]:
        """(layer name, reason) of every layer whose variables use the fallback."""
        return list(self._uncovered)

    def _unshared_sites(self):
        """Sites whose variables occur in no other site (a shared layer falls back)."""
        wanted = {id(v) for v in self.variables}
        count = {}
        for site in self.sites:
            for v in site.variables:
                count[id(v)] = count.get(id(v), 0) + 1
        keep = []
        for site in self.sites:
            alone = all(count[id(v)] == 1 and id(v) in wanted for v in site.variables)
            if not alone:
                self._uncovered.append((site.layer_name, "variables used at several places"))
            keep.append(alone)
        return keep

    def _sole_uses(self, keep):
        """`keep`, without the sites whose variables the loss also reaches elsewhere.

        A kept site's variables must get their whole gradient through the
        site: the norms and the weighted sum see nothing else. Rather than
        enumerate the ways a variable can be used elsewhere (a layer without
        a rule that calls a tapped layer or reads its kernel, a `Lambda` or a
        Keras op on `layer.kernel` (weight tying), a subclassed model that
        shares a layer, ...), this checks the property itself, on the graph
        that `clipped_sum` differentiates: the tapped model is traced once
        (in a `tf.function`, not run; in each replica's context under a
        tf.distribute strategy) with every site's forward pass reading
        its variables through `tf.stop_gradient`, and `tape.gradient` of the
        logits is taken with respect to the kept variables. The tape records
        every differentiable read of a trainable variable, wherever it
        happens, so a gradient that is not None is a path from the variable
        to the logits outside every site, and that site falls back. The check
        is structural (None or not), not numerical: a path whose gradient
        happens to be zero at some input still counts. It errs only on the
        safe side: a read the cut misses (a site reading `variable.handle`
        directly) makes its site fall back.
        """
        kept = [v for site, k in zip(self.sites, keep) if k for v in site.variables]
        if not kept:
            return keep
        connected = []

        def replica(images):  # the context is per replica thread
            self._context.cut = True
            try:
                with tf.GradientTape() as tape:
                    logits = tf.nest.flatten(self.tapped_model(images, training=True))[0]
            finally:
                self._context.cut = False
            grads = tape.gradient(logits, kept)
            connected.extend(id(v) for v, g in zip(kept, grads) if g is not None)
            return logits

        def trace(images):
            if tf.distribute.in_cross_replica_context():  # compile() under strategy.scope()
                return tf.distribute.get_strategy().run(replica, (images,))
            return replica(images)

        spec = tf.TensorSpec(self.tapped_model.inputs[0].shape, tf.float32)
        tf.function(trace, autograph=False).get_concrete_function(spec)
        elsewhere = set(connected)
        result = []
        for site, k in zip(self.sites, keep):
            if k and any(id(v) in elsewhere for v in site.variables):
                self._uncovered.append((site.layer_name, "variables also used where no rule "
                                        "taps them (a layer without a rule, a Lambda or an op)"))
                k = False
            result.append(k)
        return result

    def _inline(self, model, inputs):
        """Calls `model`'s layers on `inputs` one by one, through `_call_layer`."""
        if isinstance(model, keras.Sequential):
            for layer in model.layers:
                inputs = self._call_layer(layer, inputs)
            return inputs
        try:  # clone_model re-runs a functional model's graph; it rejects other models
            clone = keras.models.clone_model(model, input_tensors=inputs,
                                             clone_function=lambda layer: layer,
                                             call_function=self._call_layer)
        except ValueError as error:
            raise UnsupportedModel(
                f"the layer calls of {model.name} ({type(model).__name__}) cannot be "
                f"tapped: {error}") from error
        return clone.output

    def _inline_nested(self, model, inputs):
        """`_inline` for a model nested in another: its tapped layers' tensors reach the top.

        clone_model builds a new Functional from its result, which on inputs
        that are not a `keras.Input` clones the graph, so the nested model is
        inlined on an Input of its own, and the resulting model, returning its
        output and its tapped layers' tensors, is called on `inputs`.
        """
        start, uncovered = len(self._tapped), len(self._uncovered)
        inner_inputs = keras.Input(batch_shape=inputs.shape, dtype=inputs.dtype)
        try:
            output = self._inline(model, inner_inputs)
        except UnsupportedModel:
            del self._tapped[start:], self._uncovered[uncovered:]
            raise
        tapped = self._tapped[start:]
        inlined = keras.Model(inner_inputs, [output] + [t for _, outs in tapped for t in outs],
                              name=f"{model.name}_inlined")
        flat = tf.nest.flatten(inlined(inputs))
        position = 1
        for index, (layer, outs) in enumerate(tapped, start):
            self._tapped[index] = (layer, flat[position:position + len(outs)])
            position += len(outs)
        return flat[0]

    def _call_layer(self, layer, *args, **kwargs):
        """clone_model's call_function: taps every layer that has trainable variables.

        `layer` may also be a Keras op of the functional graph (`inputs / 255`),
        which has no variables of its own (it may read some: `_sole_uses`).
        clone_model calls a nested model with `mask=None`; it is inlined
        unless it gets a mask or an explicit `training` (which its layers
        would then have to see).
        """
        rule = ghost_norms.find_layer_rule(layer)
        several = getattr(rule, "takes_several_inputs", False)
        options = {k: kwargs[k] for k in getattr(rule, "call_options", ()) if k in kwargs}
        # A Keras mask carried by an input (a Masking layer upstream) is read inside the
        # layer's call (MultiHeadAttention); a TappedLayer would drop it: call it unchanged.
        # (`_keras_mask` is where Keras' masking guide documents a tensor's mask; Keras 3
        # exports no getter.)
        masked = any(getattr(a, "_keras_mask", None) is not None for a in args)
        plain = (len(args) == 1 or (several and len(args) <= 3)) and kwargs.get(
            "mask") is None and set(kwargs) <= {"mask", "training", *options} and not masked
        if (isinstance(layer, keras.Model) and plain and kwargs.get("training") is None
                and len(getattr(layer, "outputs", None) or ()) == 1):
            try:
                return self._inline_nested(layer, args[0])
            except UnsupportedModel:
                pass  # a subclassed model: one layer without a rule
        if not getattr(layer, "trainable_variables", None):
            return layer(*args, **kwargs)
        if ghost_norms.find_layer_rule(layer) is None or not plain:
            reason = (f"no rule for {type(layer).__name__}" if ghost_norms.find_layer_rule(
                layer) is None else "called with a mask, keyword arguments or several inputs")
            self._uncovered.append((layer.name, reason))
            return layer(*args, **kwargs)
        tapped = TappedLayer(layer, self._context, options,
                             name=f"tapped_{len(self._tapped)}_{layer.name}")
        outputs = tapped(args[0] if len(args) == 1 else list(args))
        self._tapped.append((tapped, outputs))
        return outputs[0]

    def clipped_sum(self, images, labels, mask, *, l2_clip_norm, normalize, loss_fn,
                    example_loss_fn):
        """Clipped gradient sum of one batch (or chunk), and what the metrics need.

        Args:
          images: `[batch, H, W, C]` or `[batch, K, H, W, C]` (K augmult views),
            float32 or uint8.
          labels: int `[batch]`.
          mask: float32 `[batch]`, 0 for padding rows (they contribute nothing).
          l2_clip_norm: C.
          normalize: divide each clipped contribution by C (De et al. 2022, eq. (3)).
          loss_fn: `(labels [n], logits [n, classes]) -> float32 [n]` per-row losses.
          example_loss_fn: DPModel's per-example loss, for the fallback variables.

        Returns:
          `(summed, norms, clipped, losses, logits)`: `summed[i]` float32 of
          `variables[i]`'s shape; `norms` float32 `[batch]` pre-clip
          per-example norms; `clipped` float32 `[batch]` 1 where scaled down
          (masked rows 0); `losses` float32 `[batch]` (mean over views);
          `logits` float32 `[batch, classes]` (mean over views).
        """
        num_views = 1
        views = tf.cast(images, tf.float32)
        if images.shape.rank == self.input_rank + 1:
            num_views = images.shape[1]
            views = tf.reshape(views, [-1, *images.shape[2:]])
        backward = _Backward(num_views)
        self._context.backward = backward
        try:
            with tf.GradientTape() as tape:
                # A list even without sites (a one-output model returns a tensor).
                outputs = tf.nest.flatten(self.tapped_model(views, training=True))
                logits = outputs[0]
                losses = tf.reduce_mean(tf.reshape(
                    loss_fn(tf.repeat(tf.cast(labels, tf.int32), num_views), logits),
                    [-1, num_views]), axis=1)
                total = tf.reduce_sum(losses)
        finally:
            self._context.backward = None
        # The backward pass; its gradient functions compute every site's norms.
        tape.gradient(total, backward.outputs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        sites, computed = [], []
        for index, (site, inputs, keep) in enumerate(self._sites_with_inputs(outputs[1:])):
            if keep:
                _, result = backward.result(index, site, inputs)
                sites.append((site, inputs, None))
                computed.append(result)
        # Every rule's squares bound the squared norm of what its weighted sum adds for the
        # example, per unit factor, in float32 (tfdp.dp.ghost_norms.forms, "Rounding"). Their sum
        # and root are rounded up here, so that factor * (vector added) <= C (1 + u) for
        # factor = fl(C / norm): the contribution is at most C (1 + 1e-6) on every device.
        squares = [tf.maximum(sq, 0.0) for sq, _ in computed]
        fallback = []
        if self.fallback_variables:
            fallback, _ = clipping.per_example_gradients(
                example_loss_fn, self.fallback_variables, (images, labels))
            squares.append(tf.add_n([ghost_norms.held_squares(g) for g in fallback]))
        total = precision.upper(tf.add_n(squares), precision.gamma(len(squares) + 1))
        # Squares that underflowed (norms below 2^-63) may have come out 0: the floor keeps
        # the total an upper bound (tfdp.dp.precision, "Range").
        total = tf.maximum(total, precision.NORM_FLOOR**2)
        norms = precision.upper(tf.sqrt(total), 8 * precision.UNIT_ROUNDOFF)
        mask = tf.cast(mask, norms.dtype)
        factors = clipping.clip_factors(norms, l2_clip_norm, normalize=normalize) * mask
        clipped = tf.cast(norms > precision.margined_clip_norm(l2_clip_norm),
                          tf.float32) * tf.cast(mask, tf.float32)
        summed = {}
        for v, g in zip(self.fallback_variables, fallback):
            summed[id(v)] = clipping.weighted_sum(tf.cast(factors, tf.float32), g)
        for (site, _, _), (_, weighted_sum) in zip(sites, computed):
            for v, s in zip(site.variables, weighted_sum(factors)):
                summed[id(v)] = s
        mean_logits = tf.reduce_mean(tf.reshape(logits, [-1, num_views, logits.shape[-1]]), 1)
        return [summed[id(v)] for v in self.variables], norms, clipped, losses, mean_logits

    def _sites_with_inputs(self, tensors):
        """(site, inputs, keep) of every site, from the tapped model's flat outputs."""
        position = 0
        for site, keep in zip(self.sites, self._keep):
            yield site, list(tensors[position:position + site.num_inputs]), keep
            position += site.num_inputs + 1


def _single_input(model):
    inputs = getattr(model, "inputs", None)
    if not inputs or len(inputs) != 1:
        raise UnsupportedModel(f"{model.name} must have exactly one input to be tapped.")
    return inputs[0]


def log_plan(ghost):
    """Logs once which variables keep the vectorized per-example path, and why."""
    if ghost.fallback_variables:
        logging.warning(
            "Ghost clipping: %d of %d variables keep tf.vectorized_map per-example "
            "gradients (layers: %s).", len(ghost.fallback_variables), len(ghost.variables),
            "; ".join(f"{name} ({reason})" for name, reason in ghost.uncovered_layers))
    else:
        logging.info("Ghost clipping: per-example norms of all %d variables from layer rules.",
                     len(ghost.variables))
