"""The privacy card of a run: `privacy_report.json` and `privacy_report.md`.

It states what How to DP-fy ML (Ponomareva et al. 2023, Sec. 5.3.3) asks an
honest privacy claim to state: the DP setting, the data accesses covered, the
mechanism's output, the privacy unit and adjacency, the accountant and whether
its assumptions held, the final (epsilon, delta) with delta against 1/N, the
epsilon tier of Sec. 5.2.1, the hyper-parameters and the software versions.
Pure Python: no TensorFlow import.
"""

import dataclasses
import importlib.metadata
import json
import math
import os
import platform

from tfdp import atomic_file

REPORT_JSON = "privacy_report.json"
REPORT_MD = "privacy_report.md"
# A non-private run (`privacy=None`) writes these INSTEAD of the report, in the workdir
# and in the SavedModel's assets.
NOT_PRIVATE = "NOT PRIVATE"
NOT_PRIVATE_JSON = "NOT_PRIVATE.json"
NOT_PRIVATE_MD = "NOT_PRIVATE.md"

_PACKAGES = ("tfdp", "tensorflow", "tensorflow-cpu", "tensorflow-tpu", "keras",
             "dp-accounting", "tensorflow-datasets", "gin-config")


def epsilon_tier(epsilon: float, delta: float, num_examples: int) -> str:
    """The tier of How to DP-fy ML, Sec. 5.2.1, for a final (epsilon, delta).

    A delta >= 1/N is never rated a reasonable guarantee, whatever epsilon:
    a mechanism that publishes one random example in full is (0, 1/N)-DP
    (Sec. 5.3.2 asks for delta << 1/N).
    """
    if delta >= 1.0 / num_examples:
        return (f"No meaningful guarantee: delta = {delta:.3g} >= 1/N = {1.0 / num_examples:.3g} "
                "(How to DP-fy ML, Sec. 5.3.2 asks for delta << 1/N)")
    if epsilon <= 1.0:
        return "Tier 1: strong formal privacy guarantee (epsilon <= 1)"
    if epsilon <= 10.0:
        return "Tier 2: reasonable privacy guarantee (epsilon <= 10)"
    return "Tier 3: weak to no formal privacy guarantee (epsilon > 10)"


def software_versions() -> dict:
    """Installed versions of the packages the guarantee depends on."""
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


ASSUMPTIONS = (
    "central DP: the party that runs training is trusted to run the mechanism as stated",
    "the sampling and noise seeds are secret: drawn from OS entropy and kept only in the "
    "run's checkpoint (unless fixed by the user, see `seeds`)",
    "the number of training examples N is public",
    "training-set metrics in the logs, TensorBoard and metrics.jsonl are not covered",
    "hyper-parameter tuning runs are covered only when they share a study ledger",
)


def build_privacy_report(
    mechanism,
    *,
    steps_completed,
    hyperparameters=None,
    exported_parameters="last",
    simulation=None,
    study=None,
    clip_margin=None,
) -> dict:
    """Builds the report as a JSON-serializable dict, from the run's mechanism alone.

    Every privacy number (epsilon, delta, sensitivity, noise std, adjacency,
    the events composed) is read from `mechanism`; nothing is recomputed here.

    Args:
      mechanism: the run's `tfdp.accounting.DPMechanism`.
      steps_completed: optimizer updates actually taken.
      hyperparameters: other training settings to record (dict).
      exported_parameters: "last" or "ema": which parameters were exported.
      simulation: None, or a dict describing the reference run this one
        simulates at a smaller batch (TAN, Sander et al. 2023, Sec. 3.4).
      study: None, or {"dir": ..., "epsilon": ..., ...} for the tuning ledger.
      clip_margin: None, or `tfdp.dp.precision.clip_margin_record(C)`: the
        norm every example was clipped to, C / (1 + kappa), and why.

    Returns:
      The report dict (keys documented by `privacy_report.md`). `epsilon` and
      `delta` at the top are the guarantee of the whole run: every mechanism
      composed, and with static batches the truncation term added to delta
      (`accountant_delta` is the accountant's own delta).
    """
    epsilon, delta = mechanism.guarantee(steps_completed)
    sampling = _sampling_record(mechanism, steps_completed)
    sensitivity_formula = _sensitivity_formula(mechanism)
    covered = _covered_accesses(study)
    extra = _extra_mechanisms(mechanism)
    seeds = _seed_statements(mechanism)
    report = {
        "epsilon": float(epsilon),
        "delta": float(delta),
        "accountant_delta": mechanism.delta,
        "accountant": mechanism.accountant,
        "noise_multiplier": mechanism.noise_multiplier,
        "noise_stddev": mechanism.noise_stddev(),
        "l2_clip_norm": mechanism.l2_clip_norm,
        "sensitivity": mechanism.sensitivity(),
        "sensitivity_formula": sensitivity_formula,
        "clipping_unit": mechanism.clipping_unit,
        "normalize_update": mechanism.normalize_update,
        "batch_size": mechanism.batch_size,
        "update_divisor": mechanism.update_divisor,
        "num_examples": mechanism.num_examples,
        "steps": int(steps_completed),
        "planned_steps": mechanism.num_steps,
        "target_epsilon": mechanism.target_epsilon,
        "noise_calibrated": mechanism.noise_calibrated,
        "steps_capped_by_target_epsilon": mechanism.steps_capped,
        "sampling": sampling,
        "seeds": seeds,
        "dp_setting": "central: the party running training is trusted to run the mechanism",
        "assumptions": list(ASSUMPTIONS),
        "covered": covered,
        "not_covered": (
            "training-set statistics in the logs, TensorBoard and metrics.jsonl "
            "(train_loss, train_accuracy, train_grad_norm, train_clipped_fraction) are "
            "computed on private batches without noise; they are not covered by this "
            "guarantee and should not be published"
        ),
        "mechanism_output": (
            "every iterate (all intermediate models and noisy gradients); the exported "
            f"model uses the {exported_parameters} parameters"
        ),
        "exported_parameters": exported_parameters,
        "privacy_unit": "one training example (its image and its label)",
        "neighbouring_relation": mechanism.adjacency,
        "microbatching": (
            {"num_microbatches": mechanism.num_microbatches,
             "sensitivity": mechanism.sensitivity()}
            if mechanism.num_microbatches else None
        ),
        "delta_times_num_examples": delta * mechanism.num_examples,
        "delta_below_1_over_n": delta < 1.0 / mechanism.num_examples,
        "epsilon_tier": epsilon_tier(epsilon, delta, mechanism.num_examples),
        "extra_mechanisms": extra,
        "mechanism": mechanism.to_dict(),
        "hyperparameters": dict(hyperparameters or {}),
        "software": software_versions(),
    }
    _add_optional_sections(report, mechanism, delta, clip_margin=clip_margin,
                           simulation=simulation, study=study)
    return report


def _sampling_record(mechanism, steps_completed) -> dict:
    """The report's `sampling` entry: the scheme used and what the accountant assumes of it."""
    if mechanism.sampling == "poisson":
        return {
            "scheme": "poisson",
            "sampling_prob": mechanism.sampling_prob,
            "accountant_assumes": "Poisson sampling with probability sampling_prob "
                                  "(amplification by subsampling)",
            "assumption_holds": True,
        }
    return {
        "scheme": "shuffle",
        "sampling_prob": mechanism.sampling_prob,
        "accountant_assumes": (
            "fixed-size shuffled batches, no amplification: each example is in at most "
            f"one batch per epoch, so in at most {mechanism.participations(steps_completed)} "
            f"of the {steps_completed} steps (epochs touched = ceil(T / floor(N / B)))"),
        "assumption_holds": True,
        "epsilon_assuming_poisson": mechanism.epsilon_assuming_poisson(steps_completed),
        "note": (
            "epsilon_assuming_poisson is what papers often quote for shuffled batches; it "
            "is NOT a guarantee of this run (How to DP-fy ML, Sec. 5.3.1)."),
    }


def _sensitivity_formula(mechanism) -> str:
    """How the mechanism's sensitivity is made: its unit, doubled (and why) or not."""
    unit = "1" if mechanism.normalize_update else "l2_clip_norm"
    doubled = mechanism.sensitivity() != (1.0 if mechanism.normalize_update
                                          else mechanism.l2_clip_norm)
    why = []
    if mechanism.num_microbatches:
        why.append("microbatch means are clipped")
    if mechanism.sampling != "poisson":
        why.append("replace-one adjacency")
    return f"2 * {unit} ({', '.join(why)})" if doubled else unit


def _covered_accesses(study) -> str:
    """The data accesses the guarantee covers: this run, and the study's runs if any."""
    covered = "this training run only; hyper-parameter tuning runs are not covered"
    if study:
        covered = ("this training run; the tuning runs in the study ledger are composed in "
                   "study.epsilon")
    return covered


def _extra_mechanisms(mechanism) -> list:
    """The mechanisms composed besides DP-SGD (private data normalization), as dicts."""
    extra = []
    if mechanism.data_normalization is not None:
        extra.append({
            "mechanism": "private data normalization (Tramer & Boneh 2021, App. B)",
            "dp_event": "two Gaussian mechanisms, released once before training",
            **dataclasses.asdict(mechanism.data_normalization),
        })
    return extra


def _seed_statements(mechanism) -> dict:
    """What the guarantee assumes of each secret coin: drawn from OS entropy, or fixed."""
    return {
        name: ("fixed by the user: the guarantee assumes this seed stays secret"
               if name in mechanism.fixed_seeds else
               "secret: drawn from OS entropy, kept only in the checkpoint")
        for name in ("sampling_seed", "noise_seed")
    }


def _add_optional_sections(report, mechanism, delta, *, clip_margin, simulation, study):
    """Appends, in this order, the report's optional entries that apply to the run.

    They are `clip_margin`, `simulation`, `study` and (static batches) `truncation`.
    """
    if clip_margin:
        report["clip_margin"] = dict(clip_margin)
    if simulation:
        report["simulation"] = dict(simulation)
    if study:
        report["study"] = dict(study)
    if mechanism.truncation is not None:
        report["truncation"] = dataclasses.asdict(mechanism.truncation) | {
            "per_chunk_batch_size": mechanism.truncation.per_chunk_batch_size,
            "delta_with_truncation": float(delta)}


def render_markdown(report: dict) -> str:
    """A readable card of the same facts as the JSON report."""
    eps, delta = report["epsilon"], report["delta"]
    lines = ["# Privacy report", ""]
    if report.get("simulation"):
        sim = report["simulation"]
        lines += [
            "> **SIMULATION, NOT A PRIVATE RUN AT THE REFERENCE EPSILON.** This run "
            f"simulates {sim.get('reference')} (reference epsilon "
            f"{sim.get('reference_epsilon')}) at a smaller batch with the same total "
            "amount of noise (TAN, Sander et al. 2023, Sec. 3.4). Its own guarantee is "
            "below.",
            "",
        ]
    lines += [
        f"**Guarantee:** ({eps:.4g}, {delta:.3g})-DP for {report['privacy_unit']}, "
        f"{report['neighbouring_relation']} adjacency, {report['accountant'].upper()} "
        f"accountant, after {report['steps']} steps.",
        "",
    ]
    lines += _split_lines(report)
    if report.get("truncation"):
        trunc = report["truncation"]
        lines += [
            f"**Static batches:** Poisson batches were truncated to "
            f"{trunc['static_batch_size']} examples ({trunc['num_replicas']} replicas x "
            f"{trunc.get('accumulation_steps', 1)} accumulation chunks x "
            f"{trunc['per_replica_batch_size'] // trunc.get('accumulation_steps', 1)} slots per "
            "replica-chunk; the cap is on the logical batch, filled chunk by chunk in order) "
            "and padded with masked slots. Truncation "
            f"happens with probability <= {trunc['truncation_probability']:.3g} over the "
            f"run, so the guarantee's delta is the accountant's "
            f"{report['accountant_delta']:.3g} + (1 + e^epsilon) * that probability = "
            f"{delta:.4g} (truncated Poisson sampling, Chua et al. 2024, arXiv:2411.04205).",
            "",
        ]
    sampling = report["sampling"]
    lines += [
        "| item | value |",
        "|---|---|",
        f"| DP setting | {report['dp_setting']} |",
        f"| data accesses covered | {report['covered']} |",
        f"| not covered | {report['not_covered']} |",
        f"| mechanism output | {report['mechanism_output']} |",
        f"| privacy unit | {report['privacy_unit']} |",
        f"| adjacency | {report['neighbouring_relation']}; sensitivity "
        f"{report['sensitivity']:.6g} = {report['sensitivity_formula']} per "
        f"{report['clipping_unit']} |",
        f"| noise | std {report['noise_stddev']:.6g} = noise_multiplier "
        f"{report['noise_multiplier']:.6g} * sensitivity, once per logical batch; the noisy "
        f"sum is divided by {report['update_divisor']:.6g} |",
        f"| accountant | {report['accountant']}: {sampling['accountant_assumes']} |",
        f"| sampling used | {sampling['scheme']} (q = {sampling['sampling_prob']:.6g}); "
        f"accountant assumption holds: {sampling['assumption_holds']} |",
        f"| epsilon | {eps:.4f} |",
        f"| delta | {delta:.3g} (accountant's delta {report['accountant_delta']:.3g}; "
        f"delta * N = {report['delta_times_num_examples']:.3g}; below 1/N: "
        f"{report['delta_below_1_over_n']}) |",
        f"| epsilon tier (Sec. 5.2.1) | {report['epsilon_tier']} |",
        f"| l2_clip_norm | {report['l2_clip_norm']:.6g} |",
        *_clip_margin_lines(report),
        f"| batch_size (expected) | {report['batch_size']} |",
        f"| num_examples | {report['num_examples']} |",
        f"| steps (planned) | {report['steps']} ({report['planned_steps']}) |",
    ]
    # "coins": the entry's name in reports written before "seeds".
    for name, how in report.get("seeds", report.get("coins", {})).items():
        lines.append(f"| {name} | {how} |")
    if "note" in sampling:
        lines.append(f"| epsilon assuming Poisson sampling | "
                     f"{sampling['epsilon_assuming_poisson']:.4f}: {sampling['note']} |")
    if report.get("microbatching"):
        lines.append(f"| microbatching | {report['microbatching']} |")
    for mech in report["extra_mechanisms"]:
        lines.append(f"| also composed | {mech} |")
    if report.get("study"):
        lines.append(f"| tuning study | {report['study']} |")
    if report.get("audit"):
        audit = report["audit"]
        lines.append(f"| empirical audit | epsilon >= {audit['epsilon_lower_bound']:.3g} at "
                     f"{audit['confidence']:.0%} confidence (see below) |")
    lines += ["", "## What the guarantee assumes", ""]
    lines += [f"- {a}" for a in report["assumptions"]]
    lines += _backbone_lines(report)
    if report.get("audit"):
        lines += ["", *render_audit(report["audit"])]
    lines += ["", "## Hyper-parameters", ""]
    lines += [f"- `{k}`: {v}" for k, v in sorted(report["hyperparameters"].items())]
    lines += ["", "## Software", ""]
    lines += [f"- {k} {v}" for k, v in sorted(report["software"].items())]
    return "\n".join(lines) + "\n"


def _clip_margin_lines(report: dict) -> list:
    """The clip margin's row of the card, if the report has one."""
    margin = report.get("clip_margin")
    if not margin:
        return []
    return [f"| clipped to | {margin['clipped_to']:.6g} = l2_clip_norm / (1 + kappa), kappa "
            f"{margin['kappa']:.0e} for {margin['device_matmul_inputs']} matmul inputs: "
            f"{margin['why']} |"]


def _backbone_lines(report: dict) -> list:
    """What the guarantee assumes of a fine-tuned model's pretrained backbone."""
    backbone = report.get("backbone")
    if not backbone:
        return []
    line = (f"- The pretrained backbone `{backbone['source']}` ({backbone['kind']}) is "
            "outside this guarantee: its weights are a function of its own training data, "
            "which must be public or disjoint from this run's data. ")
    if backbone.get("verified"):
        privacy = backbone["privacy"]
        trained = ("NOT PRIVATELY" if privacy == "NOT PRIVATE" else
                   f"at epsilon = {privacy['epsilon']:.4g}, delta = {privacy['delta']:.3g}")
        line += (f"Checked: it was trained {trained} on `{backbone['dataset']}` "
                 f"`{backbone['train_split']}`, which shares no example with this run's split.")
    else:
        line += ("Not checked: tfdp cannot see what it was trained on."
                 if not backbone.get("not_checked_because") else
                 f"Not checked: it was trained on `{backbone['dataset']}` "
                 f"`{backbone['train_split']}`, which tfdp cannot compare with this run's "
                 f"split ({backbone['not_checked_because']}).")
    return [line]


def _split_lines(report: dict) -> list:
    """The sentence that says N counts only a slice of the split (e.g. "train[2000:]")."""
    split = (report.get("hyperparameters") or {}).get("train_split")
    if not split or "[" not in str(split):
        return []
    return [
        f"**Training data:** the slice `{split}` of the dataset "
        f"`{report['hyperparameters'].get('dataset', '?')}`. N = {report['num_examples']} "
        "counts only the examples of this slice: the examples outside it (e.g. a public "
        "subset used for non-private pretraining) are not in N, are not protected by this "
        "guarantee, and must not be private data.",
        "",
    ]


def build_not_private_report(*, steps_completed, planned_steps, num_examples, batch_size,
                             sampling, unused_privacy_settings, hyperparameters=None,
                             exported_parameters="last") -> dict:
    """The statement a NON-PRIVATE run (`privacy=None`) writes where a privacy report would be.

    Args:
      steps_completed, planned_steps: optimizer updates taken and planned.
      num_examples: N of the training split; batch_size: B (expected or fixed).
      sampling: "poisson" or "shuffle".
      unused_privacy_settings: {name: value} of the privacy settings given to
        the run that it did not use (no clipping, noise or accounting).
      hyperparameters: other training settings to record (dict).
      exported_parameters: "last" or "ema".

    Returns:
      A JSON-serializable dict with `"privacy": "NOT PRIVATE"` and no epsilon.
    """
    return {
        "privacy": NOT_PRIVATE,
        "statement": (
            "This model was trained WITHOUT differential privacy: no per-example clipping, no "
            "noise, no privacy accounting. It has no (epsilon, delta) guarantee and can "
            "memorize its training examples. Train only on public data with it, or use it as "
            "a non-private baseline."),
        "steps": int(steps_completed),
        "planned_steps": int(planned_steps),
        "num_examples": int(num_examples),
        "batch_size": int(batch_size),
        "sampling": sampling,
        "unused_privacy_settings": dict(unused_privacy_settings),
        "exported_parameters": exported_parameters,
        "hyperparameters": dict(hyperparameters or {}),
        "software": software_versions(),
    }


def render_not_private_markdown(report: dict) -> str:
    """The `NOT_PRIVATE.md` card of a `build_not_private_report` dict."""
    lines = ["# NOT PRIVATE", "", f"**{report['statement']}**", "",
             "| item | value |", "|---|---|",
             f"| privacy | {report['privacy']} |",
             f"| training data | {report['hyperparameters'].get('dataset', '?')} "
             f"`{report['hyperparameters'].get('train_split', '?')}` |",
             f"| num_examples | {report['num_examples']} |",
             f"| batch_size | {report['batch_size']} ({report['sampling']} batches) |",
             f"| steps (planned) | {report['steps']} ({report['planned_steps']}) |",
             f"| exported parameters | {report['exported_parameters']} |", ""]
    unused = report["unused_privacy_settings"]
    lines += ["## Privacy settings given but NOT used", ""]
    lines += ([f"- `{k}`: {v}" for k, v in sorted(unused.items())] or ["- none"])
    lines += ["", "## Hyper-parameters", ""]
    lines += [f"- `{k}`: {v}" for k, v in sorted(report["hyperparameters"].items())]
    lines += ["", "## Software", ""]
    lines += [f"- {k} {v}" for k, v in sorted(report["software"].items())]
    return "\n".join(lines) + "\n"


def write_not_private_report(report: dict, directory) -> tuple[str, str]:
    """Writes `NOT_PRIVATE.json` and `NOT_PRIVATE.md` into `directory`, atomically.

    Returns:
      The two paths.
    """
    return _write_pair(report, directory, NOT_PRIVATE_JSON, NOT_PRIVATE_MD,
                       render_not_private_markdown)


def render_audit(audit: dict) -> list:
    """Markdown lines of the optional "Empirical audit" section (`report["audit"]`).

    `audit` is `tfdp.accounting.audit.report_section`'s dict.
    """
    verdict = (
        "**The bound exceeds the claimed epsilon: at this confidence the run is NOT as "
        "private as claimed (an implementation or accounting bug).**"
        if audit["exceeds_claim"] else
        "The bound is below the claimed epsilon, as a correct implementation gives. It is a "
        "lower bound: it does not show that the run is more private than claimed.")
    lines = [
        "## Empirical audit",
        "",
        f"epsilon >= **{audit['epsilon_lower_bound']:.3f}** at {audit['confidence']:.0%} "
        f"confidence (beta = {audit['beta']:g}) and delta = {audit['delta']:.3g}, against the "
        f"claimed epsilon {audit['claimed_epsilon']:.3f} (ratio {audit['ratio']:.2f}). "
        + verdict,
        "",
        "| item | value |",
        "|---|---|",
        f"| canaries | {audit['num_canaries']} ({audit['num_included']} included, each with "
        f"probability 1/2): {audit['canaries']} |",
        f"| score | {audit['score']} |",
        f"| guesses | {audit['num_correct']} correct of {audit['num_guesses']} |",
        f"| method | {audit['method']} |",
    ]
    if audit.get("command"):
        lines.append(f"| command | `{audit['command']}` |")
    return lines


def write_privacy_report(report: dict, directory) -> tuple[str, str]:
    """Writes `privacy_report.json` and `privacy_report.md` into `directory`, atomically.

    Returns:
      The two paths.
    """
    return _write_pair(report, directory, REPORT_JSON, REPORT_MD, render_markdown)


def _write_pair(report, directory, json_name, md_name, render):
    json_path = os.path.join(directory, json_name)
    md_path = os.path.join(directory, md_name)
    # Each file is written next to its place and renamed in (`tfdp.atomic_file`): a reader
    # never sees half a report. Both are written before either is renamed in.
    # The JSON is written out in full before the Markdown is: a full disk then fails before
    # either is renamed in, and never leaves a new .md beside the old .json.
    text = json.dumps(report, indent=2, sort_keys=True, default=_json_default) + "\n"
    markdown = render(report)
    with atomic_file.replacing(json_path, "w") as json_file:
        json_file.write(text)
        json_file.flush()
        os.fsync(json_file.fileno())
        with atomic_file.replacing(md_path, "w") as md_file:
            md_file.write(markdown)
    return json_path, md_path


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)
