"""Per-example gradients and L2 clipping: the sensitivity half of DP-SGD.

Pure TensorFlow functions on tensors and lists of tensors. Nothing here knows
about Keras models or optimizers; `tfdp.training.DPModel` is the one place where
these pieces meet the model, the noise and the optimizer.

Reference: Abadi et al. 2016, Algorithm 1; De et al. 2022, Sec. 2, eq. (2)-(4)
and App. A.1, Algorithm 1.
"""

from typing import Callable, Sequence

import tensorflow as tf

from tfdp.dp import compiler_checks
from tfdp.dp import precision


PER_EXAMPLE_METHODS = ("vectorized", "loop")
# How `tfdp.training.DPModel` computes the clipped sum (its `clipping` argument): "auto"
# (ghost norms when every trainable layer has a rule, else vectorized), "vectorized" or
# "ghost". The sum, and so the guarantee, is the same on every path.
CLIPPING_PATHS = ("auto", "vectorized", "ghost")


def per_example_gradients(
    example_loss_fn: Callable[..., tuple[tf.Tensor, tf.Tensor]],
    variables: Sequence[tf.Variable],
    examples,
    *,
    method: str = "vectorized",
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """Gradients of a per-example loss, one per example.

    Two methods give the same gradients:
    - "vectorized" (default): `tf.vectorized_map`, which rewrites every op of
      one example's forward and backward pass into one batched op. An op on
      `[1, ...]` becomes one on `[batch, 1, ...]`, so a matmul of a rank-3
      activation becomes a rank-4 batch matmul that broadcasts the kernel,
      the op that TensorFlow 2.21's oneDNN kernel computes wrongly
      (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`).
    - "loop": `tf.map_fn`, one example at a time (up to 10 in parallel): the
      ops keep the shapes of a batch of one, so no batch axis is added and
      nothing is broadcast over one. Slower; DPModel takes it only where
      the vectorized ops would meet that bug.

    Args:
      example_loss_fn: maps ONE example (the `examples` structure without its
        leading batch dimension) to `(loss, aux)`: `loss` a float32 scalar and
        `aux` any float32 tensor (e.g. the example's logits) returned unchanged.
        It must not mix examples (no BatchNorm): it is traced once and
        vectorized (or looped) over the batch.
      variables: the trainable variables, each of shape `var.shape`.
      examples: a nested structure of tensors, each `[batch, ...]`.
      method: "vectorized" or "loop".

    Returns:
      `(gradients, aux)`: `gradients[i]` is float32 `[batch, *variables[i].shape]`
      (zeros where a variable does not affect the loss), and `aux` is
      `[batch, *aux.shape]`.

    Raises:
      ValueError: an unknown `method`.
    """
    if method not in PER_EXAMPLE_METHODS:
        raise ValueError(f"method must be one of {PER_EXAMPLE_METHODS}, got {method!r}.")

    def one_example(example):
        with tf.GradientTape() as tape:
            loss, aux = example_loss_fn(example)
        grads = tape.gradient(
            loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        # An Embedding's gradient is IndexedSlices (repeated ids add up when densified).
        return [tf.convert_to_tensor(g) for g in grads], aux

    if method == "vectorized":
        grads, aux = tf.vectorized_map(one_example, examples)
        return list(grads), aux
    element = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype), examples)
    outputs = tf.function(one_example, autograph=False).get_concrete_function(
        element).structured_outputs
    signature = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)
    grads, aux = tf.map_fn(one_example, examples, fn_output_signature=signature)
    return list(grads), aux


def global_l2_norms(gradients: Sequence[tf.Tensor]) -> tf.Tensor:
    """Per-example L2 norm over all variables, never below the exact one.

    A float32 sum of n squares can come out below the exact sum by up to
    gamma(chain) of it (Higham 2002, Sec. 3.1; the chain of additions an
    entry goes through). So the squares are summed in stages of at most 32
    terms (`tfdp.dp.precision.held_squares`), rounded up by that bound and by
    the rounding of the product `factor * g` that `weighted_sum` adds, and
    the root is rounded up too: `factor * |fl(factor g)| / factor <= C (1 + u)`
    for `factor = fl(C / norm)`. The over-count is a few 1e-6 relative.

    Args:
      gradients: list of float32 `[batch, ...]` tensors (per-example gradients).

    Returns:
      float32 `[batch]`: an upper bound on `sqrt(sum over variables and entries of g**2)`.
    """
    # Squares below 2^-126 may flush to 0: at least NORM_FLOOR (tfdp.dp.precision, "Range").
    squares = tf.maximum(precision.held_squares(list(gradients)), precision.NORM_FLOOR**2)
    return precision.upper(tf.sqrt(tf.maximum(squares, 0.0)), 8 * precision.UNIT_ROUNDOFF)


def clip_factors(
    norms: tf.Tensor, l2_clip_norm: float, *, normalize: bool = False
) -> tf.Tensor:
    """Per-example scale that bounds each contribution's L2 norm.

    `factor = min(1, C' / norm)` with `C' = C / (1 + kappa)`, so `factor *
    norm <= C'` (Abadi et al. 2016, Algorithm 1). kappa is the device
    class's clip margin (`tfdp.dp.precision.CLIP_MARGINS`: 1e-5 on a CPU,
    1e-3 with TF32, 1e-2 with bf16 matmuls), read at trace time: it covers
    arithmetic of the device that no bound models, so that what the device
    really adds is still within C, the sensitivity the noise is calibrated
    to. With `normalize=True` the factor is further divided by C,
    the update of De et al. 2022, eq. (3): every contribution then has norm
    `<= 1` and the learning rate does not depend on C.

    Edge cases:

    | norm | factor                   |
    |------|--------------------------|
    | 0    | 1 (or 1/C); 0 * 1 is 0   |
    | inf  | 0: contribution dropped  |
    | nan  | 0: contribution dropped  |

    A non-finite gradient would otherwise poison the whole batch (and the
    noise could not hide it), so it contributes nothing.

    Args:
      norms: float `[batch]`, pre-clip per-example L2 norms (float32, or float64
        from ghost norms).
      l2_clip_norm: C > 0, the per-example L2 bound (same units as the loss
        gradient).
      normalize: divide by C as in De et al. 2022, eq. (3).

    Returns:
      `[batch]` factors of `norms`' dtype in `[0, 1]` (or `[0, 1/C]` when normalizing).
    """
    c = precision.margined_clip_norm(l2_clip_norm)
    c = tf.cast(c, norms.dtype) if isinstance(c, tf.Tensor) else tf.constant(c, norms.dtype)
    one, zero = tf.ones_like(norms), tf.zeros_like(norms)
    # divide_no_nan(c, 0) is 0, so handle a zero norm explicitly.
    factors = tf.where(norms > 0, tf.minimum(one, tf.math.divide_no_nan(c, norms)), one)
    factors = tf.where(compiler_checks.is_finite(norms), factors, zero)
    if normalize:
        factors = factors / tf.cast(l2_clip_norm, norms.dtype)
    return factors


def clipped_sum(
    gradients: Sequence[tf.Tensor],
    l2_clip_norm: float,
    *,
    normalize: bool = False,
    mask: tf.Tensor | None = None,
) -> tuple[list[tf.Tensor], tf.Tensor, tf.Tensor]:
    """Clips every example's gradient to L2 norm <= C and sums over the batch.

    The sum has sensitivity C (or 1 when `normalize`) under add-or-remove-one
    adjacency: adding or removing one example changes it by one clipped vector.

    Args:
      gradients: list of float32 `[batch, ...]` per-example gradients (for
        augmentation multiplicity these are already averaged over the K views:
        De et al. 2022, eq. (4)).
      l2_clip_norm: C > 0.
      normalize: De et al. 2022, eq. (3): divide each clipped contribution by C.
      mask: optional float32 or bool `[batch]`, 1 for real examples and 0 for
        padding. Masked slots contribute exactly zero and are not counted in
        the returned statistics.

    Returns:
      `(summed, norms, clipped)`: `summed[i]` has shape `gradients[i].shape[1:]`;
      `norms` float32 `[batch]` are the pre-clip norms; `clipped` float32
      `[batch]` is 1 where the example was scaled down (norm > C / (1 + kappa)).
    """
    norms = global_l2_norms(gradients)
    factors = clip_factors(norms, l2_clip_norm, normalize=normalize)
    clipped = tf.cast(norms > precision.margined_clip_norm(l2_clip_norm), tf.float32)
    if mask is not None:
        mask = tf.cast(mask, factors.dtype)
        factors = factors * mask
        clipped = clipped * mask
    summed = [weighted_sum(factors, g) for g in gradients]
    return summed, norms, clipped


def weighted_sum(factors: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """`sum_b factors[b] * g[b]`, where a zero factor zeroes even inf/nan rows.

    Args:
      factors: float32 `[batch]`, e.g. from `clip_factors` times a mask.
      g: float32 `[batch, ...]` per-example gradients of one variable.

    Returns:
      float32 `g.shape[1:]`.
    """
    shape = tf.concat([tf.shape(factors), tf.ones([tf.rank(g) - 1], tf.int32)], 0)
    return tf.reduce_sum(tf.math.multiply_no_nan(g, tf.reshape(factors, shape)), axis=0)
