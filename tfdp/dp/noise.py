"""Gaussian noise for the clipped sum: the randomness half of DP-SGD.

Pure TensorFlow. The noise for one LOGICAL batch has standard deviation exactly
`noise_multiplier * sensitivity` (`tfdp.accounting.DPMechanism.noise_stddev`,
the one place that computes both), however the batch is split across replicas
and accumulation steps. `tfdp.training.DPModel` decides where it is drawn.

Reference: Abadi et al. 2016, Algorithm 1; De et al. 2022, App. A.1, Algorithm 1
(noise is added once per logical batch, after accumulation).
"""

import math
from typing import Sequence

import tensorflow as tf

from tfdp.dp import compiler_checks


def noise_stddev_per_replica(noise_stddev: float, num_replicas: int = 1) -> float:
    """Std of each replica's independent draw so that the SUM has std `noise_stddev`.

    Keras 3 all-reduces gradients across replicas with a SUM. R independent
    Gaussian draws of std s / sqrt(R) sum to a Gaussian of std s exactly, so the
    logical batch gets exactly `noise_stddev`, for any R. (The other
    valid design, one shared draw scaled by 1/R on every replica, needs a seed
    shared across replicas; independent draws need nothing shared and are
    what `tf.random.Generator` gives each replica inside a strategy scope.)

    Args:
      noise_stddev: s >= 0, the std of the noise of one logical batch
        (`DPMechanism.noise_stddev()`: noise_multiplier * sensitivity).
      num_replicas: R >= 1, the replicas whose draws are summed.

    Returns:
      The per-replica std, a Python float.

    Raises:
      ValueError: if noise_stddev < 0 or num_replicas < 1.
    """
    if noise_stddev < 0:
        raise ValueError(f"noise_stddev must be >= 0, got {noise_stddev}.")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    return noise_stddev / math.sqrt(num_replicas)


def add_gaussian_noise(
    tensors: Sequence[tf.Tensor], *, stddev: float, generator: tf.random.Generator
) -> list[tf.Tensor]:
    """Adds i.i.d. N(0, stddev^2) to every entry of every tensor.

    Args:
      tensors: list of float32 tensors (e.g. a clipped gradient sum).
      stddev: the std per entry (see `noise_stddev_per_replica`).
      generator: the stateful generator the noise is drawn from; its state is
        checkpointed with the run so a resumed run never re-draws used noise
        for new data.

    Returns:
      A list of tensors with the shapes and dtypes of `tensors`.
    """
    return [
        t + generator.normal(tf.shape(t), stddev=stddev, dtype=t.dtype) for t in tensors
    ]


class NonFiniteRelease(FloatingPointError):
    """A noisy update had an inf or NaN entry: it was withheld, and training must stop."""


def count_non_finite(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """How many entries of `tensors` are inf or NaN: a float32 scalar, counted on the bits.

    `tfdp.dp.compiler_checks.is_finite`: exact in TensorFlow's own kernels
    whatever XLA was told (inside XLA with fast math, LLVM may fold it).

    Args:
      tensors: float32 (or float64) tensors, e.g. the noisy update.
    """
    counts = [tf.reduce_sum(tf.cast(tf.logical_not(compiler_checks.is_finite(t)), tf.float32))
              for t in tensors]
    return tf.add_n(counts) if counts else tf.constant(0.0)


def finite_release(update: Sequence[tf.Tensor], withheld: tf.Variable) -> list[tf.Tensor]:
    """The update to apply: `update`, or zeros if any replica's has an inf or NaN entry.

    Every example's clipped contribution is finite with norm <= C (a
    non-finite one is dropped: `tfdp.dp.clipping.clip_factors`), so the
    noisy sum of a logical batch is finite: this guard never fires while
    those checks hold. It is there for what they cannot see: a non-finite entry
    in a released update would show with certainty that some example's
    contribution escaped its clip, so such an update is never applied. The
    step applies zeros instead (the optimizer and the EMA then move only by
    their earlier, already released state), every later step of the same
    model applies zeros too, and `withheld` counts those steps, so that the
    caller stops training before anything else is released
    (`tfdp.training.DPModel` raises `NonFiniteRelease` after the step). Where
    the step runs under XLA with fast math this test itself can be folded:
    the check after the step, outside XLA (`DPModel`), is the one that holds.
    What a stopped run reveals beyond its earlier steps is that it stopped
    (docs/guarantee.md).

    Replica context: the count is summed over replicas
    (`ReplicaContext.all_reduce`), so that all replicas withhold together.

    Args:
      update: this replica's share of the noisy update, float32 tensors.
      withheld: an int32 scalar variable (a TPU keeps int64 poorly), 0 until a step is
        withheld (aggregation ONLY_FIRST_REPLICA under a strategy).

    Returns:
      `update`, or zeros of the same shapes.
    """
    bad = count_non_finite(update)
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        bad = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)
    stop = tf.logical_or(bad > 0, withheld > 0)
    withheld.assign_add(tf.cast(stop, tf.int32))
    return [tf.where(stop, tf.zeros_like(t), t) for t in update]
