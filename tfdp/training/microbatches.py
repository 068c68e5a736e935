"""Microbatches: each microbatch's gradient MEAN is clipped, not each example's gradient.

`DPModel` with `mechanism.num_microbatches` = M (TF Privacy's semantics):
each example joins microbatch j ~ Uniform{0..M-1} (`DPModel.draw_microbatch_ids`,
from the secret noise generator); a chunk adds its per-microbatch gradient
sums and counts (`chunk_sums`); after all chunks, and an all-reduce over the
replicas, each microbatch's mean is clipped and the clipped means are summed
(`clipped_means`). Adding or removing one example moves one mean by at most
2C: the mechanism's sensitivity. Design: docs/design/dp_step.md, "Replicas,
microbatches and the EMA"; How to DP-fy ML (Ponomareva et al. 2023), Sec. 5.6,
Algorithm 3.
"""

import tensorflow as tf

from tfdp.dp import clipping
from tfdp.training.chunked import expand, hits, masked


def chunk_sums(dp_model, images, labels, mask, ids):
    """One chunk's per-microbatch gradient sums and counts, and its metric sums.

    Args:
      dp_model: the `tfdp.training.DPModel` (its loss, variables and path).
      images: `[n, ...]` one chunk (one view or K views); labels: int `[n]`.
      mask: float32 `[n]` of 0 (padding) and 1.
      ids: int32 `[n]`, each example's microbatch in [0, M).

    Returns:
      `(sums, counts, stats)`: `sums[i]` float32 `[M, *trainable_variables[i].shape]`,
      `counts` float32 `[M]` (real examples per microbatch), `stats` the sums
      of loss, correct predictions and real examples (scalars).
    """
    grads, (losses, logits) = clipping.per_example_gradients(
        dp_model._example_loss, dp_model.trainable_variables, (images, labels),
        method=dp_model._per_example_method)
    m = dp_model.mechanism.num_microbatches
    sums = [tf.math.unsorted_segment_sum(masked(g, mask), ids, m) for g in grads]
    counts = tf.math.unsorted_segment_sum(mask, ids, m)
    stats = (tf.reduce_sum(masked(losses, mask)),
             tf.reduce_sum(masked(hits(logits, labels), mask)), tf.reduce_sum(mask))
    return sums, counts, stats


def clipped_means(dp_model, sums, counts, metric_sums):
    """Replica context: the clipped sum of microbatch means, microbatches global over
    chunks and replicas; returns `(summed, stats)` as `DPModel.clip_and_accumulate`."""
    loss_sum, correct, examples = metric_sums
    num_replicas = dp_model.distribute_strategy.num_replicas_in_sync
    if num_replicas > 1:  # microbatches span replicas: sum them before clipping
        sums, counts = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, (sums, counts))
    means = [s / expand(tf.maximum(counts, 1.0), s) for s in sums]
    units = tf.cast(counts > 0, tf.float32)
    summed, norms, clipped = clipping.clipped_sum(
        means, dp_model.mechanism.l2_clip_norm, normalize=dp_model.mechanism.normalize_update,
        mask=units,
    )
    # Every replica now holds the whole clipped sum; Keras SUMs the replicas.
    summed = [s / num_replicas for s in summed]
    stats = (loss_sum, correct, tf.reduce_sum(norms * units), tf.reduce_sum(clipped),
             examples, tf.reduce_sum(units))
    return summed, stats

