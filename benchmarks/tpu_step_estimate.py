"""WRN-16-4's DP step on one TPU chip, estimated, if each conv kernel took a given per-layer form.

Reads the JSON lines of `tpu_layer_forms.py` (per layer shape and chunk size n: the TPU
program's GFLOP, GB accessed and estimated cycles of each form) and adds, for a batch of B
examples cut into B / n chunks, what the DP step does beyond the plain step:

  DP = plain step + sum over WRN-16-4's convs of (B / n) x NORMS(layer, n)

where NORMS is a norms form (the per-example gradients of a chunk built and squared, then
dropped: `norm_slices`, `norm_shifts`, `norm_grouped`; or the Gram form `gram`), and the clipped
sum is the book-keeping one (`w2`: the plain kernel gradient of the factor-scaled output
gradients), which replaces the plain step's kernel gradient one for one (its figures are the
plain kernel gradient's, so it adds nothing here). `best_GFLOP` / `best_Mcycles` take, per
layer, the direct norms form measured (slices, shifts, grouped, loop; `--best_of`) with the
fewest flops / estimated cycles. `gram` is measured at one pass (DEFAULT): the exact Gram
form costs ~6x its cycles.
With `--sum FORM` the clipped sum is FORM instead (`w2_ws`: book-keeping, then weight
standardization's projection of the sum; `sum_each`, `sum_each_ws_pre`: each example's vector
built again and accumulated, as the recompute does), and what FORM costs above the plain
kernel gradient of the same images is added too:

  DP = plain step + sum over convs of (B / n) x (NORMS(layer, n) + SUM(layer, n) - plain(layer, n))

The plain step's own figures are given on the command line (from `tpu_cost.py` /
`tpu_hlo_ops.py` on the exported plain step). Not counted: the classifier, biases and
GroupNorm scales (tiny) and the noise. Over-counted: each form's bytes include reading its
x and g, which the step reads anyway. The weighted sum is taken at one pass, as measured.

Usage:
  python benchmarks/tpu_step_estimate.py OUT.jsonl... --batch 32 --chunk 8
      --plain GFLOP,GB,MCYCLES [--forms norm_slices,norm_shifts,norm_grouped,gram,best_GFLOP]
      [--sum w2_ws] [--views K]
No JAX needed.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_hlo_ops  # noqa: E402

# WRN-16-4 (32x32 inputs): how many convs of each shape (`tpu_layer_forms.LAYERS`)
COUNT = {"stem_3x3_3_16": 1, "s1_3x3_16_64": 1, "s1_3x3_64_64": 3, "s1_1x1_16_64": 1,
         "s2_3x3s2_64_128": 1, "s2_3x3_128_128": 3, "s2_1x1s2_64_128": 1,
         "s3_3x3s2_128_256": 1, "s3_3x3_256_256": 3, "s3_1x1s2_128_256": 1}
KEYS = ("GFLOP", "GB", "Mcycles")


def load(paths, precision="DEFAULT", views=1):
    """{(layer, n, form): record}, the last record of each (DEFAULT precision, K = views)."""
    out = {}
    for r in tpu_hlo_ops.json_records(paths):
        if "layer" in r and "error" not in r and r["precision"] == precision and r["K"] == views:
            out[r["layer"], r["n"], r["form"]] = r
    return out


DIRECT = ("norm_slices", "norm_shifts", "norm_grouped", "norm_loop")


def estimate(data, batch, chunk, form, forms_allowed=DIRECT, sum_form=None):
    """(totals {key: value}, per-layer rows) of the DP step's extra for one norms form.

    With `sum_form`, each layer also adds that clipped-sum form's figures less the plain
    kernel gradient's (a layer missing either is missing).
    """
    totals = {k: 0.0 for k in KEYS}
    rows = []
    for layer, count in COUNT.items():
        best = form.startswith("best_")
        candidates = ([f for f in DIRECT if f in forms_allowed] if best else [form])
        have = [f for f in candidates if (layer, chunk, f) in data
                and data[layer, chunk, f].get("Mcycles") is not None]
        summed = sum_form is None or all((layer, chunk, f) in data for f in (sum_form, "plain"))
        if not have or not summed:
            rows.append((layer, None, None))
            continue
        by = form[5:] if best else "Mcycles"
        f = min(have, key=lambda f: (data[layer, chunk, f][by], data[layer, chunk, f]["Mcycles"]))
        r = data[layer, chunk, f]
        extra = {k: count * (batch // chunk) * r[k] for k in KEYS}
        if sum_form is not None:
            above = {k: data[layer, chunk, sum_form][k] - data[layer, chunk, "plain"][k]
                     for k in KEYS}
            extra = {k: extra[k] + count * (batch // chunk) * above[k] for k in KEYS}
        for k in KEYS:
            totals[k] += extra[k]
        rows.append((layer, f, extra))
    return totals, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--plain", required=True, help="GFLOP,GB,MCYCLES of the plain step")
    ap.add_argument("--forms",
                    default="norm_slices,norm_shifts,norm_grouped,norm_loop,gram,"
                    "best_GFLOP,best_Mcycles")
    ap.add_argument("--best_of", default=",".join(DIRECT))
    ap.add_argument("--sum", default=None,
                    help="the clipped sum's form (default: book-keeping, counted as free)")
    ap.add_argument("--views", type=int, default=1, help="K, augmult views per example")
    args = ap.parse_args()
    plain = dict(zip(KEYS, (float(v) for v in args.plain.split(","))))
    data = load(args.files, views=args.views)
    print(f"WRN-16-4, B = {args.batch} x K = {args.views}, chunks of {args.chunk}; clipped sum "
          f"{args.sum or 'w2 (free)'}; plain step " + ", ".join(f"{plain[k]:g} {k}" for k in KEYS))
    print("| norms form | DP GFLOP (x plain) | DP GB (x plain) | DP Mcycles (x plain) | missing |")
    print("|---|---|---|---|---|")
    for form in args.forms.split(","):
        totals, rows = estimate(data, args.batch, args.chunk, form, args.best_of.split(","),
                                args.sum)
        missing = [layer for layer, f, _ in rows if f is None]
        cells = [f"{plain[k] + totals[k]:.4g} ({(plain[k] + totals[k]) / plain[k]:.2f}x)"
                 if not missing else "(incomplete)" for k in KEYS]
        print(f"| {form} | " + " | ".join(cells) + f" | {','.join(missing) or '-'} |")
        if form.startswith("best_") and not missing:
            for layer, f, extra in rows:
                if f is not None:
                    print(f"|   {layer} x{COUNT[layer]}: {f} | "
                          + " | ".join(f"+{extra[k]:.3g}" for k in KEYS) + " | |")


if __name__ == "__main__":
    main()
