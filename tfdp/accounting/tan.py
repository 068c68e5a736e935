"""Total Amount of Noise (TAN) of DP-SGD (Sander, Stock, Sablayrolles 2023).

TAN Def. 3.1 defines the individual signal-to-noise ratio eta and its inverse
Sigma, the Total Amount of Noise, by

    eta^2 = 1 / Sigma^2 := q^2 S / (2 sigma^2),

with q the sampling probability, S the number of steps and sigma the noise
multiplier. For sigma >= 2 the RDP epsilon of DP-SGD depends (almost) only on
eta: eq. 4 gives eps_TAN(eta) = eta^2 + 2 eta sqrt(log(1/delta)) (TAN
Sec. 3.2, Fig. 2). Below sigma ~ 0.5 epsilon blows up at constant eta: the
"privacy wall" of TAN Fig. 2. At constant eta, a run with reference batch
size B_ref and noise sigma_ref can therefore be simulated cheaply with a
smaller batch B and sigma = sigma_ref * B / B_ref at the same number of steps
(TAN Sec. 3.4); the simulated run is NOT private at the reference epsilon.

Nothing here imports TensorFlow.
"""

import math
import numbers

from tfdp.accounting import accountant as accountant_lib


def tan_eta(*, noise_multiplier: float, sampling_prob: float, num_steps: int) -> float:
    """Returns TAN's individual signal-to-noise ratio eta (TAN Def. 3.1).

    eta = q sqrt(S / 2) / sigma, i.e. eta^2 = q^2 S / (2 sigma^2).

    >>> tan_eta(noise_multiplier=2.0, sampling_prob=0.5, num_steps=8)
    0.5

    Args:
      noise_multiplier: sigma, noise std divided by l2_clip_norm
        (dimensionless), > 0.
      sampling_prob: q = batch_size / num_examples, in (0, 1].
      num_steps: S, optimizer updates (not epochs), integer >= 1.

    Returns:
      eta (float, > 0, dimensionless).

    Raises:
      ValueError: if a parameter is out of range.
    """
    accountant_lib.validate_privacy_params(
        noise_multiplier=noise_multiplier, sampling_prob=sampling_prob, num_steps=num_steps
    )
    return sampling_prob * math.sqrt(num_steps / 2) / noise_multiplier


def total_amount_of_noise(
    *, noise_multiplier: float, sampling_prob: float, num_steps: int
) -> float:
    """Returns the Total Amount of Noise Sigma = 1 / eta (TAN Def. 3.1).

    Exactly as in the paper, Sigma = sigma sqrt(2) / (q sqrt(S)) (the factor
    sqrt(2) is part of TAN's definition, not a convention of this library).

    >>> total_amount_of_noise(noise_multiplier=2.0, sampling_prob=0.5,
    ...                       num_steps=8)
    2.0

    Args:
      noise_multiplier: sigma, noise std divided by l2_clip_norm
        (dimensionless), > 0.
      sampling_prob: q = batch_size / num_examples, in (0, 1].
      num_steps: S, optimizer updates (not epochs), integer >= 1.

    Returns:
      Sigma (float, > 0, dimensionless).

    Raises:
      ValueError: if a parameter is out of range.
    """
    return 1.0 / tan_eta(
        noise_multiplier=noise_multiplier, sampling_prob=sampling_prob, num_steps=num_steps
    )


def tan_epsilon(eta: float, delta: float) -> float:
    """Returns eps_TAN = eta^2 + 2 eta sqrt(log(1/delta)) (TAN eq. 4).

    It approximates the RDP epsilon of DP-SGD when sigma >= 2 (TAN Sec. 3.2);
    for smaller sigma the real epsilon is larger (TAN Fig. 2, privacy wall).

    >>> round(tan_epsilon(1.0, math.exp(-4)), 12)  # 1 + 2 * 1 * sqrt(4)
    5.0

    Args:
      eta: TAN signal-to-noise ratio (see `tan_eta`), >= 0.
      delta: the delta of (epsilon, delta)-DP, in (0, 1).

    Returns:
      eps_TAN (float, >= 0).

    Raises:
      ValueError: if eta < 0 (or not finite) or delta is outside (0, 1).
    """
    if not (isinstance(eta, numbers.Real) and math.isfinite(eta) and eta >= 0):
        raise ValueError(
            f"eta must be a finite number >= 0, got {eta!r}; compute it with "
            f"tan_eta(noise_multiplier=..., sampling_prob=..., num_steps=...)."
        )
    accountant_lib.validate_privacy_params(delta=delta)
    return eta**2 + 2 * eta * math.sqrt(math.log(1 / delta))


def simulate(
    *, reference_batch_size: float, reference_noise_multiplier: float, batch_size: float
) -> float:
    """Returns the noise_multiplier that simulates a reference run at batch_size.

    TAN Sec. 3.4 ("Scaling at Constant TAN"): at the same number of steps S
    and the same num_examples N, sigma = sigma_ref * B / B_ref keeps the
    per-step signal-to-noise ratio eta_step = q / (sqrt(2) sigma) (and so eta
    and eps_TAN) constant, while the compute is B_ref / B times smaller. E.g.
    TAN simulates (B_ref, sigma_ref) = (16384, 2.5) on ImageNet with B = 256,
    sigma = 2.5 / 64.

    >>> simulate(reference_batch_size=16384, reference_noise_multiplier=2.5,
    ...          batch_size=256)
    0.0390625

    The simulated run is NOT private at the reference epsilon: its small sigma
    is far beyond the privacy wall (TAN Fig. 2). Use it only to tune
    hyper-parameters, then launch the reference run.

    Args:
      reference_batch_size: B_ref, expected batch size of the run to simulate,
        > 0.
      reference_noise_multiplier: sigma_ref, noise std divided by l2_clip_norm
        of the run to simulate, > 0.
      batch_size: B, expected batch size of the cheap simulation, > 0.

    Returns:
      noise_multiplier for batch_size (float, > 0).

    Raises:
      ValueError: if a batch size is not > 0, batch_size is not smaller than
        reference_batch_size (then it is not a cheaper simulation), or
        reference_noise_multiplier is not > 0.
    """
    for name, value in (("reference_batch_size", reference_batch_size), ("batch_size", batch_size)):
        if not (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value > 0
        ):
            raise ValueError(f"{name} must be a number > 0, got {value!r}.")
    if batch_size >= reference_batch_size:
        raise ValueError(
            f"batch_size={batch_size} is not smaller than reference_batch_size="
            f"{reference_batch_size}: a TAN simulation runs the reference at a SMALLER batch "
            "(Sec. 3.4) to save compute. Pick a batch_size below the reference's.")
    try:
        accountant_lib.validate_privacy_params(noise_multiplier=reference_noise_multiplier)
    except ValueError as e:
        raise ValueError(f"reference_{e}") from None
    return reference_noise_multiplier * batch_size / reference_batch_size
