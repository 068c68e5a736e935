#!/usr/bin/env python3
"""Empirical privacy audit CLI: an epsilon LOWER bound from one training run.

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run"
(`tfdp.accounting.audit`, `tfdp.audit`). Subcommands (add --json to print a
JSON object as the LAST line):

  bound     the bound from counts (no TensorFlow):
              python tools/audit.py bound --num_canaries 1000 \\
                --num_guesses 100 --num_correct 75 --delta 1e-4 --beta 0.05
  simulate  audits of DP-SGD simulated in numpy with Dirac gradient canaries
            (the exact law of their scores), optionally with a planted bug:
              python tools/audit.py simulate --noise_multiplier 2 \\
                --sampling_prob 1 --steps 1 --num_canaries 20000 \\
                --delta 1e-5 --bug noise_halved
            (with --repeats N, the first audit is timed and the run refused if
            all N would take more than --max_seconds, 600 by default)
  gradient  trains a gin config with gradient canaries (white box) and
            writes the result into the run's privacy report:
              python tools/audit.py gradient --gin_file=fashion_mnist.gin \\
                --workdir=workdirs/audit_eps3 --num_canaries 5000
  input     the same with mislabelled training images (black box).

A lower bound above the claimed epsilon means, at confidence 1 - beta, that
the implementation is not as private as claimed. Bad values exit with status
2 and a one-line message on stderr.
"""

import argparse
import json
import logging
import os
import shlex
import sys
import time

# Runnable as `python tools/audit.py` from any directory, installed or not.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tfdp import host  # noqa: E402

host.enable_onednn()  # before TensorFlow's import (gradient, input), unless the user chose

import numpy as np  # noqa: E402

from tfdp import accounting  # noqa: E402
from tfdp.accounting import audit as audit_lib  # noqa: E402

BUGS = {
    "none": {},
    "noise_halved": {"noise_scale": 0.5},
    "sensitivity_doubled": {"canary_norm": 2.0},  # sensitivity 2C treated as C
}


def _emit(args, lines, payload):
    for line in lines:
        print(line)
    if args.json:
        print(json.dumps(payload))


def _guesses(args, num_canaries):
    if args.guess_fractions is None:
        return audit_lib.symmetric_guesses(num_canaries)
    return audit_lib.symmetric_guesses(num_canaries, args.guess_fractions)


def _bound(args):
    bound = audit_lib.epsilon_lower_bound(args.num_canaries, args.num_guesses,
                                          args.num_correct, delta=args.delta, beta=args.beta)
    _emit(args, [
        f"epsilon >= {bound:.4f} at {1 - args.beta:.0%} confidence and delta = {args.delta:g}: "
        f"{args.num_correct} correct of {args.num_guesses} guesses on {args.num_canaries} "
        "canaries (Steinke, Nasr & Jagielski 2023)"],
        {"epsilon_lower_bound": bound, "num_canaries": args.num_canaries,
         "num_guesses": args.num_guesses, "num_correct": args.num_correct,
         "delta": args.delta, "beta": args.beta})


def _simulate(args):
    if not args.max_seconds > 0:
        raise ValueError(f"--max_seconds must be > 0, got {args.max_seconds:g}.")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}.")
    mechanism = audit_lib.simulated_mechanism(
        sampling_prob=args.sampling_prob, num_steps=args.steps, delta=args.delta,
        noise_multiplier=args.noise_multiplier, accountant=args.accountant)
    claimed = mechanism.epsilon()
    rng = np.random.default_rng(args.seed)

    def audits(repeats):
        return audit_lib.simulate_audits(
            mechanism, num_canaries=args.num_canaries, repeats=repeats, rng=rng,
            beta=args.beta, guesses=_guesses(args, args.num_canaries), **BUGS[args.bug])

    # The first audit is timed, and the others run only if all fit in --max_seconds (the
    # same rng draws the same audits as one call would).
    start = time.monotonic()
    results = audits(1)
    first = time.monotonic() - start
    if args.repeats > 1:
        if first * args.repeats > args.max_seconds:
            fit = max(1, int(args.max_seconds / first))
            raise ValueError(
                f"{args.repeats:,} audits of {args.num_canaries:,} canaries would take about "
                f"{_duration(first * args.repeats)} (the first took {first:.2f} s); at most "
                f"{fit:,} fit in --max_seconds {args.max_seconds:g}. Use --repeats {fit:,} or "
                "fewer, or raise --max_seconds.")
        results += audits(args.repeats - 1)
    bounds = [r.epsilon_lower_bound for r in results]
    exceed = sum(b > claimed for b in bounds)
    _emit(args, [
        f"claimed epsilon = {claimed:.4f} at delta = {args.delta:g} "
        f"({args.accountant.upper()}; noise_multiplier={args.noise_multiplier:g}, "
        f"q={mechanism.sampling_prob:.4g}, steps={args.steps}); bug: {args.bug}",
        f"{args.repeats} audits with {args.num_canaries} canaries at {1 - args.beta:.0%} "
        f"confidence: lower bound min {min(bounds):.4f}, median {np.median(bounds):.4f}, "
        f"max {max(bounds):.4f} (median / claimed = {np.median(bounds) / claimed:.3f}); "
        f"{exceed} of {args.repeats} exceed the claim"],
        {"claimed_epsilon": claimed, "epsilon_lower_bounds": bounds,
         "ratio_median": float(np.median(bounds) / claimed), "num_exceeding": exceed,
         "bug": args.bug, "num_canaries": args.num_canaries, "delta": args.delta,
         "beta": args.beta, "noise_multiplier": args.noise_multiplier,
         "sampling_prob": mechanism.sampling_prob, "num_steps": args.steps,
         "results": [r.to_dict() for r in results]})


def _duration(seconds):
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            value = seconds / size
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{seconds:.3g} s"


def _gin_value(name):
    """The value bound to `name`, following a macro reference (e.g. %NUM_EXAMPLES)."""
    import gin  # pylint: disable=g-import-not-at-top

    value = gin.query_parameter(name)
    if isinstance(value, gin.config.ConfigurableReference) and str(value).startswith("%"):
        value = gin.query_parameter(str(value))
    return value


def _train(args, make_audit):
    """Parses the gin config, checks the workdir, trains with the audit hook."""
    if os.path.isdir(args.workdir) and os.listdir(args.workdir):
        raise ValueError(f"--workdir {args.workdir} is not empty: an audit draws new canaries "
                         "and needs a fresh directory.")
    from tfdp import main  # pylint: disable=g-import-not-at-top

    main.parse_config(args.gin_file, args.gin_param)
    from tfdp import experiment  # pylint: disable=g-import-not-at-top

    command = shlex.join(["python", "tools/audit.py", *args.argv])
    audit, overrides = make_audit(command)
    import gin  # pylint: disable=g-import-not-at-top

    with gin.unlock_config():
        for name, value in overrides.items():  # e.g. N with the canaries, for the accountant
            gin.bind_parameter(name, value)
    report = experiment.train_and_evaluate(workdir=args.workdir, audit=audit)
    section = report["audit"]
    _emit(args, [
        f"epsilon >= {section['epsilon_lower_bound']:.4f} at {section['confidence']:.0%} "
        f"confidence and delta = {section['delta']:.3g}, claimed epsilon "
        f"{section['claimed_epsilon']:.4f} (ratio {section['ratio']:.3f}): "
        f"{section['num_correct']} correct of {section['num_guesses']} guesses on "
        f"{section['num_canaries']} canaries ({section['canaries']})",
        "EXCEEDS THE CLAIM: the run is not as private as claimed." if
        section["exceeds_claim"] else "Below the claim, as a correct implementation gives.",
        f"report: {os.path.join(args.workdir, 'privacy_report.md')}"], section)


def _gradient(args):
    from tfdp import audit as audit_tf  # pylint: disable=g-import-not-at-top

    def make(command):
        return audit_tf.GradientCanaryAudit(
            args.num_canaries, coordinates=args.coordinates, beta=args.beta,
            guesses=_guesses(args, args.num_canaries), seed=args.seed, command=command), {}

    _train(args, make)


def _input(args):
    from tfdp import audit as audit_tf  # pylint: disable=g-import-not-at-top

    def make(command):
        if _gin_value_or_none("tfdp.DataConfig.features") is not None:
            raise ValueError("Input canaries are images; this config trains on precomputed "
                             "features. Audit a pixel config, or use gradient canaries.")
        audit = audit_tf.InputCanaryAudit(
            args.num_canaries, num_examples=int(_gin_value("tfdp.DataConfig.num_examples")),
            beta=args.beta, guesses=_guesses(args, args.num_canaries), seed=args.seed,
            command=command)
        return audit, {"tfdp.DataConfig.num_examples": audit.num_examples_with_canaries}

    _train(args, make)


def _gin_value_or_none(name):
    try:
        return _gin_value(name)
    except ValueError:
        return None


def build_parser() -> argparse.ArgumentParser:
    """Returns the argparse parser of the CLI (one subparser per command)."""
    parser = argparse.ArgumentParser(
        prog="audit.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, *, delta=True):
        if delta:
            p.add_argument("--delta", type=float, required=True,
                           help="delta of the audited claim")
        p.add_argument("--beta", type=float, default=0.05,
                       help="1 - confidence (default 0.05: 95%%)")
        p.add_argument("--json", action="store_true", help="print a JSON object as the last line")

    def guesses(p):
        p.add_argument("--guess_fractions", type=float, nargs="+", default=None,
                       help="candidate fractions of the canaries guessed (half 'in' on the top "
                            "scores, half 'out' on the bottom), fixed in advance; each is "
                            "tested at beta / count (default 0.02 0.05 0.1 0.2 0.5 1)")
        p.add_argument("--seed", type=int, default=None,
                       help="seed of the canary coins (default: OS entropy)")

    p = sub.add_parser("bound", help="the epsilon lower bound from counts")
    p.add_argument("--num_canaries", type=int, required=True, help="m")
    p.add_argument("--num_guesses", type=int, required=True, help="r (abstentions excluded)")
    p.add_argument("--num_correct", type=int, required=True, help="v")
    common(p)
    p.set_defaults(func=_bound)

    p = sub.add_parser("simulate", help="audits of simulated DP-SGD, optionally with a bug")
    p.add_argument("--noise_multiplier", type=float, required=True)
    p.add_argument("--sampling_prob", type=float, required=True, help="q in (0, 1]")
    p.add_argument("--steps", type=int, required=True, help="optimizer updates")
    p.add_argument("--num_canaries", type=int, required=True)
    p.add_argument("--repeats", type=int, default=1,
                   help="audits to simulate; the first is timed, and the run refused if all "
                        "would take more than --max_seconds")
    p.add_argument("--max_seconds", type=float, default=600.0,
                   help="the longest the audits may take (default 600)")
    p.add_argument("--bug", choices=sorted(BUGS), default="none")
    p.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld")
    common(p)
    guesses(p)
    p.set_defaults(func=_simulate)

    for name, func, helptext in (
            ("gradient", _gradient, "train a gin config with Dirac gradient canaries"),
            ("input", _input, "train a gin config with mislabelled-image canaries")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--gin_file", action="append", required=True,
                       help="gin config(s), as for python -m tfdp.main")
        p.add_argument("--gin_param", action="append", default=[], help="gin binding(s)")
        p.add_argument("--workdir", required=True, help="a fresh directory for the run")
        p.add_argument("--num_canaries", type=int, default=1000)
        if name == "gradient":
            p.add_argument("--coordinates", choices=("dedicated", "model"), default="dedicated",
                           help="dedicated coordinates no example touches (audits the noise), "
                                "or random coordinates of the model's parameters")
        common(p, delta=False)
        guesses(p)
        p.set_defaults(func=func)
    return parser


def main(argv=None) -> int:
    """Runs the CLI; returns the exit status (0, or 2 on bad values)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    absl_logger = logging.getLogger("absl")
    saved = absl_logger.level
    if args.command in ("bound", "simulate"):
        absl_logger.setLevel(logging.ERROR)  # dp_accounting's RDP-order notes
    try:
        args.func(args)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"audit.py {args.command}: error: {message}", file=sys.stderr)
        return 2
    finally:
        absl_logger.setLevel(saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
