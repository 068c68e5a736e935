#!/usr/bin/env python3
"""TAN batch scaling laws: fit accuracy against log2(batch_size), and plot.

Sander, Stock, Sablayrolles 2023 ("TAN without a burn"), Sec. 3.4: runs that
keep the number of steps S and the per-step signal-to-noise ratio

    eta_step := q / (sqrt(2) sigma) = batch_size / (sqrt(2) num_examples sigma)

constant (TAN Sec. 3.1, below Def. 3.1, where eta^2 = S eta_step^2) have the
same Total Amount of Noise, and their test accuracy is (log) linear in the batch
size (TAN Fig. 1 and Fig. 4). So a few cheap small-batch simulations
(sigma = sigma_ref * B / B_ref) predict the accuracy of the expensive run at
B_ref. This tool reads finished workdirs of `python -m tfdp.main`, groups them
at constant (eta_step, num_steps), fits

    accuracy = intercept + slope * log2(batch_size)      (slope: per doubling)

by least squares in each group, and predicts the accuracy at B_ref with a 95%
prediction interval (Student t with n - 2 degrees of freedom).

Subcommands:

  fit    python tools/scaling_law.py fit WORKDIR [WORKDIR ...] \\
             --reference_batch_size 16384 --out docs/scaling_law [--metric final|max]
         writes PREFIX.png (points, fitted lines, prediction at B_ref with its
         interval, log2 batch-size axis) and PREFIX.txt (the table it prints).
  curve  python tools/scaling_law.py curve WORKDIR --out docs/accuracy_vs_epsilon
         writes PREFIX.png: test (and train) accuracy against epsilon over one
         run, from its metrics.jsonl.

What a run contributes is read from its workdir: batch_size, noise_multiplier,
num_steps ("steps" completed) and num_examples from `privacy_report.json`
(written when a run finishes). Without a report they are read from the macros
(BATCH_SIZE, NOISE_MULTIPLIER, NUM_STEPS, NUM_EXAMPLES) of
`operative_config.gin`, and the run is used only if metrics.jsonl reached
NUM_STEPS; otherwise it is skipped with a warning. The accuracy is the final
test accuracy (the evaluation at the largest step), or with `--metric max` the
maximum over evaluations, the "best test accuracy" that Tramer & Boneh 2021
report (App. D.4, Table 19); the max is selected on the test set, so it is
optimistic. Runs whose batch_size equals B_ref are held out of the fit and
shown beside the prediction, as the stars of TAN Fig. 1.

Bad input exits with status 2 and a one-line message on stderr.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
from gin import config_parser
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator
from scipy import stats

# File names written by tfdp's trainer (tfdp/experiment.py, tfdp/export/privacy_report.py);
# repeated here so that the tool imports neither TensorFlow nor tfdp.
METRICS_FILE = "metrics.jsonl"
REPORT_JSON = "privacy_report.json"
NOT_PRIVATE_JSON = "NOT_PRIVATE.json"  # what a privacy=None run writes instead
OPERATIVE_CONFIG = "operative_config.gin"

METRICS = ("final", "max")
_METRIC_DESCRIPTIONS = {
    "final": "final test accuracy (the evaluation at the largest step of metrics.jsonl)",
    "max": (
        "maximum test accuracy over evaluations (the 'best test accuracy' of "
        "Tramer & Boneh 2021, App. D.4; selected on the test set, so optimistic)"
    ),
}
# Gin macro (and train_and_evaluate argument) that holds each run parameter.
_GIN_MACROS = {
    "batch_size": "BATCH_SIZE",
    "noise_multiplier": "NOISE_MULTIPLIER",
    "num_steps": "NUM_STEPS",
    "num_examples": "NUM_EXAMPLES",
}
_FIGSIZE = (5.0, 3.5)
_DPI = 100


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What one finished training run contributes to a scaling-law fit.

    Attributes:
      name: the run's label in tables and plots (its workdir).
      batch_size: B, expected logical batch size (examples).
      noise_multiplier: sigma, noise std divided by l2_clip_norm (dimensionless).
      num_steps: S, optimizer updates (not epochs).
      num_examples: N, training set size; q = B / N.
      final_accuracy: test accuracy in [0, 1] at the last evaluation.
      max_accuracy: maximum test accuracy in [0, 1] over evaluations.
      epsilon: the run's own epsilon at its end (None if unknown).
      source: "privacy_report.json" or "operative_config.gin".
      reference_batch_size: B_ref of the run it simulates (None if not a
        simulation, TAN Sec. 3.4).
    """

    name: str
    batch_size: float
    noise_multiplier: float
    num_steps: int
    num_examples: int
    final_accuracy: float
    max_accuracy: float
    epsilon: float | None = None
    source: str = REPORT_JSON
    reference_batch_size: float | None = None

    @property
    def eta_step(self) -> float:
        """eta_step = q / (sqrt(2) sigma), q = B / N (TAN Sec. 3.1, Def. 3.1)."""
        return compute_eta_step(
            batch_size=self.batch_size,
            noise_multiplier=self.noise_multiplier,
            num_examples=self.num_examples,
        )

    def accuracy(self, metric: str) -> float:
        """The run's accuracy under `metric` ("final" or "max")."""
        _check_metric(metric)
        return self.final_accuracy if metric == "final" else self.max_accuracy


@dataclasses.dataclass(frozen=True)
class ScalingLawFit:
    """Least-squares fit accuracy = intercept + slope * log2(batch_size).

    Attributes:
      slope: accuracy change per doubling of the batch size.
      intercept: accuracy at batch_size = 1 (log2(1) = 0).
      r_squared: coefficient of determination (nan if the accuracies are all
        equal).
      slope_stderr: standard error of the slope (nan with 2 points).
      residual_std: s, the residual standard deviation sqrt(SSE / (n - 2))
        (nan with 2 points).
      num_points: runs in the fit.
      num_batch_sizes: distinct batch sizes in the fit (>= 2).
      reference_batch_size: B_ref, where the fit is evaluated.
      prediction: predicted accuracy at B_ref.
      interval: (low, high) prediction interval at B_ref at `confidence`, or
        None when num_points == 2 (no degree of freedom left for the noise).
      confidence: the interval's level, e.g. 0.95.
      dof: degrees of freedom of the t-distribution, num_points - 2.
    """

    slope: float
    intercept: float
    r_squared: float
    slope_stderr: float
    residual_std: float
    num_points: int
    num_batch_sizes: int
    reference_batch_size: float
    prediction: float
    interval: tuple[float, float] | None
    confidence: float
    dof: int


def compute_eta_step(*, batch_size: float, noise_multiplier: float, num_examples: int) -> float:
    """Returns TAN's per-step signal-to-noise ratio eta_step = q / (sqrt(2) sigma).

    TAN Sec. 3.1 (after Def. 3.1) defines eta_step := q / (sqrt(2) sigma), with
    q = batch_size / num_examples, so that eta^2 = num_steps * eta_step^2. TAN
    Sec. 3.4 and Fig. 4 hold it constant (with num_steps) across a family of
    simulations: sigma = sigma_ref * B / B_ref.

    >>> round(compute_eta_step(batch_size=16384, noise_multiplier=2.5,
    ...                        num_examples=1281167), 6)  # (16384/1281167)/(sqrt(2)*2.5)
    0.003617

    Args:
      batch_size: B, expected logical batch size, > 0.
      noise_multiplier: sigma, noise std divided by l2_clip_norm
        (dimensionless), > 0.
      num_examples: N, training set size, > 0.

    Returns:
      eta_step (float, > 0, dimensionless).

    Raises:
      ValueError: if a value is not a finite number > 0.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("noise_multiplier", noise_multiplier),
        ("num_examples", num_examples),
    ):
        if not _is_positive(value):
            raise ValueError(
                f"{name} must be a finite number > 0 to define eta_step, got {value!r} "
                f"(a non-private run, noise_multiplier = 0, has no eta_step)."
            )
    return batch_size / (math.sqrt(2.0) * num_examples * noise_multiplier)


def read_metrics(workdir: str) -> list[dict]:
    """Reads `workdir/metrics.jsonl`: one dict per evaluation, sorted by step.

    Args:
      workdir: a run directory written by `python -m tfdp.main`.

    Returns:
      The records (dicts with at least `step`; `epsilon`, `test_accuracy`, ...
      as written), sorted by `step`. Blank lines are ignored.

    Raises:
      FileNotFoundError: if metrics.jsonl does not exist.
      ValueError: if a line is not a JSON object with an integer `step`.
    """
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (is {workdir!r} a tfdp workdir?).")
    records = []
    with open(path) as f:
        for line_num, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {line_num}: not valid JSON ({e}).") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError(
                    f"{path}, line {line_num}: expected a JSON object with an integer "
                    f"'step', got {line.strip()[:80]!r}."
                )
            records.append(record)
    return sorted(records, key=lambda r: r["step"])


def read_operative_config_params(path: str) -> dict:
    """Reads batch_size, noise_multiplier, num_steps, num_examples from gin text.

    Uses gin's own parser. A parameter is taken from its macro (BATCH_SIZE,
    NOISE_MULTIPLIER, NUM_STEPS, NUM_EXAMPLES), else from a binding
    `<anything>.batch_size = <literal or %MACRO>` and so on.

    Args:
      path: an `operative_config.gin` file.

    Returns:
      A dict with the parameters found (missing ones are left out; a value
      may be None, e.g. NOISE_MULTIPLIER = None when sigma was calibrated).

    Raises:
      OSError: if the file cannot be read.
      SyntaxError: if gin cannot parse it.
    """
    with open(path) as f:
        text = f.read()
    macros, bindings = {}, {}
    for statement in config_parser.ConfigParser(text, _GinReferences()):
        if not isinstance(statement, config_parser.BindingStatement):
            continue
        if statement.arg_name:
            bindings[statement.arg_name] = statement.value
        else:
            macros[statement.selector] = statement.value
    params = {}
    for name, macro in _GIN_MACROS.items():
        if macro in macros:
            params[name] = macros[macro]
        elif name in bindings:
            value = bindings[name]
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "%":
                if value[1] not in macros:
                    continue
                value = macros[value[1]]
            params[name] = value
    return params


class _GinReferences(config_parser.ParserDelegate):
    """Keeps @references and %macros as tuples instead of resolving them."""

    def configurable_reference(self, scoped_name, evaluate):
        return ("@", scoped_name)

    def macro(self, macro_name):
        return ("%", macro_name)


def load_run(workdir: str, name: str | None = None) -> RunSummary:
    """Reads one finished run from its workdir.

    The parameters come from `privacy_report.json` (batch_size,
    noise_multiplier, steps, num_examples, epsilon, simulation); without it,
    from the macros of `operative_config.gin`, and then only if metrics.jsonl
    reached NUM_STEPS (a run that did not finish has no report).

    Args:
      workdir: a run directory written by `python -m tfdp.main`.
      name: label of the run (default: `workdir`).

    Returns:
      The run's RunSummary.

    Raises:
      FileNotFoundError: if metrics.jsonl, or both privacy_report.json and
        operative_config.gin, are missing.
      ValueError: if the run is NOT PRIVATE (privacy=None), did not finish, a parameter is missing or not
        > 0, or metrics.jsonl has no finite `test_accuracy`.
    """
    name = name or workdir
    records = read_metrics(workdir)
    if (os.path.exists(os.path.join(workdir, NOT_PRIVATE_JSON))
            or any(r.get("privacy") == "NOT PRIVATE" for r in records)):
        raise ValueError(
            f"{workdir} holds a NOT PRIVATE run (privacy=None: no noise, no epsilon); it is no "
            "point of a DP scaling law.")
    accuracies = [
        (r["step"], r["test_accuracy"])
        for r in records
        if isinstance(r.get("test_accuracy"), (int, float)) and math.isfinite(r["test_accuracy"])
    ]
    if not accuracies:
        raise ValueError(f"{os.path.join(workdir, METRICS_FILE)} has no finite test_accuracy.")
    report_path = os.path.join(workdir, REPORT_JSON)
    config_path = os.path.join(workdir, OPERATIVE_CONFIG)
    epsilon, reference_batch_size = None, None
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        required = ("batch_size", "noise_multiplier", "steps", "num_examples")
        missing = [k for k in required if k not in report]
        if missing:
            raise ValueError(f"{report_path} lacks {', '.join(missing)}.")
        params = {
            "batch_size": report["batch_size"],
            "noise_multiplier": report["noise_multiplier"],
            "num_steps": report["steps"],
            "num_examples": report["num_examples"],
        }
        epsilon = report.get("epsilon")
        reference_batch_size = (report.get("simulation") or {}).get("reference_batch_size")
        source = REPORT_JSON
    elif os.path.isfile(config_path):
        params = read_operative_config_params(config_path)
        missing = [
            _GIN_MACROS[k] for k in _GIN_MACROS if k not in params or params[k] is None
        ]
        if missing:
            raise ValueError(
                f"no {REPORT_JSON}, and {config_path} does not set "
                f"{', '.join(missing)} (a noise_multiplier calibrated at run time is "
                f"recorded only in {REPORT_JSON})."
            )
        last_step = records[-1]["step"]
        if last_step < params["num_steps"]:
            raise ValueError(
                f"the run did not finish: no {REPORT_JSON}, and metrics.jsonl stops at "
                f"step {last_step} < NUM_STEPS = {params['num_steps']}."
            )
        epsilon = records[-1].get("epsilon")
        source = OPERATIVE_CONFIG
    else:
        raise FileNotFoundError(
            f"{workdir!r} has neither {REPORT_JSON} nor {OPERATIVE_CONFIG}: the run did not "
            f"finish, or this is not a tfdp workdir."
        )
    run = RunSummary(
        name=name,
        batch_size=params["batch_size"],
        noise_multiplier=params["noise_multiplier"],
        num_steps=params["num_steps"],
        num_examples=params["num_examples"],
        final_accuracy=float(accuracies[-1][1]),
        max_accuracy=float(max(a for _, a in accuracies)),
        epsilon=epsilon,
        source=source,
        reference_batch_size=reference_batch_size,
    )
    run.eta_step  # noqa: B018  (validates B, sigma, N > 0)
    return run


def load_runs(workdirs) -> tuple[list[RunSummary], list[tuple[str, str]]]:
    """Reads many workdirs, skipping those that cannot be used.

    Runs are labelled by the workdir's base name when the base names are
    unique, else by the path.

    Args:
      workdirs: run directories (strings).

    Returns:
      (runs, skipped): the RunSummary of each usable workdir, and one
      (workdir, reason) pair per skipped one.
    """
    workdirs = [os.path.normpath(w) for w in workdirs]
    basenames = [os.path.basename(w) for w in workdirs]
    unique = len(set(basenames)) == len(basenames)
    runs, skipped = [], []
    for workdir, basename in zip(workdirs, basenames):
        try:
            runs.append(load_run(workdir, name=basename if unique else workdir))
        except (OSError, ValueError, SyntaxError) as e:
            skipped.append((workdir, " ".join(str(e).split())))
    return runs, skipped


def group_runs(runs, *, rel_tol: float = 1e-3) -> list[list[RunSummary]]:
    """Groups runs at constant (eta_step, num_steps), as in TAN Sec. 3.4.

    Runs are sorted by (num_steps, eta_step); a group holds runs with the same
    num_steps whose eta_step is within `rel_tol` (relative) of the group's
    smallest eta_step. Within a group, runs are sorted by batch_size.

    Args:
      runs: RunSummary objects.
      rel_tol: relative tolerance on eta_step, >= 0.

    Returns:
      The groups (lists of RunSummary), by increasing (num_steps, eta_step).

    Raises:
      ValueError: if rel_tol is negative.
    """
    if not (rel_tol >= 0 and math.isfinite(rel_tol)):
        raise ValueError(f"rel_tol must be a finite number >= 0, got {rel_tol!r}.")
    groups = []
    for run in sorted(runs, key=lambda r: (r.num_steps, r.eta_step)):
        anchor = groups[-1][0] if groups else None
        if (
            anchor is not None
            and anchor.num_steps == run.num_steps
            and run.eta_step <= anchor.eta_step * (1 + rel_tol)
        ):
            groups[-1].append(run)
        else:
            groups.append([run])
    return [sorted(g, key=lambda r: (r.batch_size, r.name)) for g in groups]


def fit_scaling_law(
    batch_sizes, accuracies, *, reference_batch_size: float, confidence: float = 0.95
) -> ScalingLawFit:
    """Fits accuracy = intercept + slope * log2(batch_size) (TAN Fig. 1, Fig. 4).

    Ordinary least squares (scipy.stats.linregress) on x = log2(batch_size).
    The prediction interval at x0 = log2(B_ref) is

        yhat(x0) +- t_{(1 + confidence) / 2, n - 2} * s * sqrt(1 + 1/n + (x0 - xbar)^2 / Sxx)

    with s^2 = (sum of squared residuals) / (n - 2): it covers a NEW run at
    B_ref, not only the mean (TAN Fig. 1 shades 2 std over three runs).

    >>> fit = fit_scaling_law([256, 512, 1024], [0.70, 0.68, 0.66],
    ...                       reference_batch_size=4096)
    >>> round(fit.slope, 6), round(fit.prediction, 6)  # 0.66 - 2 * 0.02
    (-0.02, 0.62)

    Args:
      batch_sizes: float [n] expected batch sizes (> 0), at least 2 distinct.
      accuracies: float [n] accuracies, in the same order.
      reference_batch_size: B_ref (> 0), where the fit is evaluated.
      confidence: level of the prediction interval, in (0, 1).

    Returns:
      A ScalingLawFit (slope per doubling of the batch size).

    Raises:
      ValueError: if the lengths differ, a value is not finite, a batch size
        is not > 0, there are fewer than 2 distinct batch sizes, or
        confidence is outside (0, 1).
    """
    x_b = np.asarray(batch_sizes, dtype=np.float64).reshape(-1)
    y = np.asarray(accuracies, dtype=np.float64).reshape(-1)
    if x_b.shape != y.shape:
        raise ValueError(
            f"batch_sizes and accuracies must have the same length, got {x_b.size} and {y.size}."
        )
    if not (np.all(np.isfinite(x_b)) and np.all(x_b > 0)):
        raise ValueError(f"batch sizes must be finite and > 0, got {x_b.tolist()}.")
    if not np.all(np.isfinite(y)):
        raise ValueError(f"accuracies must be finite, got {y.tolist()}.")
    if not _is_positive(reference_batch_size):
        raise ValueError(f"reference_batch_size must be > 0, got {reference_batch_size!r}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    num_batch_sizes = len(np.unique(x_b))
    if num_batch_sizes < 2:
        raise ValueError(
            f"the scaling-law fit needs runs at at least 2 distinct batch sizes, got "
            f"{num_batch_sizes} ({sorted(set(x_b.tolist()))}); add runs at other batch "
            f"sizes with the same eta_step and num_steps (sigma = sigma_ref * B / B_ref, "
            f"TAN Sec. 3.4)."
        )
    x = np.log2(x_b)
    n = x.size
    result = stats.linregress(x, y)
    slope, intercept = float(result.slope), float(result.intercept)
    residuals = y - (intercept + slope * x)
    sse = float(residuals @ residuals)
    sst = float(((y - y.mean()) ** 2).sum())
    r_squared = 1.0 - sse / sst if sst > 0 else math.nan
    x0 = math.log2(reference_batch_size)
    prediction = intercept + slope * x0
    dof = n - 2
    interval, slope_stderr, s = None, math.nan, math.nan
    if dof >= 1:
        s = math.sqrt(sse / dof)
        sxx = float(((x - x.mean()) ** 2).sum())
        slope_stderr = s / math.sqrt(sxx)
        half_width = (
            stats.t.ppf((1 + confidence) / 2, dof)
            * s
            * math.sqrt(1 + 1 / n + (x0 - x.mean()) ** 2 / sxx)
        )
        interval = (prediction - half_width, prediction + half_width)
    return ScalingLawFit(
        slope=slope,
        intercept=intercept,
        r_squared=r_squared,
        slope_stderr=slope_stderr,
        residual_std=s,
        num_points=n,
        num_batch_sizes=num_batch_sizes,
        reference_batch_size=float(reference_batch_size),
        prediction=prediction,
        interval=interval,
        confidence=confidence,
        dof=dof,
    )


def prediction_band(fit: ScalingLawFit, batch_sizes_fitted, batch_sizes) -> np.ndarray | None:
    """Prediction-interval half widths of `fit` at `batch_sizes` (for plots).

    Args:
      fit: the fit of the points at `batch_sizes_fitted`.
      batch_sizes_fitted: float [n] batch sizes the fit used.
      batch_sizes: float [m] batch sizes where to evaluate.

    Returns:
      float64 [m] half widths, or None when fit.dof < 1.
    """
    if fit.dof < 1:
        return None
    x = np.log2(np.asarray(batch_sizes_fitted, dtype=np.float64))
    x_new = np.log2(np.asarray(batch_sizes, dtype=np.float64))
    sxx = float(((x - x.mean()) ** 2).sum())
    t = stats.t.ppf((1 + fit.confidence) / 2, fit.dof)
    return t * fit.residual_std * np.sqrt(1 + 1 / x.size + (x_new - x.mean()) ** 2 / sxx)


def split_reference_runs(group, reference_batch_size):
    """Splits a group into (runs to fit, held-out runs at B_ref) (TAN Fig. 1)."""
    held_out = [r for r in group if math.isclose(r.batch_size, reference_batch_size)]
    return [r for r in group if r not in held_out], held_out


def format_table(groups, fits, reference_batch_size: float, metric: str) -> str:
    """Plain-text table of the runs and of each group's fit.

    Args:
      groups: lists of RunSummary (from `group_runs`).
      fits: one ScalingLawFit, or a str saying why there is none, per group.
      reference_batch_size: B_ref.
      metric: "final" or "max".

    Returns:
      The table (str, ends with a newline).
    """
    _check_metric(metric)
    lines = [
        "TAN batch scaling law (Sander et al. 2023, Sec. 3.4, Fig. 1 and 4): "
        "accuracy = intercept + slope * log2(batch_size)",
        f"accuracy: {_METRIC_DESCRIPTIONS[metric]}",
        "groups: runs with the same num_steps and eta_step = batch_size / "
        "(sqrt(2) * num_examples * noise_multiplier) (TAN Sec. 3.1)",
        f"reference batch size B_ref = {reference_batch_size:g}; runs at B_ref are held "
        "out of the fit",
    ]
    columns = ("run", "batch_size", "noise_multiplier", "num_steps", "eta_step", "epsilon",
               "accuracy")
    for index, (group, fit) in enumerate(zip(groups, fits), start=1):
        first = group[0]
        lines += [
            "",
            f"group {index}: eta_step = {first.eta_step:.4g}, num_steps = {first.num_steps}, "
            f"num_examples = {first.num_examples}, {len(group)} runs",
        ]
        rows = [
            (
                run.name,
                f"{run.batch_size:g}",
                f"{run.noise_multiplier:.4g}",
                f"{run.num_steps}",
                f"{run.eta_step:.4g}",
                "-" if run.epsilon is None else f"{run.epsilon:.3g}",
                f"{run.accuracy(metric):.4f}",
            )
            for run in group
        ]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        if isinstance(fit, str):
            lines.append(f"no fit: {fit}")
            continue
        stderr = "n/a with 2 points" if math.isnan(fit.slope_stderr) else f"{fit.slope_stderr:.3g}"
        r_squared = "n/a" if math.isnan(fit.r_squared) else f"{fit.r_squared:.4f}"
        lines.append(
            f"fit: slope = {fit.slope:+.4f} per doubling of batch_size (stderr {stderr}), "
            f"intercept = {fit.intercept:.4f}, R^2 = {r_squared}, {fit.num_points} runs at "
            f"{fit.num_batch_sizes} batch sizes"
        )
        level = f"{100 * fit.confidence:g}%"
        if fit.interval is None:
            interval = (
                f"no {level} prediction interval: 2 runs leave no degree of freedom to "
                "estimate the noise; add a third run"
            )
        else:
            interval = (
                f"{level} prediction interval [{fit.interval[0]:.4f}, {fit.interval[1]:.4f}] "
                f"(Student t, {fit.dof} dof)"
            )
        lines.append(
            f"prediction at B_ref = {reference_batch_size:g}: accuracy {fit.prediction:.4f}, "
            f"{interval}"
        )
        _, held_out = split_reference_runs(group, reference_batch_size)
        for run in held_out:
            verdict = ""
            if fit.interval is not None:
                inside = fit.interval[0] <= run.accuracy(metric) <= fit.interval[1]
                verdict = " (inside the interval)" if inside else " (OUTSIDE the interval)"
            lines.append(
                f"observed at B_ref: {run.name} accuracy {run.accuracy(metric):.4f}{verdict}"
            )
    return "\n".join(lines) + "\n"


def plot_scaling_law(groups, fits, reference_batch_size: float, metric: str, path: str) -> None:
    """Writes the scaling-law plot (PNG, 500x350 pixels) to `path`.

    Per group: fitted runs (crosses), fitted line over log2(batch_size) up to
    B_ref, shaded prediction interval, prediction at B_ref with its interval
    (error bar) and held-out runs at B_ref (stars), as TAN Fig. 1 and Fig. 4.

    Args:
      groups: lists of RunSummary (from `group_runs`).
      fits: one ScalingLawFit, or a str (no fit), per group.
      reference_batch_size: B_ref.
      metric: "final" or "max".
      path: output PNG file.
    """
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    ax = fig.subplots()
    all_batch_sizes = {reference_batch_size}
    for index, (group, fit) in enumerate(zip(groups, fits)):
        color = f"C{index % 10}"
        fitted, held_out = split_reference_runs(group, reference_batch_size)
        b = np.array([r.batch_size for r in fitted], dtype=np.float64)
        all_batch_sizes.update(b.tolist())
        label = rf"$\eta_\mathrm{{step}}$={group[0].eta_step:.3g}, S={group[0].num_steps}"
        if not isinstance(fit, str):
            label += f": {fit.slope:+.3f}/doubling"
        ax.plot(b, [r.accuracy(metric) for r in fitted], "x", color=color, label=label)
        if held_out:
            ax.plot(
                [r.batch_size for r in held_out],
                [r.accuracy(metric) for r in held_out],
                "*",
                color=color,
                markersize=10,
            )
        if isinstance(fit, str):
            continue
        grid = np.geomspace(min(b.min(), reference_batch_size), max(b.max(), reference_batch_size))
        line = fit.intercept + fit.slope * np.log2(grid)
        ax.plot(grid, line, "--", color=color, linewidth=1)
        band = prediction_band(fit, b, grid)
        if band is not None:
            ax.fill_between(grid, line - band, line + band, color=color, alpha=0.15, linewidth=0)
            low, high = fit.interval
            yerr = [[fit.prediction - low], [high - fit.prediction]]
        else:
            yerr = None
        ax.errorbar(
            [reference_batch_size], [fit.prediction], yerr=yerr, fmt="o", color=color,
            capsize=3, markersize=4,
        )
    ax.axvline(reference_batch_size, color="0.6", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ticks = sorted(all_batch_sizes)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel(f"batch size (log2 scale); B_ref = {reference_batch_size:g}", fontsize=8)
    ax.set_ylabel(f"{metric} test accuracy", fontsize=8)
    ax.set_title(r"TAN scaling law at constant $\eta_\mathrm{step}$ and steps", fontsize=9)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)


def plot_accuracy_vs_epsilon(records, path: str, *, title: str = "") -> None:
    """Writes test (and train) accuracy against epsilon over one run to `path`.

    Args:
      records: dicts of metrics.jsonl (from `read_metrics`), sorted by step.
      path: output PNG file (500x350 pixels).
      title: plot title (e.g. the run name).

    Raises:
      ValueError: if no record has both a finite epsilon and test_accuracy.
    """
    points = {"test_accuracy": [], "train_accuracy": []}
    for record in records:
        eps = record.get("epsilon")
        if not _is_finite(eps):
            continue
        for key, values in points.items():
            if _is_finite(record.get(key)):
                values.append((eps, record[key]))
    if not points["test_accuracy"]:
        raise ValueError(
            f"no evaluation in {METRICS_FILE} has both a finite epsilon and test_accuracy."
        )
    delta = next((r["delta"] for r in records if _is_finite(r.get("delta"))), None)
    fig = Figure(figsize=_FIGSIZE, dpi=_DPI)
    ax = fig.subplots()
    for key, style in (("test_accuracy", "o-"), ("train_accuracy", "s--")):
        if points[key]:
            eps, acc = zip(*points[key])
            ax.plot(eps, acc, style, markersize=3, linewidth=1, label=key.replace("_", " "))
    ax.set_xlabel("epsilon" + (f" (delta = {delta:.3g})" if delta is not None else ""), fontsize=8)
    ax.set_ylabel("accuracy", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)


def _fit(args):
    runs, skipped = load_runs(args.workdirs)
    for workdir, reason in skipped:
        print(f"scaling_law.py fit: warning: skipping {workdir}: {reason}", file=sys.stderr)
    if not runs:
        raise ValueError(
            "none of the workdirs holds a usable finished run (metrics.jsonl plus "
            f"{REPORT_JSON}, or {OPERATIVE_CONFIG} of a run that reached NUM_STEPS)."
        )
    reference_batch_size = args.reference_batch_size
    if reference_batch_size is None:
        references = {r.reference_batch_size for r in runs if r.reference_batch_size}
        if len(references) != 1:
            raise ValueError(
                "pass --reference_batch_size B_REF (the runs' privacy reports name "
                f"{len(references)} distinct reference batch sizes: {sorted(references)})."
            )
        (reference_batch_size,) = references
    groups = group_runs(runs, rel_tol=args.rel_tol)
    fits = []
    for group in groups:
        fitted, _ = split_reference_runs(group, reference_batch_size)
        try:
            fits.append(
                fit_scaling_law(
                    [r.batch_size for r in fitted],
                    [r.accuracy(args.metric) for r in fitted],
                    reference_batch_size=reference_batch_size,
                )
            )
        except ValueError as e:
            fits.append(" ".join(str(e).split()))
    table = format_table(groups, fits, reference_batch_size, args.metric)
    _write_outputs(args.out, table=table)
    plot_scaling_law(groups, fits, reference_batch_size, args.metric, args.out + ".png")
    print(table, end="")
    print(f"wrote {args.out}.png and {args.out}.txt")
    if all(isinstance(fit, str) for fit in fits):
        raise ValueError(
            f"no group could be fitted: each needs runs at at least 2 distinct batch sizes "
            f"(besides B_ref) with the same eta_step and num_steps; see {args.out}.txt."
        )


def _curve(args):
    workdir = os.path.normpath(args.workdir)
    records = read_metrics(workdir)
    title = os.path.basename(workdir)
    report_path = os.path.join(workdir, REPORT_JSON)
    if os.path.isfile(report_path):
        with open(report_path) as f:
            if (json.load(f) or {}).get("simulation"):
                title += " (TAN simulation: its own epsilon)"
    _write_outputs(args.out)
    plot_accuracy_vs_epsilon(records, args.out + ".png", title=title)
    last = records[-1]
    print(
        f"{title}: {len(records)} evaluations; last: step {last['step']}, epsilon "
        f"{last.get('epsilon', float('nan')):.4g}, test_accuracy "
        f"{last.get('test_accuracy', float('nan')):.4f}"
    )
    print(f"wrote {args.out}.png")


def _write_outputs(prefix, table=None):
    directory = os.path.dirname(prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    if table is not None:
        with open(prefix + ".txt", "w") as f:
            f.write(table)


def _check_metric(metric):
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}.")


def _is_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_positive(value):
    return _is_finite(value) and value > 0


def build_parser() -> argparse.ArgumentParser:
    """Returns the argparse parser of the CLI (subcommands fit and curve)."""
    parser = argparse.ArgumentParser(
        prog="scaling_law.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fit", help="scaling-law fit at constant eta_step and num_steps")
    p.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="finished run directories")
    p.add_argument(
        "--reference_batch_size",
        type=float,
        default=None,
        help="B_ref, where to predict the accuracy (default: the reference_batch_size of "
        "the runs' privacy_report.json 'simulation', if they agree)",
    )
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.png, PREFIX.txt")
    p.add_argument(
        "--metric",
        choices=METRICS,
        default="final",
        help="final: last evaluation (default); max: best over evaluations (Tramer & Boneh)",
    )
    p.add_argument(
        "--rel_tol",
        type=float,
        default=1e-3,
        help="relative tolerance on eta_step within a group (default 1e-3)",
    )
    p.set_defaults(func=_fit)

    p = sub.add_parser("curve", help="accuracy against epsilon over one run")
    p.add_argument("workdir", metavar="WORKDIR")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.png")
    p.set_defaults(func=_curve)
    return parser


def main(argv=None) -> int:
    """Runs the CLI; returns the exit status (0, or 2 on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())
        print(f"scaling_law.py {args.command}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
