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
