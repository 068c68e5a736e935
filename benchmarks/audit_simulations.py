#!/usr/bin/env python3
"""Soundness, power, planted bugs and theory of the one-run audit, in numpy.

The numbers behind docs/design/empirical_audit.md's tables (the CI tests
in tests/accounting/audit_test.py check smaller versions of each):

  python benchmarks/audit_simulations.py   # 35 minutes on the shared 2-core machine

1. Soundness, exact: the worst case of the bound is (epsilon, delta)
   randomized response, where each guess is right with probability
   delta + (1 - delta) e^eps / (1 + e^eps); the probability that the bound
   exceeds epsilon is summed exactly over the Binomial count.
2. Soundness, simulated: repeated audits of DP-SGD with Dirac gradient
   canaries (`simulate_gradient_canary_scores`); how many exceed the claim.
3. Power: median bound / claimed epsilon, at several claimed epsilons.
4. Planted bugs: noise std halved, sensitivity 2C treated as C.
5. Theory: the Gaussian mechanism (one step, no subsampling) at the
   expected counts, against its analytic (PLD) epsilon, as m grows.

The mechanisms' epsilons are `tfdp.accounting.DPMechanism.epsilon()` (PLD),
delta = 1e-5 and beta = 0.05 throughout.
"""

import argparse
import logging
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import numpy as np  # noqa: E402
from scipy import special, stats  # noqa: E402

from tfdp import host  # noqa: E402
from tfdp.accounting import audit  # noqa: E402

DELTA = 1e-5
BETA = 0.05
FASHION = (2048 / 60000, 1172)  # q and T of fashion_mnist.gin
SETTINGS = {"full batch (q=1, T=1)": (1.0, 1), "q=0.1, T=100": (0.1, 100),
            "fashion_mnist.gin (q=0.0341, T=1172)": FASHION}
GUESSES = (0.005, 0.01, 0.02, 0.05, 0.1)


def plan(target_epsilon, sampling_prob, num_steps):
    """The mechanism with sigma calibrated (PLD) to target_epsilon at DELTA."""
    return audit.simulated_mechanism(sampling_prob=sampling_prob, num_steps=num_steps,
                                     delta=DELTA, target_epsilon=target_epsilon)


def audits(mechanism, num_canaries, repeats, rng, **bug):
    results = audit.simulate_audits(
        mechanism, num_canaries=num_canaries, repeats=repeats, rng=rng, beta=BETA,
        guesses=audit.symmetric_guesses(num_canaries, GUESSES), **bug)
    return np.array([r.epsilon_lower_bound for r in results])


def randomized_response_rate(num_guesses, epsilon, delta):
    """P[bound > epsilon] when every guess is right w.p. delta + (1 - delta) expit(eps)."""
    accuracy = delta + (1 - delta) * special.expit(epsilon)
    counts = np.arange(num_guesses + 1)
    bounds = np.array([audit.epsilon_lower_bound(num_guesses, num_guesses, int(v), delta=delta,
                                                 beta=BETA) for v in counts])
    return float(stats.binom.pmf(counts, num_guesses, accuracy)[bounds > epsilon].sum())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--num_canaries", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    rng = np.random.default_rng(args.seed)
    m = args.num_canaries

    print(host.describe_host() + "\n")
    print("## 1. Soundness, exact: (epsilon, delta) randomized response, all r = m guessed\n")
    print("| r = m | epsilon | delta | P[bound > epsilon] | beta |\n|---|---|---|---|---|")
    for r in (100, 1000):
        for eps in (0.5, 1.0, 2.0):
            for delta in (0.0, 1e-3):
                print(f"| {r} | {eps} | {delta:g} | {randomized_response_rate(r, eps, delta):.4f} "
                      f"| {BETA} |")

    print(f"\n## 2-4. DP-SGD with Dirac canaries: {args.repeats} audits of m = {m} canaries, "
          f"guessing {GUESSES} of them (Bonferroni)\n")
    print("| setting | claimed eps | sigma | correct: median bound (ratio) | max | exceed | "
          "noise halved: median (min) | exceed | 2C as C: median (min) | exceed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (q, steps) in SETTINGS.items():
        for eps in (1.0, 2.0, 3.0, 4.0, 8.0):
            mech = plan(eps, q, steps)
            claimed = mech.epsilon()
            good = audits(mech, m, args.repeats, rng)
            half = audits(mech, m, max(3, args.repeats // 10), rng, noise_scale=0.5)
            double = audits(mech, m, max(3, args.repeats // 10), rng, canary_norm=2.0)
            print(f"| {name} | {claimed:.3f} | {mech.noise_multiplier:.4g} | "
                  f"{np.median(good):.3f} ({np.median(good) / claimed:.2f}) | {good.max():.3f} | "
                  f"{int((good > claimed).sum())}/{len(good)} | {np.median(half):.3f} "
                  f"({half.min():.3f}) | {int((half > claimed).sum())}/{len(half)} | "
                  f"{np.median(double):.3f} ({double.min():.3f}) | "
                  f"{int((double > claimed).sum())}/{len(double)} |", flush=True)

    print("\n## 5. Theory: the Gaussian mechanism at the expected counts (oracle threshold)\n")
    sizes = (10**2, 10**3, 10**4, 10**5, 10**6)
    print("| analytic eps (PLD) | sigma | " + " | ".join(f"m = {s:.0e}" for s in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for eps in (1.0, 2.0, 4.0, 8.0):
        mech = plan(eps, 1.0, 1)
        claimed = mech.epsilon()
        cells = []
        for size in sizes:
            bound = audit.gaussian_audit_at_expected_counts(
                mech.noise_multiplier, size, delta=DELTA, beta=BETA, num_thresholds=60)
            cells.append(f"{bound['epsilon_lower_bound']:.3f} "
                         f"({bound['epsilon_lower_bound'] / claimed:.2f})")
        print(f"| {claimed:.3f} | {mech.noise_multiplier:.4g} | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
