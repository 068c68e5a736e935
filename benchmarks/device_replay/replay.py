"""Replay tfdp's exported XLA steps (export_steps.py) with JAX's XLA on this machine's default backend.

For every NAME.hlo.pb in DIR: compile, run once on the saved parameters and compare with TF's own
outputs (NAME.ref.npz: same program, CPU), then time the step (median of timed runs) and report
XLA's memory analysis. For *_norms* cases, the precision contract on this device: per-example
norms against a CPU reference (float64 sums of float32 per-example gradients; ratio min/max), and, with a one-hot mask and C = 1e-4, the
norm of the vector each single example adds (must be <= C (1 + 1e-6)).
Usage: python replay.py DIR [--seconds S] [--only PREFIX] [--exclude SUBSTR] [--quick] [--rewrite]
       [--emulate MANTISSA_BITS] [--onehot N] [--names A,B] [--kinds K1,K2]
--quick: compile, run once, compare, memory; no timing or precision loop. --rewrite: write
mhlo.copy as an identity stablehlo.convert (jax >= 0.11 refuses mhlo.copy). --emulate 10 (TF32)
or 7 (bf16): round every float32 dot/convolution operand first (stablehlo.reduce_precision), an
emulation of the device's matmul input rounding on any backend (not of its algorithms).

devrun changes: the one-hot check reports the vector one example adds over C
(`*_added_over_C_max`) and over C / (1 + kappa), the norm tfdp clips to
(`*_added_over_Cm_max`), with C and kappa from NAME.extra.npz (the trace's plan); it runs
min(N, B) examples (`--onehot N`, 0: all) and `--kinds uniform,flat,halves` picks the inputs.
TF's large outputs may be stored as digests (d{i}: sum, sum of squares, sum |.|, cosine-weighted
sum); every output is compared (rel err of each entry / digest component, over the output's
max |.| or the digest's |.| scale), norms cases included. `--seconds 0` with `--onehot` skips
the timing loop's length (5 steps).
"""
import glob, json, os, re, sys, time
import numpy as np
import jax
import jax.extend
jax.config.update("jax_enable_x64", True)
from jax._src.lib import xla_client as xc

from hlo_import import aliases_of, without_mhlo_copy  # beside this script

DIR = sys.argv[1]
SECONDS = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 5.0
QUICK = "--quick" in sys.argv
COMPILE_ONLY = "--compile-only" in sys.argv  # compile and report memory, run nothing
NO_TIME = "--no-time" in sys.argv  # no timing loop (the one-hot check still runs)
FORCE_REWRITE = "--rewrite" in sys.argv
ONEHOT = int(sys.argv[sys.argv.index("--onehot") + 1]) if "--onehot" in sys.argv else 0
EMULATE = int(sys.argv[sys.argv.index("--emulate") + 1]) if "--emulate" in sys.argv else 0
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""
NAMES = sys.argv[sys.argv.index("--names") + 1].split(",") if "--names" in sys.argv else []
KINDS = (sys.argv[sys.argv.index("--kinds") + 1] if "--kinds" in sys.argv else "uniform,flat,halves").split(",")


def digest(o):
    f = np.asarray(o, np.float64).ravel()
    return np.array([f.sum(), (f * f).sum(), np.abs(f).sum(), (f * np.cos(0.7 * np.arange(f.size) + 1.0)).sum()])
backend = jax.extend.backend.get_backend()
dev = backend.local_devices()[0]
print(json.dumps({"backend": backend.platform, "device": str(dev), "jax": jax.__version__}), flush=True)


def round_matmul_inputs(text, mantissa_bits):
    """Every float32 dot_general and convolution gets its operands rounded to `mantissa_bits` explicit
    bits first (stablehlo.reduce_precision, round to nearest even): the device's TF32 (10) or
    one-pass bf16 (7) matmul inputs, emulated on any backend. Products and sums stay float32."""
    out, k = [], 0
    for line in text.split("\n"):
        if '"stablehlo.dot_general"(' in line or '"stablehlo.convolution"(' in line:
            head, sig = line.rsplit(" : (", 1)
            types = sig.split(") -> ")[0].split(", ")
            lhs = head.split(" = ", 1)
            op = '"stablehlo.dot_general"(' if "dot_general" in line else '"stablehlo.convolution"('
            pre, rest = lhs[1].split(op, 1)
            args, after = rest.split(")", 1)
            names = [a.strip() for a in args.split(",")]
            indent = lhs[0][:len(lhs[0]) - len(lhs[0].lstrip())]
            new = []
            for name, ty in zip(names, types):
                if ty.endswith("xf32>") or ty == "tensor<f32>":
                    k += 1
                    out.append(f'{indent}%rp{k} = "stablehlo.reduce_precision"({name}) <{{exponent_bits = 8 : i32, '
                               f'mantissa_bits = {mantissa_bits} : i32}}> : ({ty}) -> {ty}')
                    new.append(f"%rp{k}")
                else:
                    new.append(name)
            line = f"{lhs[0]} = {pre}{op}{', '.join(new)}){after} : ({sig}"
        out.append(line)
    return "\n".join(out), k


def compile_hlo(proto):
    mlir = xc._xla.mlir.hlo_to_stablehlo(proto)
    global ALIASES
    ALIASES = aliases_of(mlir)
    if FORCE_REWRITE or EMULATE:
        mlir, n = without_mhlo_copy(mlir)
        if EMULATE:
            mlir, k = round_matmul_inputs(mlir, EMULATE)
            print(json.dumps({"emulated_mantissa_bits": EMULATE, "rounded_operands": k}), flush=True)
    opts = xc.CompileOptions()
    try:
        return backend.compile_and_load(mlir, backend.local_devices()[:1], opts)
    except TypeError:
        return backend.compile_and_load(mlir, xc.DeviceList(tuple(backend.local_devices()[:1])), opts)


def put(arrays):
    return [jax.device_put(a, dev) for a in arrays]


def run(exe, bufs):
    outs = exe.execute(bufs)
    return outs


def block(outs):
    for o in outs:
        o.block_until_ready()


def memory(exe):
    try:
        m = exe.get_compiled_memory_stats()
        return {"temp_MB": round(m.temp_size_in_bytes / 1e6, 1), "arg_MB": round(m.argument_size_in_bytes / 1e6, 1),
                "out_MB": round(m.output_size_in_bytes / 1e6, 1), "alias_MB": round(m.alias_size_in_bytes / 1e6, 1)}
    except Exception as e:
        return {"memory": f"n/a ({type(e).__name__})"}


SHARED = np.load(f"{DIR}/shared.npz")
EXCLUDE = sys.argv[sys.argv.index("--exclude") + 1] if "--exclude" in sys.argv else None
ORDER = ["wrn_b32", "wrn_b64", "wrn_b128", "cnn"]


def rank(path):
    base = os.path.basename(path).split(".hlo.pb")[0]
    return (next((i for i, p in enumerate(ORDER) if base.startswith(p + "_")), 9), base)


for path in sorted(glob.glob(f"{DIR}/*.hlo.pb") + glob.glob(f"{DIR}/*.hlo.pb.gz"), key=rank):
    if EXCLUDE and EXCLUDE in os.path.basename(path):
        continue
    name = os.path.basename(path).split(".hlo.pb")[0]
    if ONLY and not name.startswith(ONLY):
        continue
    if NAMES and name not in NAMES:
        continue
    rec = {"name": name}
    try:
        t0 = time.time()
        import gzip
        exe = compile_hlo((gzip.open if path.endswith(".gz") else open)(path, "rb").read())
        rec["compile_s"] = round(time.time() - t0, 2)
        if COMPILE_ONLY:
            rec.update(memory(exe)); print(json.dumps(rec), flush=True)
            continue
        params = np.load(f"{DIR}/{name}.npz")
        sources = json.load(open(f"{DIR}/{name}.sources.json"))
        arrays = [SHARED[k] if k.startswith("k") else params[k] for k in sources]
        bufs = put(arrays)
        t0 = time.time()
        outs = run(exe, bufs); block(outs)
        rec["first_run_s"] = round(time.time() - t0, 3)
        got = [np.asarray(o) for o in outs]
        has_ref = os.path.exists(f"{DIR}/{name}.ref.npz")
        ref = np.load(f"{DIR}/{name}.ref.npz") if has_ref else None
        n_ref = len([f for f in ref.files if f[0] in "od"]) if has_ref else 0
        # TF's outputs are the function's returns; XLA's are those plus updated variables: compare the first ones
        errs, n_cmp = [], 0
        for i in range(n_ref):
            g = got[i]
            if f"d{i}" in ref.files:  # a digest of a large output
                d, dg = ref[f"d{i}"], digest(g)
                scale = np.array([np.abs(g).astype(np.float64).sum()] * 4) + 1e-30
                scale[1] = d[1] + 1e-30
                errs.append(float(np.max(np.abs(dg - d) / scale))); n_cmp += 1
                continue
            r = ref[f"o{i}"]
            if g.shape == r.shape and g.dtype.kind == "f" and r.size:
                errs.append(float(np.max(np.abs(g.astype(np.float64) - r)) / (np.max(np.abs(r)) + 1e-30))); n_cmp += 1
            elif g.shape == r.shape and r.size:
                errs.append(float(np.any(g != r))); n_cmp += 1
        rec["n_out"] = len(got); rec["n_ref"] = n_ref; rec["n_compared"] = n_cmp
        rec["max_rel_err_vs_tf_cpu"] = max(errs) if errs else (None if has_ref else "no TF reference")
        if "_norms" in name and errs:
            rec["norms_rel_err_vs_tf_cpu"] = errs[-1]  # the last output: the per-example norms
        # the updated variables against TF's: change of each float variable (post - pre), others' values
        verrs, n_vars, out_of = [], 0, dict(ALIASES)
        for key in (ref.files if has_ref else []):
            if not key.startswith("v"):
                continue
            k = int(key.lstrip("vdi"))
            new = got[out_of[k]] if k in out_of else arrays[k]
            n_vars += 1
            if key.startswith("vi"):
                verrs.append(float(np.any(np.asarray(new) != ref[key])))
                continue
            delta = np.asarray(new, np.float64) - np.asarray(arrays[k], np.float64)
            if key.startswith("vd"):
                d, dg = ref[key], digest(delta)
                scale = np.array([np.abs(delta).sum()] * 4) + 1e-300
                scale[1] = d[1] + 1e-300
                verrs.append(float(np.max(np.abs(dg - d) / scale)))
            else:
                r = ref[key]
                verrs.append(float(np.max(np.abs(delta - r)) / (np.max(np.abs(r)) + 1e-300)) if r.size else 0.0)
        if n_vars:
            rec["n_vars_compared"] = n_vars; rec["max_rel_err_vars_vs_tf_cpu"] = max(verrs)
        rec.update(memory(exe))
        rec["aliased_params"] = len(ALIASES)
        if QUICK:
            print(json.dumps(rec), flush=True)
            continue
        # timing: a training loop, each step's updated variables fed to the next (donated buffers)
        bufs = put(arrays)

        def step():
            outs = run(exe, bufs)
            for p, o in ALIASES:
                bufs[p] = outs[o]
            return outs
        for _ in range(0 if NO_TIME else 3):
            block(step())
        n, t0 = 0, time.time()
        times = []
        while not NO_TIME and (time.time() - t0 < SECONDS or n < 5):
            t1 = time.perf_counter(); block(step()); times.append(time.perf_counter() - t1); n += 1
        times.sort()
        if NO_TIME:
            times = [float("nan")]
        rec["step_ms_median"] = round(1e3 * times[len(times) // 2], 3)
        rec["step_ms_min"] = round(1e3 * times[0], 3)
        rec["steps_timed"] = n
        b = int(re.search(r"_b(\d+)_", name).group(1))  # arrays[0] is no batch where TF folded the args
        rec["examples_per_s"] = round(b / times[len(times) // 2], 1)
        if "_norms" in name:
            bufs = put(arrays)
            extra = np.load(f"{DIR}/{name}.extra.npz")
            x0, y0, m0 = arrays[0], arrays[1], arrays[2]
            n_vars_out = len(got) - 1  # outputs: summed..., norms (tuple flattened)
            C = float(extra["clip"]) if "clip" in extra.files else 1e-4
            kappa = float(extra["kappa"]) if "kappa" in extra.files else 0.0
            rec["C"] = C; rec["kappa"] = kappa
            for kind in KINDS:
                x = x0 if kind == "uniform" else extra[f"x_{kind}"]
                refn = extra["ref_norms" if kind == "uniform" else f"ref_norms_{kind}"]
                xb = jax.device_put(x, dev)
                o = run(exe, [xb] + bufs[1:]); block(o)
                norms = np.asarray(o[-1]).astype(np.float64)
                ratio = norms / refn
                # one-hot masks: the vector each example adds
                worst = 0.0; t1 = time.time()
                rec["onehot_examples"] = min(ONEHOT or b, b)
                worst_i = -1
                # lowest norm / exact-norm ratio first: with N < B the likeliest under-counts are checked
                for i in np.argsort(ratio, kind="stable")[:min(ONEHOT or b, b)]:
                    m = np.zeros(b, np.float32); m[i] = 1
                    oi = run(exe, [xb, bufs[1], jax.device_put(m, dev)] + bufs[3:]); block(oi)
                    vec2 = sum(float(np.sum(np.asarray(t, np.float64) ** 2)) for t in oi[:-1])
                    if np.sqrt(vec2) / C > worst:
                        worst, worst_i = np.sqrt(vec2) / C, int(i)
                rec[f"{kind}_norm_ratio_min"] = float(ratio.min()); rec[f"{kind}_norm_ratio_max"] = float(ratio.max())
                rec[f"{kind}_added_over_C_max"] = worst
                rec[f"{kind}_added_over_Cm_max"] = worst * (1 + kappa)
                rec[f"{kind}_added_worst_example"] = worst_i
                rec[f"{kind}_onehot_s"] = round(time.time() - t1, 1)
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"
    print(json.dumps(rec), flush=True)
