"""The secret seeds of DP-SGD: the sampling seed and the noise generator.

Amplification by subsampling assumes the adversary does not know which steps
include an example, and the Gaussian mechanism assumes it does not know the
noise. A seed that is fixed by default, or written where an adversary can
read it, breaks both: with a known sampling seed the steps of an appended
example can be computed (the stateless sampler is prefix-stable), and the
guarantee falls to plain Gaussian composition over those steps.

So by default both are drawn from OS entropy (`os.urandom`, via `secrets`),
and the trainer keeps them only in the run's checkpoint, so that a resumed
run continues the same sample and noise streams. They never go into
operative_config.gin, metrics, TensorBoard or the export. A user may fix
either seed for debugging or reproduction; the privacy report then says that
the guarantee assumes that seed stays secret.
"""

import secrets

import numpy as np
import tensorflow as tf

# A Philox state is a 128-bit counter and a 64-bit key: three int64 words.
_PHILOX_STATE_WORDS = 3


def secret_seed() -> int:
    """A fresh 63-bit seed from OS entropy (a non-negative Python int < 2**63)."""
    return secrets.randbits(63)


def noise_generator(seed=None) -> tf.random.Generator:
    """The stateful generator DP noise is drawn from.

    Create it where its variable should live: inside a `tf.distribute`
    strategy scope, each replica then hashes its replica id into the key, so
    replicas draw independent noise (`tfdp.training.DPModel`).

    Args:
      seed: None (default) for a Philox state of 192 bits from OS entropy, or
        an int to reproduce a run (then the noise is only as secret as the
        seed).

    Returns:
      A `tf.random.Generator` (Philox).
    """
    if seed is not None:
        return tf.random.Generator.from_seed(int(seed))
    words = np.frombuffer(secrets.token_bytes(8 * _PHILOX_STATE_WORDS), dtype=np.int64)
    return tf.random.Generator.from_state(words.copy(), alg="philox")
