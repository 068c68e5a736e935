#!/usr/bin/env python3
"""Privacy accounting CLI: a thin layer over `tfdp.accounting` (no TensorFlow).

Subcommands (add --json to print a JSON object as the LAST line):

  epsilon    epsilon of DP-SGD with Poisson sampling:
               python tools/privacy.py epsilon --num_examples 50000 \\
                 --batch_size 4096 --noise_multiplier 3 --steps 1843 \\
                 --delta 1e-5
  calibrate  solve for the ONE missing value among --noise_multiplier,
             --steps and --batch_size so that epsilon <= --target_epsilon.
  tan        TAN eta, Sigma and eps_TAN (Sander et al. 2023, Def. 3.1, eq. 4)
             beside the RDP and PLD epsilon (PLD "not computed", with the
             reason, where the PLD accountant refuses: noise_multiplier
             below 0.05 or more than 10^7 steps).
  simulate   noise_multiplier that simulates a reference run at a smaller
             batch size (TAN Sec. 3.4) and the gin overrides to launch it.
  ledger     per-run and whole-study epsilon of a study directory
             (How to DP-fy ML, Sec. 5.4.2).

All runs are accounted under the add-or-remove-one neighbouring relation, with
Poisson sampling of probability q = batch_size / num_examples. Bad values exit
with status 2 and a one-line message on stderr.
"""

import argparse
import json
import logging
import os
import shlex
import sys
import warnings

# Runnable as `python tools/privacy.py` from any directory, installed or not.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tfdp import accounting  # noqa: E402

_ACCOUNTANT_NAMES = {"rdp": "RDP", "pld": "PLD"}


def _add_common(parser, *, accountant=True):
    if accountant:
        parser.add_argument(
            "--accountant",
            choices=accounting.ACCOUNTANTS,
            default="rdp",
            help="privacy accountant (default rdp)",
        )
    parser.add_argument("--json", action="store_true", help="print a JSON object as the last line")


def _emit(args, lines, payload):
    for line in lines:
        print(line)
    if args.json:
        print(json.dumps(payload))


def _epsilon(args):
    q = accounting.sampling_prob_from(args.batch_size, args.num_examples)
    accounting.validate_privacy_params(delta=args.delta, num_examples=args.num_examples)
    eps = accounting.compute_epsilon(
        noise_multiplier=args.noise_multiplier,
        sampling_prob=q,
        num_steps=args.steps,
        delta=args.delta,
        accountant=args.accountant,
    )
    _emit(
        args,
        [
            f"epsilon = {eps:.4g} at delta = {args.delta:g} after {args.steps} "
            f"steps ({_ACCOUNTANT_NAMES[args.accountant]}, Poisson sampling "
            f"q={q:.4g}, noise_multiplier={args.noise_multiplier:g}, "
            f"add-or-remove)"
        ],
        {
            "epsilon": eps,
            "delta": args.delta,
            "num_steps": args.steps,
            "sampling_prob": q,
            "noise_multiplier": args.noise_multiplier,
            "accountant": args.accountant,
        },
    )


def _calibrate(args):
    given = {
        "noise_multiplier": args.noise_multiplier is not None,
        "steps": args.steps is not None,
        "batch_size": args.batch_size is not None,
    }
    missing = [name for name, is_given in given.items() if not is_given]
    if len(missing) != 1:
        raise ValueError(
            f"calibrate solves for exactly one of --noise_multiplier, --steps, "
            f"--batch_size; give the other two (missing now: "
            f"{', '.join('--' + m for m in missing) or 'none'})."
        )
    accounting.validate_privacy_params(delta=args.delta, num_examples=args.num_examples)
    common = dict(target_epsilon=args.target_epsilon, delta=args.delta, accountant=args.accountant)
    if missing == ["noise_multiplier"]:
        q = accounting.sampling_prob_from(args.batch_size, args.num_examples)
        sigma = accounting.calibrate_noise_multiplier(
            sampling_prob=q, num_steps=args.steps, **common
        )
        solved = {"noise_multiplier": sigma}
        batch_size, steps = args.batch_size, args.steps
    elif missing == ["steps"]:
        q = accounting.sampling_prob_from(args.batch_size, args.num_examples)
        steps = accounting.calibrate_num_steps(
            noise_multiplier=args.noise_multiplier,
            sampling_prob=q,
            max_num_steps=args.max_steps,
            **common,
        )
        sigma, batch_size = args.noise_multiplier, args.batch_size
        solved = {"num_steps": steps}
    else:
        batch_size = accounting.calibrate_batch_size(
            noise_multiplier=args.noise_multiplier,
            num_steps=args.steps,
            num_examples=args.num_examples,
            **common,
        )
        q = accounting.sampling_prob_from(batch_size, args.num_examples)
        sigma, steps = args.noise_multiplier, args.steps
        solved = {"batch_size": batch_size}
    eps = accounting.compute_epsilon(
        noise_multiplier=sigma,
        sampling_prob=q,
        num_steps=steps,
        delta=args.delta,
        accountant=args.accountant,
    )
    ((name, value),) = solved.items()
    _emit(
        args,
        [
            f"{name} = {value:.6g} gives epsilon = {eps:.5g} <= target "
            f"{args.target_epsilon:g} at delta = {args.delta:g} "
            f"({_ACCOUNTANT_NAMES[args.accountant]}; batch_size={batch_size}, "
            f"noise_multiplier={sigma:.6g}, steps={steps}, q={q:.4g})"
        ],
        {
            **solved,
            "epsilon": eps,
            "target_epsilon": args.target_epsilon,
            "delta": args.delta,
            "noise_multiplier": sigma,
            "num_steps": steps,
            "batch_size": batch_size,
            "sampling_prob": q,
            "accountant": args.accountant,
        },
    )


def _tan(args):
    q = accounting.sampling_prob_from(args.batch_size, args.num_examples)
    accounting.validate_privacy_params(delta=args.delta, num_examples=args.num_examples)
    params = dict(noise_multiplier=args.noise_multiplier, sampling_prob=q, num_steps=args.steps)
    eta = accounting.tan_eta(**params)
    tan_noise = accounting.total_amount_of_noise(**params)
    eps_tan = accounting.tan_epsilon(eta, args.delta)
    eps = {"rdp": accounting.compute_epsilon(delta=args.delta, accountant="rdp", **params)}
    try:  # PLD refuses what it could not finish (tiny noise, too many steps): RDP stays
        eps["pld"] = accounting.compute_epsilon(delta=args.delta, accountant="pld", **params)
        pld_text, pld_note = f"{eps['pld']:.4g}", []
    except ValueError as e:
        eps["pld"], pld_text, pld_note = None, "not computed", [f"note: PLD not computed: {e}"]
    lines = [
        f"eta = {eta:.4g}, Sigma (TAN) = {tan_noise:.4g}, eps_TAN = "
        f"{eps_tan:.4g} (Sander et al. 2023, Def. 3.1, eq. 4)",
        f"epsilon: RDP = {eps['rdp']:.4g}, PLD = {pld_text} at delta = "
        f"{args.delta:g} (q={q:.4g}, noise_multiplier="
        f"{args.noise_multiplier:g}, steps={args.steps})",
        *pld_note,
    ]
    if args.noise_multiplier < 2:
        lines.append(
            f"note: noise_multiplier={args.noise_multiplier:g} < 2, where eps_TAN "
            f"underestimates epsilon (TAN Sec. 3.2, Fig. 2 'privacy wall')."
        )
    _emit(
        args,
        lines,
        {
            "eta": eta,
            "total_amount_of_noise": tan_noise,
            "epsilon_tan": eps_tan,
            "epsilon_rdp": eps["rdp"],
            "epsilon_pld": eps["pld"],
            "delta": args.delta,
            "sampling_prob": q,
            "num_steps": args.steps,
            "noise_multiplier": args.noise_multiplier,
        },
    )


def _simulate(args):
    ref_q = accounting.sampling_prob_from(args.reference_batch_size, args.num_examples)
    q = accounting.sampling_prob_from(args.batch_size, args.num_examples)
    accounting.validate_privacy_params(delta=args.delta, num_examples=args.num_examples)
    sigma = accounting.simulate(
        reference_batch_size=args.reference_batch_size,
        reference_noise_multiplier=args.reference_noise_multiplier,
        batch_size=args.batch_size,
    )
    ref_eps = accounting.compute_epsilon(
        noise_multiplier=args.reference_noise_multiplier,
        sampling_prob=ref_q,
        num_steps=args.steps,
        delta=args.delta,
    )
    # RDP only: PLD is very slow for the tiny noise of a simulation.
    sim_eps = accounting.compute_epsilon(
        noise_multiplier=sigma, sampling_prob=q, num_steps=args.steps, delta=args.delta
    )
    reference = (
        f"reference: batch_size={args.reference_batch_size}, "
        f"noise_multiplier={args.reference_noise_multiplier:g}, "
        f"num_steps={args.steps}, num_examples={args.num_examples}, "
        f"epsilon={ref_eps:.3g} at delta={args.delta:g} (RDP)"
    )
    simulation = {
        "reference": reference,
        "reference_batch_size": args.reference_batch_size,
        "reference_noise_multiplier": args.reference_noise_multiplier,
        "reference_epsilon": round(ref_eps, 6),
    }
    # TARGET_EPSILON=None: the simulation spends far more than the reference's
    # epsilon by design, so the trainer must not cap its steps at that budget.
    gin_params = [
        f"--gin_param=BATCH_SIZE={args.batch_size}",
        f"--gin_param=NOISE_MULTIPLIER={sigma!r}",
        f"--gin_param=NUM_STEPS={args.steps}",
        "--gin_param=TARGET_EPSILON=None",
        f"--gin_param=tfdp.PrivacyConfig.simulation={simulation!r}",
    ]
    _emit(
        args,
        [
            f"noise_multiplier = {sigma:.6g} for batch_size = {args.batch_size} "
            f"at {args.steps} steps simulates the {reference} (TAN Sec. 3.4)",
            "gin overrides: " + shlex.join(gin_params),
            f"WARNING: the simulated run is NOT private at epsilon={ref_eps:.3g}: "
            f"its own epsilon is {sim_eps:.3g} (RDP). Use it only to tune "
            f"hyper-parameters, then launch the reference run.",
        ],
        {
            "noise_multiplier": sigma,
            "batch_size": args.batch_size,
            "num_steps": args.steps,
            "reference_epsilon": ref_eps,
            "simulated_epsilon": sim_eps,
            "delta": args.delta,
            "gin_params": gin_params,
            "simulation_of": reference,
        },
    )


def _ledger(args):
    total, per_run = accounting.study_epsilon(
        args.study_dir, delta=args.delta, accountant=args.accountant
    )
    name = _ACCOUNTANT_NAMES[args.accountant]
    lines = [f"run {run}: epsilon = {eps:.4g}" for run, eps in per_run]
    lines.append(
        f"study ({len(per_run)} runs composed): epsilon = {total:.4g} "
        f"at delta = {args.delta:g} ({name}; How to DP-fy ML, "
        f"Sec. 5.4.2)"
    )
    _emit(
        args,
        lines,
        {
            "epsilon": total,
            "delta": args.delta,
            "accountant": args.accountant,
            "runs": [{"run": run, "epsilon": eps} for run, eps in per_run],
        },
    )


def build_parser() -> argparse.ArgumentParser:
    """Returns the argparse parser of the CLI (one subparser per command)."""
    parser = argparse.ArgumentParser(
        prog="privacy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("epsilon", help="epsilon of a DP-SGD run")
    p.add_argument("--num_examples", type=int, required=True)
    p.add_argument(
        "--batch_size", type=int, required=True, help="expected batch size B; q = B / num_examples"
    )
    p.add_argument("--noise_multiplier", type=float, required=True, help="noise std / l2_clip_norm")
    p.add_argument("--steps", type=int, required=True, help="optimizer updates (not epochs)")
    p.add_argument("--delta", type=float, required=True)
    _add_common(p)
    p.set_defaults(func=_epsilon)

    p = sub.add_parser("calibrate", help="solve for noise_multiplier, steps or batch_size")
    p.add_argument("--num_examples", type=int, required=True)
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--noise_multiplier", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--target_epsilon", type=float, required=True)
    p.add_argument(
        "--max_steps",
        type=int,
        default=10**7,
        help="upper end of the search when solving for --steps",
    )
    _add_common(p)
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("tan", help="TAN eta, Sigma, eps_TAN vs RDP and PLD")
    p.add_argument("--num_examples", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--noise_multiplier", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--delta", type=float, required=True)
    _add_common(p, accountant=False)
    p.set_defaults(func=_tan)

    p = sub.add_parser("simulate", help="TAN simulation of a reference run at batch_size")
    p.add_argument("--num_examples", type=int, required=True)
    p.add_argument("--reference_batch_size", type=int, required=True)
    p.add_argument("--reference_noise_multiplier", type=float, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch_size", type=int, required=True)
    p.add_argument("--delta", type=float, required=True)
    _add_common(p, accountant=False)
    p.set_defaults(func=_simulate)

    p = sub.add_parser("ledger", help="epsilon of a hyper-parameter study")
    p.add_argument("study_dir", help="directory holding ledger.jsonl")
    p.add_argument("--delta", type=float, required=True)
    _add_common(p)
    p.set_defaults(func=_ledger)
    return parser


def main(argv=None) -> int:
    """Runs the CLI; returns the exit status (0, or 2 on bad values)."""
    args = build_parser().parse_args(argv)
    # dp_accounting logs (through absl) when it drops an RDP order that does not
    # converge at small noise; dropping orders only loosens the bound.
    absl_logger = logging.getLogger("absl")
    saved = absl_logger.level, warnings.formatwarning
    absl_logger.setLevel(logging.ERROR)
    warnings.formatwarning = lambda message, *unused_args, **unused_kwargs: f"warning: {message}\n"
    try:
        args.func(args)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"privacy.py {args.command}: error: {message}", file=sys.stderr)
        return 2
    finally:
        absl_logger.setLevel(saved[0])
        warnings.formatwarning = saved[1]
    return 0


if __name__ == "__main__":
    sys.exit(main())
