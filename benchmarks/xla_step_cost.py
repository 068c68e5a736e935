"""XLA's cost of tfdp's compiled DP step against the plain step: flops, bytes, temp memory, time.

TensorFlow compiles both steps with XLA (`jit_compile=True`);
JAX compiles the same HLO anywhere, and XLA's cost analysis of the compiled
program (flops, bytes accessed, temporary buffers) is a device-independent
proxy for what the DP step costs on an accelerator relative to the plain
step (on an H200, the time ratio is near the bytes ratio:
docs/design/step_cost.md). This script, in tfdp's environment (pure
TensorFlow, no JAX), exports for every case

  - `CASE_plain`: the plain Keras step (`model.train_step`, SGD, mean
    cross-entropy), traced with `jit_compile=True`;
  - `CASE_dp`: `DPModel.train_step` exactly as `DPModel.compile(jit_compile=True)`
    runs it (clipping="auto", which the trainer uses: ghost norms; C = 1,
    sigma = 1, SGD), its ghost rules planned for `--plan` (default `tf32`:
    the plan of an Ampere-or-newer GPU, whose exact products are split into
    bf16 pieces; `host`: this machine's own plan, a CPU's float32);

as `OUT/NAME.hlo.pb` (the HloModuleProto TensorFlow compiles), `OUT/NAME.npz`
(the entry parameters in order: arguments, then the variables' values) and
`OUT/NAME.json`, then runs `benchmarks/xla_step_cost_jax.py` in the side
interpreter `--jax_python` (a venv with JAX: `python3 -m venv /tmp/vjax &&
/tmp/vjax/bin/pip install jax==0.10.2 jaxlib==0.10.2`; tfdp's own environment
never gets JAX), as `vs_opacus.py` runs Opacus in `--opacus_python`. That
script compiles each HLO on JAX's default backend (CPU here; a GPU where the
side interpreter has CUDA JAX), reports XLA's cost and memory analysis and,
with `--replay_seconds S > 0`, times the step as a training loop (updated
variables fed back). The table gives DP / plain ratios beside the issue's
targets (<= 1.6x flops, <= 2x bytes, <= 1.5x temp memory).

    python benchmarks/xla_step_cost.py --jax_python=/tmp/vjax/bin/python \\
        --cases=wrn16_4:32,wrn16_4:128,nf_resnet50:8@224 --out_dir=/tmp/xla_cost

Where the DP step recomputes per-example gradients in while loops over
chunks of the batch (a GPU's or TPU's plan, `ghost_norms._recomputed`),
XLA's cost analysis counts a loop's body once, not once per trip: the case
is then also exported with half as many chunks (`CASE_dp_coarse`), and the
flops and bytes in the table are the step's with every trip counted
(`loop_corrected`; the reported ones are printed beside them). Temp memory
is the default chunking's, as XLA assigns it.

A case is MODEL:B or MODEL:B@RES (square input RES x RES): MODEL one of
`wrn16_4` (WRN-16-4, GroupNorm + WS, 32x32x3, 10 classes), `nf_resnet50`
(NF-ResNet-50, 224x224x3, 1000 classes), `tramer_cnn` (28x28x1; tiny, for
tests). `--export_only` writes the files and stops (no side interpreter).
`--layers` (analysis) instead exports, for every kernel of
the case's model, the ghost rule tfdp's DP step runs for it on that layer's
shapes (`ghost_norms.ws_kernel_sq_norms` / `kernel_sq_norms` on the layer's
patches: its norms and its weighted sum with unit factors) and prints XLA's
flops per layer beside the plain step's ~3 x 2 B T p d for that kernel and
the two forms' estimates (Gram ~ B T^2 (p + d), direct ~ B T p d); see
`layer_table`. `--form=direct|gram|bu` (analysis only, never a training
setting) replaces `ghost_norms.choose_form` in this process, for the steps or
the layers: every kernel in the direct form, in the Gram form, or as Bu et
al. 2022's mixed ghost clipping chooses (direct where 2 T^2 > p d).
"""

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time

TARGETS = {"flops": 1.6, "bytes": 2.0, "temp": 1.5}  # DP / plain at most
SHAPES = {"wrn16_4": (32, 3, 10), "nf_resnet50": (224, 3, 1000), "tramer_cnn": (28, 1, 10)}
JAX_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_step_cost_jax.py")


def parse_case(case):
    """'wrn16_4:32' or 'nf_resnet50:8@224' -> (model, batch, resolution, name)."""
    model, rest = case.split(":")
    batch, _, res = rest.partition("@")
    if model not in SHAPES:
        raise ValueError(f"unknown model {model!r} (one of {sorted(SHAPES)})")
    res = int(res) if res else SHAPES[model][0]
    name = f"{model}_b{batch}" + (f"_r{res}" if res != SHAPES[model][0] else "")
    return model, int(batch), res, name


def build_model(model_name, res):
    from tfdp import models
    _, channels, classes = SHAPES[model_name]
    shape = (res, res, channels)
    if model_name == "wrn16_4":
        return models.build_wide_resnet(16, 4, classes, input_shape=shape)
    if model_name == "nf_resnet50":
        return models.build_nf_resnet(50, classes, input_shape=shape)
    return models.build_tramer_cnn(classes, input_shape=shape)


def set_plan(plan):
    """The device the ghost rules plan for (`precision.device_inputs`): tf32, bf16 or host."""
    from tfdp.dp import precision
    if not hasattr(set_plan, "real"):
        set_plan.real = precision.device_inputs
    if plan == "tf32":
        precision.device_inputs = lambda: precision.TF32
    elif plan == "bf16":
        precision.device_inputs = lambda: precision.BF16
    else:
        precision.device_inputs = set_plan.real


def set_form(form):
    """ANALYSIS ONLY (never a training setting): every kernel rule takes `form` ("direct" or
    "gram"), or Bu et al. 2022's mixed ghost clipping's pick ("bu": direct where 2 R^2 > fan_in
    fan_out, else Gram), instead of `ghost_norms.choose_form`'s ("auto"), in this process."""
    from tfdp.dp import ghost_norms
    if not hasattr(set_form, "real"):
        set_form.real = ghost_norms.choose_form
    if form == "auto":
        ghost_norms.choose_form = set_form.real
    elif form == "bu":
        ghost_norms.choose_form = lambda rows, fan_in, fan_out, *_: (
            ghost_norms.DIRECT if rows is None or 2 * rows * rows > fan_in * fan_out
            else ghost_norms.GRAM)
    else:
        ghost_norms.choose_form = lambda rows, fan_in, fan_out, *_: form


def batch_of(model_name, batch, res, seed=0):
    import numpy as np
    _, channels, classes = SHAPES[model_name]
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 255, (batch, res, res, channels)).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int32)
    return x, y


def write_step(out_dir, name, fn, args, extra=None):
    """Traces `fn(*args)` (a jit_compile tf.function) and writes NAME.hlo.pb, NAME.npz, NAME.json.

    The entry parameters of TensorFlow's HLO are the arguments, then the
    captured inputs (variables' values, read before the step runs) in order.
    """
    import numpy as np
    import tensorflow as tf
    start = time.time()
    concrete = fn.get_concrete_function(*args)
    proto = fn.experimental_get_compiler_ir(*args)(stage="hlo_serialized")
    by_handle = {id(v.handle): v for v in concrete.graph.variables}
    values = [np.asarray(a) for a in args]
    for captured in concrete.captured_inputs:
        if captured.dtype == tf.resource:
            variable = by_handle.get(id(captured))
            if variable is None:
                raise ValueError(f"{name}: a captured resource is no variable of the step")
            values.append(np.asarray(variable.numpy()))
        else:
            values.append(np.asarray(captured.numpy()))
    with open(os.path.join(out_dir, f"{name}.hlo.pb"), "wb") as f:
        f.write(proto)
    np.savez(os.path.join(out_dir, f"{name}.npz"), **{f"p{i}": v for i, v in enumerate(values)})
    meta = {"name": name, "n_params": len(values), "n_args": len(args),
            "param_MB": round(sum(v.nbytes for v in values) / 1e6, 1),
            "hlo_bytes": len(proto), "export_s": round(time.time() - start, 1), **(extra or {})}
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(meta, f)
    return meta


def export_case(case, out_dir, plan="tf32"):
    """Writes CASE_plain and CASE_dp (see the module docstring); returns their names and metadata."""
    import keras
    import tensorflow as tf
    from tfdp import accounting
    from tfdp.dp import ghost_norms
    from tfdp.training.dp_model import DPModel
    model_name, batch, res, name = parse_case(case)
    os.makedirs(out_dir, exist_ok=True)
    set_plan(plan)
    x, y = batch_of(model_name, batch, res)
    metas = []
    # plain: Keras' own train_step, as model.compile(jit_compile=True) runs it
    keras.utils.set_random_seed(0)
    model = build_model(model_name, res)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fn = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
    metas.append(write_step(out_dir, f"{name}_plain", fn, (tf.constant(x), tf.constant(y)),
                            {"case": case, "kind": "plain", "batch": batch}))
    # DP: DPModel.train_step on (x, y, mask), clipping="auto" as the trainer chooses
    keras.utils.set_random_seed(0)
    model = build_model(model_name, res)
    mechanism = accounting.DPMechanism(num_examples=60000, batch_size=batch, num_steps=1000,
                                       noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5)
    dp = DPModel(model, mechanism, clipping="auto", noise_seed=0)
    dp.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
    fn = tf.function(lambda x, y, m: dp.train_step((x, y, m)), jit_compile=True)
    args = (tf.constant(x), tf.constant(y), tf.ones([batch]))
    chunks = ghost_norms.recompute_chunk_count(batch) if ghost_norms.recomputed_gradients() else 1
    metas.append(write_step(out_dir, f"{name}_dp", fn, args,
                            {"case": case, "kind": "dp", "batch": batch,
                             "clipping_path": dp.clipping_path, "plan": plan,
                             "recompute_chunks": chunks}))
    if chunks > 1:
        # XLA's cost analysis counts a while loop's body once (HloCostAnalysis::HandleWhile),
        # whatever its trip count: the same step with coarser chunks gives the loops' work.
        saved = ghost_norms.RECOMPUTE_CHUNKS
        ghost_norms.RECOMPUTE_CHUNKS = chunks // 2
        try:
            coarse = ghost_norms.recompute_chunk_count(batch)
            fn = tf.function(lambda x, y, m: dp.train_step((x, y, m)), jit_compile=True)
            metas.append(write_step(out_dir, f"{name}_dp_coarse", fn, args,
                                    {"case": case, "kind": "dp_coarse", "batch": batch,
                                     "plan": plan, "recompute_chunks": coarse}))
        finally:
            ghost_norms.RECOMPUTE_CHUNKS = saved
    return metas


def loop_corrected(dp, coarse, chunks, coarse_chunks):
    """The DP step's flops and bytes with its recompute loops' bodies counted once per trip.

    XLA reports `A + W / n` for a step whose recompute loops do work W in n
    trips (the body of n-th the batch counted once); two chunkings n > n'
    give W = (R(n') - R(n)) / (1/n' - 1/n), and the step's cost is A + W.
    The loops' per-trip constants (the weighted sum's [O, F] accumulator,
    about 8 bytes per recomputed parameter per trip) are in A, counted once.
    """
    out = dict(dp)
    for key in ("GFLOP", "GB_accessed"):
        work = (coarse[key] - dp[key]) / (1.0 / coarse_chunks - 1.0 / chunks)
        out[key] = dp[key] + work * (1.0 - 1.0 / chunks)
        out[f"{key}_reported"] = dp[key]
    return out


# -- Per-layer analysis ---------------------------------------------------


def kernel_layers(model, res):
    """[(layer, input shape, output shape)] of every Conv2D / Dense kernel of a functional model.

    Shapes as Keras' functional graph records them; a layer without one (called more than once,
    or inside a subclassed model) is left out of the table.
    """
    import keras
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)) and hasattr(layer, "kernel"):
            try:
                inp, out = layer.input.shape, layer.output.shape
            except Exception:  # pylint: disable=broad-except
                continue
            found.append((layer, tuple(inp), tuple(out)))
    return found


def _layer_rule(layer, is_conv, ws, batch):
    """`rule(a, g)`: the layer's ghost rule on input `a` and output gradient `g`: (norms, weighted sum)."""
    import tensorflow as tf
    from tfdp.dp import ghost_norms

    def rule(a, g):
        if is_conv:
            rows = ghost_norms.conv2d_patches(a, kernel_size=layer.kernel_size,
                                              strides=layer.strides,
                                              dilation_rate=layer.dilation_rate,
                                              padding=layer.padding)
        else:
            rows = ghost_norms.Rows.of(a)
        if ws:
            squares, weighted = ghost_norms.ws_kernel_sq_norms(rows, g, layer.kernel,
                                                               epsilon=layer.epsilon)
        else:
            squares, weighted = ghost_norms.kernel_sq_norms(rows, g)
        return squares, weighted(tf.ones([batch]))
    return rule


def export_layers(case, out_dir, plan="tf32", first=None):
    """For every kernel of the case's model (the `first` ones): its DP ghost rule on its shapes."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tfdp.dp import ghost_norms
    from tfdp.models import ws_conv2d
    model_name, batch, res, name = parse_case(case)
    os.makedirs(out_dir, exist_ok=True)
    set_plan(plan)
    keras.utils.set_random_seed(0)
    model = build_model(model_name, res)
    rng = np.random.default_rng(0)
    metas = []
    for index, (layer, in_shape, out_shape) in enumerate(kernel_layers(model, res)[:first]):
        kernel = layer.kernel
        is_conv = isinstance(layer, keras.layers.Conv2D)
        ws = isinstance(layer, ws_conv2d.WSConv2D)
        a = tf.constant(rng.normal(size=(batch, *in_shape[1:])).astype(np.float32))
        g = tf.constant(rng.normal(size=(batch, *out_shape[1:])).astype(np.float32) * 1e-3)
        fn = tf.function(_layer_rule(layer, is_conv, ws, batch), jit_compile=True)
        t = math.prod(out_shape[1:-1])
        p, d = math.prod(kernel.shape[:-1]), kernel.shape[-1]
        form = getattr(set_form, "real", ghost_norms.choose_form)(t, p, d, ws)  # tfdp's own pick
        meta = write_step(out_dir, f"{name}_layer{index:02d}", fn, (a, g), {
            "layer": layer.name, "T": t, "p": p, "d": d, "ws": ws, "tfdp_form": form,
            "rule_form": ghost_norms.choose_form(t, p, d, ws),
            "bu_form": "direct" if 2 * t * t > p * d else "gram", "batch": batch})
        metas.append(meta)
    return metas


def layer_table(metas, costs, batch):
    """Per kernel: XLA's flops of its ghost rule, the plain step's and the forms' estimates."""
    lines = ["| layer | T | p | d | tfdp form | Bu form | measured form | rule GFLOP (XLA) | plain 6BTpd GFLOP | "
             "direct 2BTpd | Gram 2BT^2(p+d) | rule / plain |", "|---|" + "---|" * 11]
    total = {"rule": 0.0, "plain": 0.0, "direct": 0.0, "gram": 0.0, "tfdp_est": 0.0, "bu_est": 0.0,
             "best_est": 0.0}
    for m in metas:
        t, p, d = m["T"], m["p"], m["d"]
        rule = costs.get(m["name"], {}).get("GFLOP", float("nan"))
        plain = 6 * batch * t * p * d / 1e9
        direct = 2 * batch * t * p * d / 1e9
        gram = 2 * batch * t * t * (p + d) / 1e9
        pick = {"direct": direct, "gram": gram}
        total["rule"] += rule; total["plain"] += plain; total["direct"] += direct
        total["gram"] += gram
        total["tfdp_est"] += pick[m["tfdp_form"]]; total["bu_est"] += pick[m["bu_form"]]
        total["best_est"] += min(direct, gram)
        lines.append(f"| {m['layer']} | {t} | {p} | {d} | {m['tfdp_form']} | {m['bu_form']} | "
                     f"{m.get('rule_form', m['tfdp_form'])} | "
                     f"{rule:.3f} | {plain:.3f} | {direct:.3f} | {gram:.3f} | {rule / plain:.2f} |")
    lines.append(f"| all kernels | | | | | | | {total['rule']:.3f} | {total['plain']:.3f} | "
                 f"{total['direct']:.3f} | {total['gram']:.3f} | {total['rule'] / total['plain']:.2f} |")
    return lines, total


# -- The side interpreter --------------------------------------------------------------------


def run_jax(jax_python, out_dir, names, replay_seconds):
    """Runs xla_step_cost_jax.py in the side interpreter; {name: record}."""
    command = [jax_python, JAX_SCRIPT, out_dir, *names, f"--seconds={replay_seconds}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    errors = tempfile.TemporaryFile(mode="w+")  # not a pipe: XLA's warnings could fill it
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
    records = {}
    for line in process.stdout:  # as they come: a large step compiles for minutes on a CPU
        if line.startswith("{"):
            record = json.loads(line)
            records[record.get("name", "_backend")] = record
            print(line.rstrip(), flush=True)
    process.wait()
    errors.seek(0)
    stderr = errors.read()
    if process.returncode != 0:
        tail = stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"{jax_python} {JAX_SCRIPT} failed ({process.returncode}): {tail}")
    return records


def ratio(dp, plain):
    return dp / plain if plain else float("nan")


def step_table(cases, costs):
    def mark(value, target):
        return f"{value:.2f}x" + ("" if value <= target else " (>)")
    timed = any("step_ms" in r for r in costs.values())
    head = ("| case | plain GFLOP | DP GFLOP | flops DP/plain | plain GB | DP GB | bytes DP/plain | "
            "plain temp MB | DP temp MB | temp DP/plain |")
    if timed:
        head += " plain ms | DP ms | time DP/plain |"
    lines = [head, "|---|" + "---|" * (head.count("|") - 2)]
    for case in cases:
        name = parse_case(case)[3]
        plain, dp = costs[f"{name}_plain"], costs[f"{name}_dp"]
        row = (f"| {case} | {plain['GFLOP']:.2f} | {dp['GFLOP']:.2f} | "
               f"{mark(ratio(dp['GFLOP'], plain['GFLOP']), TARGETS['flops'])} | "
               f"{plain['GB_accessed']:.3f} | {dp['GB_accessed']:.3f} | "
               f"{mark(ratio(dp['GB_accessed'], plain['GB_accessed']), TARGETS['bytes'])} | "
               f"{plain['temp_MB']:.1f} | {dp['temp_MB']:.1f} | "
               f"{mark(ratio(dp['temp_MB'], plain['temp_MB']), TARGETS['temp'])} |")
        if timed:
            pm, dm = plain.get("step_ms", float("nan")), dp.get("step_ms", float("nan"))
            row += f" {pm:.2f} | {dm:.2f} | {ratio(dm, pm):.2f}x |"
        lines.append(row)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="wrn16_4:32,wrn16_4:128,nf_resnet50:8@224")
    parser.add_argument("--out_dir", default="/tmp/xla_step_cost")
    parser.add_argument("--jax_python", default=None,
                        help="a Python with JAX (required unless --export_only)")
    parser.add_argument("--replay_seconds", type=float, default=0.0, help="0: no timing")
    parser.add_argument("--plan", choices=("tf32", "bf16", "host"), default="tf32",
                        help="the device the DP step's ghost rules plan for")
    parser.add_argument("--form", choices=("auto", "direct", "gram", "bu"), default="auto",
                        help="analysis only: force every kernel rule's form (auto: tfdp's choice)")
    parser.add_argument("--held", action="store_true",
                        help="analysis only: hold every direct-form gradient (no recompute; "
                             "ghost_norms.RECOMPUTED_GRADIENTS = False)")
    parser.add_argument("--export_only", action="store_true")
    parser.add_argument("--layers", action="store_true",
                        help="per-kernel ghost-rule cost instead of the steps (analysis)")
    args = parser.parse_args(argv)
    if not args.export_only and not args.jax_python:
        parser.error("--jax_python is required for the cost part (or pass --export_only)")
    from tfdp import host
    host.enable_onednn()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    cases = [c for c in args.cases.split(",") if c]
    set_form(args.form)
    if args.held:
        from tfdp.dp import ghost_norms
        ghost_norms.RECOMPUTED_GRADIENTS = False
    print(host.describe_host())
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    for case in cases:
        metas = (export_layers if args.layers else export_case)(case, args.out_dir, args.plan)
        for meta in metas:
            print(json.dumps(meta), flush=True)
        if args.export_only:
            continue
        costs = run_jax(args.jax_python, args.out_dir, [m["name"] for m in metas],
                        args.replay_seconds)
        backend = costs.pop("_backend", {})
        coarse = [m for m in metas if m["kind"] == "dp_coarse"]
        if coarse:
            dp_meta = next(m for m in metas if m["kind"] == "dp")
            dp_name = dp_meta["name"]
            costs[dp_name] = loop_corrected(costs[dp_name], costs.pop(coarse[0]["name"]),
                                            dp_meta["recompute_chunks"],
                                            coarse[0]["recompute_chunks"])
            print(json.dumps({"name": dp_name, "loop_corrected": {
                k: round(v, 4) for k, v in costs[dp_name].items() if "GFLOP" in k or "GB" in k}}))
        if args.layers:
            lines, total = layer_table(metas, costs, parse_case(case)[1])
            print(f"{case}: each kernel's ghost rule (plan {args.plan}, forms {args.form}), XLA on {backend}")
            print("\n".join(lines))
            print(json.dumps({k: round(v, 3) for k, v in total.items()}))
        else:
            print(f"{case}: DP step (plan {args.plan}, kernel forms {args.form}) vs plain step, XLA on {backend}; "
                  f"targets DP/plain <= {TARGETS['flops']}x flops, <= {TARGETS['bytes']}x bytes, "
                  f"<= {TARGETS['temp']}x temp memory")
            print("\n".join(step_table([case], costs)), flush=True)


if __name__ == "__main__":
    main()
