"""The path a chunk's per-example clipping takes, and where it leaves the fast one.

DPModel computes a chunk's clipped contributions on the ghost or vectorized
path, chosen at `compile` (`plan_clipping`). Two conditions send examples
elsewhere:
  - `checked`: with oneDNN on, a graph holding a batch matmul that
    TensorFlow 2.21's oneDNN kernel computes wrongly runs one example at a
    time instead (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`);
  - `alone_where_not_finite`: on the ghost path, an example whose norm is
    not finite is recomputed on its own.
Design: docs/design/dp_step.md.
"""

import traceback

import tensorflow as tf
from absl import logging

from tfdp import graph_checks
from tfdp import host
from tfdp import models
from tfdp.dp import clipping
from tfdp.dp import compiler_checks
from tfdp.training import ghost_clipping


def plan_clipping(dp_model):
    """The `GhostClipping` that `dp_model.clipping` asks for, or None for the vectorized path.

    "vectorized" is always None. "ghost" and "auto" are None too where ghost
    norms cannot give the clipped sum: microbatches (they clip gradient
    means), user-defined gradients (`tfdp.models.user_defined_gradients`: a
    backward pass may trade gradient between rows), or a model
    `GhostClipping` cannot take. "auto" is also None where some trainable
    layer has no ghost-norm rule; "ghost" keeps the vectorized path for
    those layers' variables only. Each fallback is logged.

    Args:
      dp_model: a `tfdp.training.DPModel` being compiled.

    Returns:
      A `tfdp.training.GhostClipping` over `dp_model.trainable_variables`, or None.
    """
    mechanism, choice = dp_model.mechanism, dp_model.clipping
    if choice == "vectorized":
        return None
    if mechanism.num_microbatches:
        # Microbatches clip means of per-example gradients, which ghost norms do not give.
        (logging.warning if choice == "ghost" else logging.info)(
            "Microbatches (num_microbatches=%d) clip gradient means, not per-example "
            "gradients: clipping=%r uses the vectorized path.",
            mechanism.num_microbatches, choice)
        return None
    custom = (models.user_defined_gradients(dp_model.model)
              if models.input_example_shape(dp_model.model) is not None else [])
    if custom:
        # Ghost norms take each row's output gradient as its example's own; a user's
        # backward pass may trade gradient between rows unseen by the mixing probe.
        logging.warning(
            "Ghost clipping is not possible: the model has user-defined gradients (%s), "
            "which may mix examples in the backward pass where no probe can see it; every "
            "variable keeps tf.vectorized_map per-example gradients (each example's "
            "backward pass runs alone).", ", ".join(custom[:3]))
        return None
    try:
        ghost = ghost_clipping.GhostClipping(dp_model.model, dp_model.trainable_variables)
    except ghost_clipping.UnsupportedModel as error:
        logging.warning("Ghost clipping is not possible (%s); every variable keeps "
                        "tf.vectorized_map per-example gradients.", error)
        return None
    if choice == "auto" and ghost.fallback_variables:
        logging.warning(
            "clipping='auto': layers without a ghost-norm rule (%s), so the whole model "
            "uses tf.vectorized_map per-example gradients; clipping='ghost' would keep "
            "them only for those layers.",
            "; ".join(f"{name}: {why}" for name, why in ghost.uncovered_layers))
        return None
    ghost_clipping.log_plan(ghost)
    return ghost


def checked(dp_model, contribution_fn, tensors):
    """`contribution_fn(*tensors)` of `dp_model` (a DPModel), on a path oneDNN computes right.

    TensorFlow 2.21's oneDNN batch matmul computes a rank-4 matmul that
    broadcasts one operand wrongly, or corrupts the heap
    (`tfdp.graph_checks.BROADCAST_MATMUL_BUG`): one example's
    "gradient" could then be anything, and the clip would bound nothing.
    `tf.vectorized_map` makes that op of any matmul on a rank-3
    activation (a Dense or EinsumDense on `[batch, T, C]`, in layers at
    any depth, user layers included), and a model can make it itself.
    So the check reads the ops that will run, not the layers: with oneDNN
    on, the chunk's contribution is traced as a function of its own, its
    graph (nested functions included) is searched for such a matmul
    (`graph_checks.broadcast_batch_matmuls`), and only a graph without
    one is called. If the ghost or vectorized path has one, the
    per-example gradients are computed one example at a time instead
    (`clipping.per_example_gradients(method="loop")`, whose ops keep the
    shapes of a batch of one), with a warning, and that graph is checked
    the same way; so are they where `tf.vectorized_map` cannot convert the
    chosen path's graph (a ValueError raised in its conversion).

    It is also where a model that did not state its input shape at
    `compile` (a subclassed model) is checked for mixing examples, on the
    shape of the first batch traced (`models.refuse_example_mixing`, run
    eagerly from the trace).

    Raises:
      ValueError: if even the loop's graph has such a matmul (the model
        makes one itself); the message names the ops and the way out.
      tfdp.models.ExampleMixingError: a model that mixes examples.
    """
    if not dp_model._mixing_checked:
        images = tensors[0]
        example = images.shape[2:] if images.shape.rank == dp_model._input_rank + 1 else (
            images.shape[1:])
        with tf.init_scope():  # eagerly, out of the train function's trace
            models.refuse_example_mixing(dp_model.model, tuple(example))
        dp_model._mixing_checked = True
    if not matmuls_run_on_onednn(dp_model.distribute_strategy):
        return contribution_fn(*tensors)
    specs = [tf.TensorSpec.from_tensor(t) for t in tensors]
    while True:
        try:
            concrete = tf.function(lambda *args: contribution_fn(*args),
                                   autograph=False).get_concrete_function(*specs)
        except ValueError as error:
            if dp_model._loop or not _raised_by_vectorization(error):
                raise
            # tf.vectorized_map cannot convert some graphs (a grouped Conv2D before an
            # attention mask computed from the input: "Dimension 1 in both shapes must
            # be equal"; found by the DP-model fuzzer); one example at a time can.
            logging.warning(
                "Per-example clipping: tf.vectorized_map cannot convert the %s path (%s); "
                "computing per-example gradients one example at a time instead (slower).",
                dp_model.clipping_path, str(error).strip().splitlines()[-1][:300])
            dp_model._loop = True
            continue
        risky = graph_checks.broadcast_batch_matmuls(graph_checks.graph_nodes(concrete))
        if risky and specs[0].shape[0] is None:
            risky = _risky_at_a_known_batch_size(contribution_fn, specs)
        if not risky:
            return concrete(*tensors)
        ops = "; ".join(node.describe() for node in risky[:4]) + (
            f" and {len(risky) - 4} more" if len(risky) > 4 else "")
        if dp_model._loop:
            raise ValueError(
                f"{dp_model.model.name}'s per-example gradients need a batch matmul that "
                f"TensorFlow 2.21 computes wrongly with oneDNN on, even one example at a "
                f"time: {ops}. {graph_checks.BROADCAST_MATMUL_BUG} Make the model's "
                "matmuls rank 3 (reshape to [batch, T, C] before a Dense or tf.matmul), "
                "or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported (slower: "
                "docs/design/dp_step.md, 'oneDNN on, on every host').")
        logging.warning(
            "Per-example clipping: the %s path would run %d batch matmul(s) that "
            "TensorFlow 2.21's oneDNN kernel computes wrongly (%s); computing per-example "
            "gradients one example at a time instead (slower; TF_ENABLE_ONEDNN_OPTS=0 "
            "avoids the bug).", dp_model.clipping_path, len(risky), ops)
        dp_model._loop = True


def matmuls_run_on_onednn(strategy):
    """Whether this step's matmuls may run on TensorFlow's oneDNN CPU kernels.

    No if oneDNN is off (`host.onednn_enabled() is False`; None, unknown,
    counts as on), or if they run on an accelerator: a TPU strategy, or a
    visible GPU, where TensorFlow places them (cuBLAS), so that attention
    models keep their fast path there.
    """
    if host.onednn_enabled() is False:
        return False
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return False
    return not tf.config.list_logical_devices("GPU")


def _risky_at_a_known_batch_size(contribution_fn, specs):
    """The risky matmuls of `contribution_fn` traced at a batch of 7 (a Poisson batch's
    size is unknown when the step is traced).

    With an unknown batch size, two batch axes that both are the batch
    (`[B, heads, T, d] x [B, heads, d, T]` in attention) cannot be proven
    equal and count as broadcasting (`graph_checks`): every attention model
    would run one example at a time under `make_private`. Traced at a known
    size, such axes are equal and are not flagged, while an axis that is 1
    where the other is the batch still is; so what this trace flags is what
    may broadcast at any batch size. (7: a size that a constant of the
    model is unlikely to equal by chance.)
    """
    static = [tf.TensorSpec([7, *spec.shape[1:]], spec.dtype) for spec in specs]
    concrete = tf.function(lambda *args: contribution_fn(*args),
                           autograph=False).get_concrete_function(*static)
    return graph_checks.broadcast_batch_matmuls(graph_checks.graph_nodes(concrete))


def _raised_by_vectorization(error):
    """Whether `error` was raised while `tf.vectorized_map` converted a graph (pfor)."""
    frames = traceback.extract_tb(error.__traceback__)
    return any("parallel_for" in frame.filename for frame in frames)


def alone_where_not_finite(ghost, images, labels, mask, *, variables, example_loss,
                           l2_clip_norm, normalize):
    """The ghost path's outputs, with each real example whose norm is not finite
    recomputed alone (beside zero rows, apart from the rest of the batch).

    The ghost path runs the batch's forward and backward passes together. A mix
    of examples that finite values cannot show (`refuse_example_mixing` probes
    finite batches) can still carry one example's NaN or inf to the others:
    `0 * NaN` is NaN (a 2x2 conv with dilation 2 on 1x1 images reads only its
    zero padding, yet its backward pass multiplies the mixed NaN by 0). Their
    norms then come out non-finite and the ghost path drops them, so adding or
    removing that one example would move every other contribution (the
    DP-model fuzzer: 2.0 C). Each such example is recomputed here on its own,
    with the per-example gradient, norm and clip of `tfdp.dp.clipping` (what
    the loop path does), and added to the ghost sum of the others (where a
    non-finite example's factor is 0: dropped, `clipping.weighted_sum`). An
    example that is non-finite on its own is dropped as before. The model runs
    on the example beside as many zero rows, whose loss is not taken: a model
    that needs two rows (`t + t[1:2]`) still runs, and a mix that finite values
    cannot show carries nothing from a finite zero row. Free unless some norm
    is not finite; its cost is one example's pass per such example.
    """
    summed, norms, clipped, losses, logits = ghost
    alone = tf.logical_and(mask > 0, tf.logical_not(compiler_checks.is_finite(norms)))

    def recompute():
        # Those rows first; no tf.where, whose output shape XLA cannot compile.
        rows = tf.argsort(tf.cast(alone, tf.int32), direction="DESCENDING", stable=True)
        count = tf.reduce_sum(tf.cast(alone, tf.int32))

        def body(k, total, out_norms, out_clipped, out_losses, out_logits):
            # tf.gather, not `images[i]`: XLA would take a strided slice's data-dependent
            # start as a compile-time constant, bake the batch into the program and
            # compile it again for every batch (27 s a step for the CNN at B = 64).
            i = tf.gather(rows, k)
            example = (tf.gather(images, i), tf.gather(labels, i))
            with tf.GradientTape() as tape:
                loss, (_, logit) = example_loss(example, beside_zeros=True)
            grads = tape.gradient(loss, variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            # A batch of one: `[1, *variable.shape]` (an Embedding's IndexedSlices densified).
            grads = [tf.convert_to_tensor(g)[tf.newaxis] for g in grads]
            one, norm, was_clipped = clipping.clipped_sum(
                grads, l2_clip_norm, normalize=normalize)
            loss, logit = loss[tf.newaxis], logit[tf.newaxis]
            at = [[i]]
            return (k + 1, [a + b for a, b in zip(total, one)],
                    tf.tensor_scatter_nd_update(out_norms, at, tf.cast(norm, norms.dtype)),
                    tf.tensor_scatter_nd_update(out_clipped, at, was_clipped),
                    tf.tensor_scatter_nd_update(out_losses, at, loss),
                    tf.tensor_scatter_nd_update(out_logits, at, logit))

        # One at a time: with oneDNN on, model calls in parallel iterations corrupt memory
        # (a two-branch conv with 256 NaN rows of 512: a segfault in 2 of 3 runs, or sums
        # drifting by up to 2.7 C between calls of the same batch).
        _, *out = tf.while_loop(
            lambda k, *_: k < count, body,
            (tf.constant(0), list(summed), norms, clipped, losses, logits),
            parallel_iterations=1)
        return tuple(out)

    return tf.cond(tf.reduce_any(alone), recompute,
                   lambda: (list(summed), norms, clipped, losses, logits))
