"""Export tfdp's XLA-compiled steps as serialized HLO, for replay on a machine that has JAX but no TensorFlow.

For each case writes OUT/NAME.hlo.pb (HloModuleProto) and OUT/NAME.npz holding the entry
parameters in order (arg_0..), plus OUT/NAME.ref.npz with TF's own outputs on those inputs (a
replay on CPU must reproduce them: that checks the parameter order). Ghost rules are traced
with the GPU plan (device_arithmetic.device_inputs() -> TF32: split products), unless NAME ends in
_f32plan (the plan a CPU uses: no split; the control that should under-count under TF32).

Cases MODEL:B:KIND, MODEL in wrn (WRN-16-4, GroupNorm + WS, 32x32x3) or cnn (Tramer & Boneh's
CNN, 28x28x1); KIND: plain (Keras train_step), dp (DPModel.train_step, clipping="auto"), norms
(DPModel's ghost clipped sum with C = 1e-4 and the per-example norms: the precision check), or
norms_f32plan / norms_bf16plan (the same, planned for a float32 device: the control, or for a
TPU's one-pass bf16).
Usage: python export_steps.py OUTDIR [MODEL:B:KIND ...]   (default: the cases below)

Every example is clipped to C / (1 + kappa)
(precision.margined_clip_norm, kappa read at trace time from the plan: 1e-3 TF32, 1e-5 float32);
NAME.extra.npz records C and kappa so replay.py reports the one-hot ratio to both. Large
arguments (the images) go to shared.npz by content like the variables (plain and dp share
them). Outputs of >= 4096 entries (a norms case's clipped sum) are stored in NAME.ref.npz as
a float64 digest d{i} (sum, sum of squares, sum of |.|, a cosine-weighted sum) instead of o{i}.
The manifest records the plan, kappa, the traced plan and the clipping path of DP steps.
TF's updated variables are stored too (v{k}/vd{k}/vi{k}: the change of float variable k, as an
array or a digest; others' new values), and replay.py compares them. --no-ref: HLO + parameters
only (no TF run: wrn:512:dp needs ~22 GB on a CPU). SetBound custom-calls are rewritten to
copies (fix_hlo.py) so that the importer takes the DP step of tfdp >= 454d579.
"""
import hashlib, json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf, keras
from tfdp.accounting import DPMechanism
from tfdp.models import build_tramer_cnn, build_wide_resnet
from tfdp.training.dp_model import DPModel
from tfdp.dp import device_arithmetic
from tfdp.dp import precision
from tensorflow.compiler.xla.service import hlo_pb2
import fix_hlo  # next to this script

NO_REF = "--no-ref" in sys.argv  # trace and write the HLO + parameters only (TF's CPU run would not fit in RAM)
OUT = sys.argv[1]; CASES = [c for c in sys.argv[2:] if not c.startswith("--")]
os.makedirs(OUT, exist_ok=True)
MODELS = {"wrn": (lambda: build_wide_resnet(16, 4, 10, input_shape=(32, 32, 3)), (32, 32, 3)),
          "cnn": (lambda: build_tramer_cnn(10, input_shape=(28, 28, 1)), (28, 28, 1))}
REAL_DEVICE_INPUTS = device_arithmetic.device_inputs


def plan(kind):
    """The device the ghost rules plan for: TF32 (a GPU) by default, bf16 (a TPU) for *_bf16plan,
    this CPU's own (float32) for *_f32plan."""
    if kind.endswith("f32plan"):
        device_arithmetic.device_inputs = REAL_DEVICE_INPUTS
    elif kind.endswith("bf16plan"):
        device_arithmetic.device_inputs = lambda: device_arithmetic.BF16
    else:
        device_arithmetic.device_inputs = lambda: device_arithmetic.TF32


def inputs(shape, b, kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        x = rng.uniform(0, 255, (b, *shape))
    elif kind == "flat":  # nearly constant images: activations alike at every position (Gram cancellation)
        x = 200.0 + rng.normal(0, 0.5, (b, *shape))
    elif kind == "halves":  # each image is +v on one half and -v on the other around mid-grey
        x = np.empty((b, *shape)); v = rng.uniform(20, 100, (b, 1, 1, shape[-1]))
        h = shape[0] // 2; x[:, :h] = 128 + v; x[:, h:] = 128 - v
    return x.astype(np.float32), (np.arange(b) % 10).astype(np.int32)


SHARED = {}


def digest(o):
    """float64 [4]: sum, sum of squares, sum of |o|, sum of o * cos(0.7 k + 1) over the flat entries."""
    f = np.asarray(o, np.float64).ravel()
    return np.array([f.sum(), (f * f).sum(), np.abs(f).sum(), (f * np.cos(0.7 * np.arange(f.size) + 1.0)).sum()])


def main():
    cases = [c.split(":") for c in CASES] or [
        ["wrn", "32", "dp"], ["wrn", "32", "plain"], ["wrn", "128", "dp"], ["wrn", "128", "plain"],
        ["cnn", "512", "dp"], ["cnn", "512", "plain"], ["wrn", "32", "norms"], ["cnn", "64", "norms"]]
    for model_name, b, kind in cases:
        b = int(b)
        name = f"{model_name}_b{b}_{kind}"
        plan(kind)
        keras.utils.set_random_seed(0)
        build, shape = MODELS[model_name]
        model = build()
        x, y = inputs(shape, b, "uniform")
        if kind == "plain":
            model.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            fn = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
            args = (tf.constant(x), tf.constant(y))
        else:
            mech = DPMechanism(num_examples=60000, batch_size=b, num_steps=1000, noise_multiplier=1.0,
                               l2_clip_norm=(1.0 if kind == "dp" else 1e-4), delta=1e-5)
            dp = DPModel(model, mech, clipping="auto", noise_seed=0)
            dp.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
            assert dp.clipping_path == "ghost", dp.clipping_path
            if kind == "dp":
                fn = tf.function(lambda x, y, m: dp.train_step((x, y, m)), jit_compile=True)
                args = (tf.constant(x), tf.constant(y), tf.ones([b]))
            else:
                def make(dp):
                    def norms_fn(x, y, m):
                        summed, norms, clipped, losses, logits = dp._ghost.clipped_sum(
                            x, y, m, l2_clip_norm=1e-4, normalize=False, loss_fn=dp._loss_fn,
                            example_loss_fn=dp._example_loss)
                        return summed, norms
                    return norms_fn
                norms_fn = make(dp)
                fn = tf.function(norms_fn, jit_compile=True)
                args = (tf.constant(x), tf.constant(y), tf.ones([b]))
        conc = fn.get_concrete_function(*args)
        # entry parameters: the args, then the captured inputs (variables' values read BEFORE running)
        handle_to_var = {id(v.handle): v for v in conc.graph.variables}
        t0 = time.time()
        ir = fn.experimental_get_compiler_ir(*args)
        proto = ir(stage="hlo_serialized"); text = ir(stage="hlo")
        # SetBound custom-calls (tuple literals) -> identity copies: fix_hlo.py's docstring
        module = hlo_pb2.HloModuleProto(); module.ParseFromString(proto)
        n_setbound = fix_hlo.fix(module)
        if n_setbound:
            proto = module.SerializeToString()
        if "--hlo-text" in sys.argv:
            with open(f"{OUT}/{name}.hlo.txt", "w") as f:
                f.write(text)
        caps = []
        for c in conc.captured_inputs:
            if c.dtype == tf.resource:
                v = handle_to_var.get(id(c))
                caps.append(None if v is None else v.numpy())
            else:
                caps.append(c.numpy())
        missing = sum(v is None for v in caps)
        kappa = precision.clip_margin()  # what the traced step's clip margin read (same plan)
        # Entry parameters: normally the args, then the captured inputs. TF folds an arg that some
        # op needs as a compile-time constant into the HLO (tfdp 454d579: x, y and mask, through
        # the recompute loop's strided slices): then the parameters are the captured inputs only.
        entry = next(c for c in module.computations if c.id == module.entry_computation_id)
        n_params = len(entry.program_shape.parameters)
        if n_params == len(args) + len(caps):
            n_lead = len(args)
        elif n_params == len(caps):
            n_lead = 0
        else:
            raise ValueError(f"{name}: {n_params} HLO parameters for {len(args)} args + {len(caps)} captures")
        vals = [a.numpy() for a in args][:n_lead] + [np.zeros(0) if v is None else np.asarray(v) for v in caps]
        sources, inline = [], {}
        for i, v in enumerate(vals):
            if v.size >= 4096:  # large arrays: once, in shared.npz, by content
                key = "k" + hashlib.sha1(v.tobytes() + str(v.shape).encode() + str(v.dtype).encode()).hexdigest()[:16]
                SHARED[key] = v; sources.append(key)
            else:
                inline[f"p{i}"] = v; sources.append(f"p{i}")
        np.savez(f"{OUT}/{name}.npz", **inline)
        with open(f"{OUT}/{name}.sources.json", "w") as f:
            json.dump(sources, f)
        with open(f"{OUT}/{name}.hlo.pb", "wb") as f:
            f.write(proto)
        if NO_REF:
            meta_ref = "none (--no-ref)"
        else:
            meta_ref = "tf-cpu"
            outs = conc(*args)  # TF's own outputs from the same starting values
            flat = [np.asarray(o) for o in tf.nest.flatten(outs)]
            ref = {}
            for i, o in enumerate(flat):
                if o.size >= 4096 and o.dtype.kind == "f":
                    ref[f"d{i}"] = digest(o)
                else:
                    ref[f"o{i}"] = o
            # the step's effect on every captured variable (parameter n_args + j), as TF ran it:
            # float variables as the change (post - pre, float64), others as the new value
            for j, c in enumerate(conc.captured_inputs):
                v = handle_to_var.get(id(c)) if c.dtype == tf.resource else None
                if v is None:
                    continue
                pre, post = np.asarray(caps[j]), np.asarray(v.numpy())
                k = n_lead + j
                if post.dtype.kind == "f":
                    delta = post.astype(np.float64) - pre.astype(np.float64)
                    if delta.size >= 4096:
                        ref[f"vd{k}"] = digest(delta)
                    else:
                        ref[f"v{k}"] = delta
                else:
                    ref[f"vi{k}"] = post
            np.savez(f"{OUT}/{name}.ref.npz", **ref)
        extra = {"clip": np.float64(dp.mechanism.l2_clip_norm) if kind != "plain" else np.float64(0),
                 "kappa": np.float64(kappa)}
        if kind.startswith("norms") and not NO_REF:
            # exact per-example norms on this CPU: one example at a time, float64 sums of float32 grads
            tv = dp.trainable_variables

            def exact_norms(images):
                """One example at a time: float64 sums of the float32 gradients' squares."""
                norms = []
                for i in range(b):
                    with tf.GradientTape() as tape:
                        logits = model(tf.constant(images[i:i + 1]), training=True)
                        loss = tf.reduce_sum(dp._loss_fn(tf.constant(y[i:i + 1]), logits))
                    g = tape.gradient(loss, tv)
                    norms.append(np.sqrt(sum(np.sum(np.asarray(gg, np.float64) ** 2) for gg in g)))
                return np.array(norms)

            extra["ref_norms"] = exact_norms(x)
            # inputs for the other kinds
            for k2 in ("flat", "halves"):
                x2, _ = inputs(shape, b, k2)
                extra[f"x_{k2}"] = x2
                extra[f"ref_norms_{k2}"] = exact_norms(x2)
            np.savez(f"{OUT}/{name}.extra.npz", **extra)
        meta = {"name": name, "n_args": len(args), "n_captured": len(caps), "missing_vars": missing,
                "f64": text.count("f64["), "hlo_bytes": len(proto), "export_s": round(time.time() - t0, 1),
                "path": getattr(dp, "clipping_path", "plain") if kind != "plain" else "plain", "ref": meta_ref, "setbound_to_copy": n_setbound,
                "args_folded_into_hlo": n_lead == 0, "batch": b,
                "plan": device_arithmetic.device_inputs().name, "kappa": kappa,
                "tfdp": os.path.dirname(precision.__file__),
                "traced_inputs": dp.traced_matmul_inputs if kind == "dp" else None,
                "clip": float(dp.mechanism.l2_clip_norm) if kind != "plain" else None}
        if kind == "dp":
            assert meta["path"] == "ghost" and meta["traced_inputs"] == "tf32", meta
        print(json.dumps(meta), flush=True)
        with open(f"{OUT}/manifest.jsonl", "a") as f:
            f.write(json.dumps(meta) + "\n")
    if os.path.exists(f"{OUT}/shared.npz"):
        old = np.load(f"{OUT}/shared.npz"); SHARED.update({k: old[k] for k in old.files})
    np.savez(f"{OUT}/shared.npz", **SHARED)


if __name__ == "__main__":
    main()
