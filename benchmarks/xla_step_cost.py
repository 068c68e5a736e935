"""XLA's cost of tfdp's compiled DP step against the plain step: flops, bytes, temp memory, time.

TensorFlow compiles both steps with XLA (`jit_compile=True`); JAX compiles
the same HLO for any XLA target, and XLA's cost analysis of the compiled
program (flops, bytes accessed, temporary buffers) is a proxy for what the
DP step costs on an accelerator relative to the plain step (on an H200, the
time ratios followed the flops and bytes: docs/performance.md). This script,
in tfdp's environment (pure TensorFlow, no JAX), exports for every case

  - `CASE_plain`: the plain Keras step (`model.train_step`, SGD, mean
    cross-entropy) on all B K images, traced with `jit_compile=True`;
  - `CASE_dp`: `DPModel.train_step` exactly as `DPModel.compile(jit_compile=True)`
    runs it (clipping="auto", which the trainer uses: ghost norms; C = 1,
    sigma = 1, SGD) on B examples of K views, its ghost rules planned for
    `--plan` (default `tf32`: the plan of an Ampere-or-newer GPU, whose
    exact products are split into bf16 pieces; `bf16`: a TPU's; `host`:
    this machine's own plan, a CPU's float32);

as `OUT/NAME.hlo.pb` (the HloModuleProto TensorFlow compiles), `OUT/NAME.npz`
(the entry parameters in order: arguments, then the variables' values) and
`OUT/NAME.json`, then runs `benchmarks/xla_step_cost_jax.py` in the side
interpreter `--side_python` (alias `--jax_python`; a venv with JAX, `pip
install jax`, or with `pip install "jax[tpu]"` for a TPU target; tfdp's own
environment never gets JAX), as `vs_opacus.py` runs Opacus in
`--opacus_python`. That script compiles each HLO for `--target` (`default`:
the side interpreter's JAX backend; `cpu`; `gpu`; `tpu:v4`, `tpu:v5e`,
`tpu:v5p`, `tpu:v6e`: one chip of that TPU, compiled by libtpu's
compile-only client, no TPU attached), reports XLA's cost and memory
analysis and, with `--replay_seconds S > 0` (a device here), times the step
as a training loop (updated variables fed back). The table gives DP / plain
ratios beside the targets tfdp set itself (<= 1.6x flops, <= 2x bytes,
<= 1.5x temp memory). A step the target's compiler refuses (an op a TPU
cannot run) stops the script with the compiler's message.

    python benchmarks/xla_step_cost.py --side_python=$TPU_VENV/bin/python --target=tpu:v5e \\
        --plan=bf16 --cases=wrn16_4:32,wrn16_4:128,wrn16_4:64:16,nf_resnet50:8@224

Where the DP step recomputes per-example gradients in while loops over
chunks of the batch (a GPU's or TPU's plan, `ghost_norms.forms._recomputed`),
XLA's cost analysis counts a loop's body once, not once per trip (its
`HandleWhile`), on every backend. `--loops` says how every trip is counted:

  - `unrolled` (default): the case is also exported as `CASE_dp_unrolled`,
    the same step traced with those loops unrolled at trace time
    (`unrolled_loops`: a measurement variant; the same operations on the
    same tensors in the same order, without the loop), and the DP flops and
    bytes in the table are that program's (its trips' chunk indices pass
    through optimization barriers, so that XLA cannot merge the recompute
    into the first build: `_StaticLoops`). Each compiled program's while
    loops are listed, with the trip count where the compiler's HLO shows it
    (`known_trip_count` on a CPU or GPU; "?" on a TPU, or for a loop whose
    trip count is not static): the count is `exact` where the program
    counted has no loop left but those the trace kept. The one it keeps,
    the non-finite fallback's (it runs once per example whose ghost sum is
    not finite: none in a normal step), is counted as XLA counts a
    conditional: its costlier branch, its loop body once.
  - `doubled`: the case is also exported with two chunks per loop trip
    (`CASE_dp_doubled`: the same chunk shapes, half the trips); the
    difference from the step is one trip's work w, and the step's cost is
    its own plus (n - 1) w (`doubled_corrected`). It assumes only that XLA
    counts two chunks of the same shapes as twice one: the check of the
    unrolled count.
  - `coarse`: the case is also exported with half as many chunks
    (`CASE_dp_coarse`) and the loops' work is inferred from the difference
    (`loop_corrected`), which assumes a chunk's cost is linear in its size.
    On XLA's CPU backend it is for the flops, not for the bytes (WRN-16-4,
    B = 32: within 0.2% and 12% of the unrolled count,
    docs/performance.md); a TPU's compiler lays out and fuses each chunk
    shape its own way: kept for comparison only.
  - `all`: the three, each printed against the unrolled count.

Temp memory is always the step's own (with its loops), as XLA assigns it.

A case is MODEL:B[:K][@RES]: B examples of K views each (augmult; the plain
step then takes the B K images as its batch), square input RES x RES; MODEL
one of `wrn16_4` (WRN-16-4, GroupNorm + WS, 32x32x3, 10 classes),
`nf_resnet50` (NF-ResNet-50, imagenet.gin's model, 224x224x3, 1000 classes),
`tramer_cnn` (28x28x1; tiny, for tests). `--normalize_update`: the DP step
with De et al.'s normalized update (imagenet.gin's). `--export_only` writes
the files and stops (no side interpreter). `--layers` (analysis) instead
exports, for every kernel of
the case's model, the ghost rule tfdp's DP step runs for it on that layer's
shapes (`ghost_norms.ws_kernel_sq_norms` / `kernel_sq_norms` on the layer's
patches: its norms and its weighted sum with unit factors) and prints XLA's
flops per layer beside the plain step's ~3 x 2 B T p d for that kernel and
the two forms' estimates (Gram ~ B T^2 (p + d), direct ~ B T p d); see
`layer_table`. `--form=direct|gram|bu` (analysis only, never a training
setting) replaces `ghost_norms.forms.choose_form` in this process, for the steps or
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
    """'wrn16_4:32', 'wrn16_4:64:16' or 'nf_resnet50:8:4@224' -> (model, batch, views, resolution, name).

    MODEL:B[:K][@RES]: B examples of K views each (augmult; 1 if left out), square input RES.
    """
    model, rest = case.split(":", 1)
    rest, _, res = rest.partition("@")
    batch, _, views = rest.partition(":")
    if model not in SHAPES:
        raise ValueError(f"unknown model {model!r} (one of {sorted(SHAPES)})")
    res = int(res) if res else SHAPES[model][0]
    views = int(views) if views else 1
    name = (f"{model}_b{batch}" + (f"_k{views}" if views > 1 else "")
            + (f"_r{res}" if res != SHAPES[model][0] else ""))
    return model, int(batch), views, res, name


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
    """The device the ghost rules plan for (`device_arithmetic.device_inputs`): tf32, bf16, host."""
    from tfdp.dp import device_arithmetic
    if not hasattr(set_plan, "real"):
        set_plan.real = device_arithmetic.device_inputs
    if plan == "tf32":
        device_arithmetic.device_inputs = lambda: device_arithmetic.TF32
    elif plan == "bf16":
        device_arithmetic.device_inputs = lambda: device_arithmetic.BF16
    else:
        device_arithmetic.device_inputs = set_plan.real


def set_form(form):
    """ANALYSIS ONLY (never a training setting): every kernel rule takes `form` ("direct" or
    "gram"), or Bu et al. 2022's mixed ghost clipping's pick ("bu": direct where 2 R^2 > fan_in
    fan_out, else Gram), instead of `forms.choose_form`'s ("auto"), in this process (set on
    `tfdp.dp.ghost_norms.forms`, which the kernel rules read it from)."""
    from tfdp.dp.ghost_norms import forms
    if not hasattr(set_form, "real"):
        set_form.real = forms.choose_form
    if form == "auto":
        forms.choose_form = set_form.real
    elif form == "bu":
        forms.choose_form = lambda rows, fan_in, fan_out, *_: (
            forms.DIRECT if rows is None or 2 * rows * rows > fan_in * fan_out
            else forms.GRAM)
    else:
        forms.choose_form = lambda rows, fan_in, fan_out, *_: form


def batch_of(model_name, batch, res, views=1, seed=0):
    """(x, y): `[batch, res, res, c]` images (`[batch, views, res, res, c]` for views > 1), labels."""
    import numpy as np
    _, channels, classes = SHAPES[model_name]
    rng = np.random.default_rng(seed)
    shape = (batch, res, res, channels) if views == 1 else (batch, views, res, res, channels)
    x = rng.uniform(0, 255, shape).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int32)
    return x, y


class _StaticLoops:
    """`tensorflow` as a module sees it, with each `while_loop` of static trip count unrolled.

    MEASUREMENT ONLY (`unrolled_loops`). A loop whose first loop variable is a
    constant and whose condition, given that constant as a Python int, returns
    a Python bool (tfdp's chunk loops: `i < chunks`) runs its body at trace
    time, trip after trip, on the same tensors in the same order: the same
    operations as the loop's, with no loop. Any other loop stays a loop.

    Each trip's index is the trip number plus a zero computed from a random
    draw and the loop's own tag (`((r + tag) & 1) >> 1`, r a scalar int32 from
    `tf.random.uniform`): exactly the trip number, but neither TensorFlow's
    compile-time constant resolution nor XLA can fold it (a step input would
    be made a compile-time constant and folded in), and it differs from loop
    to loop. The body then slices its chunk with a dynamic slice, as in the
    loop, and XLA cannot merge two loops' trips that compute the same thing
    (common-subexpression elimination would otherwise merge the recompute's
    second build of a chunk's per-example gradients into its first and hold
    them: another program, with half the recompute's work and more memory
    than the loop's; an optimization barrier does not stop it, XLA's CPU
    pipeline removes those first). The draws cost a few scalar operations.
    `trips`: the trip count of each loop unrolled.

    `per_trip=k` (k > 1; the check of the unrolled count) instead keeps each
    such loop as a loop, of n / k trips that each run k of its trips (n a
    multiple of k; else it is unrolled): XLA counts k trips of the same
    shapes where it counted one.
    """

    def __init__(self, tf, per_trip=0):
        self._tf = tf
        self.trips = []
        self.per_trip = per_trip

    def __getattr__(self, name):
        return getattr(self._tf, name)

    def _opaque(self, value, tag):
        tf = self._tf
        draw = tf.random.uniform([], 0, 1 << 30, dtype=tf.int32)
        zero = tf.bitwise.right_shift(tf.bitwise.bitwise_and(draw + tag, 1), 1)
        return tf.constant(value, tf.int32) + zero

    def while_loop(self, cond, body, loop_vars, **kwargs):
        first = self._tf.get_static_value(loop_vars[0])
        if first is None or not isinstance(cond(int(first), *loop_vars[1:]), bool):
            return self._tf.while_loop(cond, body, loop_vars, **kwargs)
        tag = len(self.trips)
        index, rest, trips = int(first), tuple(loop_vars[1:]), 0
        if self.per_trip > 1:
            count = 0
            while cond(int(first) + count, *rest):
                count += 1
            if count % self.per_trip == 0:
                self.trips.append(count)

                def several(i, *state):
                    for _ in range(self.per_trip):
                        i, *state = body(i, *state)
                    return (i, *state)

                return self._tf.while_loop(cond, several, loop_vars, **kwargs)
        while cond(index, *rest):
            _, *rest = body(self._opaque(index, tag), *rest)
            index, trips = index + 1, trips + 1
        self.trips.append(trips)
        return (self._tf.constant(index), *rest)


class unrolled_loops:  # pylint: disable=invalid-name
    """MEASUREMENT ONLY: within it, tfdp's recompute loops over chunks (`forms._recomputed`)
    are traced unrolled (`_StaticLoops`), so that XLA's cost analysis, which counts a while
    loop's body once whatever its trip count, counts every chunk. The step computes the same
    values in the same order; only the loop is gone. `trips`: the loops unrolled.
    `per_trip=k`: each loop runs k chunks per trip instead (`_StaticLoops`)."""

    def __init__(self, per_trip=0):
        self._per_trip = per_trip

    def __enter__(self):
        from tfdp.dp.ghost_norms import forms  # the module whose `_recomputed` loops
        self._module = forms
        self._saved = forms.tf
        forms.tf = _StaticLoops(self._saved, self._per_trip)
        return forms.tf

    def __exit__(self, *exc):
        self._module.tf = self._saved
        return False


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


def loops_refused(loops):
    """Why `--loops` cannot measure the route set now (a message), or None.

    The per-example route loops one example per trip (`forms.recompute_trip_count`): half as
    many chunks is the same program, so `coarse` (and `all`, which includes it) measure nothing.
    """
    from tfdp.dp.ghost_norms import forms
    if loops in ("coarse", "all") and forms.per_example_convs() == "per_example":
        return (f"--loops {loops} with the per-example route: it loops one example per trip, "
                "so it has no coarser chunking; use --loops unrolled or doubled.")
    return None


def export_case(case, out_dir, plan="tf32", loops="unrolled", normalize_update=False,
                ema_decay=None):
    """Writes CASE_plain and CASE_dp (see the module docstring); returns their names and metadata.

    Where the DP step has recompute loops (more than one chunk), `loops` adds a
    measurement variant: "unrolled" (`CASE_dp_unrolled`, the same step traced
    with its chunk loops unrolled: every trip counted), "doubled"
    (`CASE_dp_doubled`, two chunks per trip: `doubled_corrected`), "coarse"
    (`CASE_dp_coarse`, half as many chunks: `loop_corrected`), "all" (the three), or "none".
    `normalize_update` (the mechanism's: De et al. 2022, eq. (3)) and `ema_decay` (DPModel's
    parameter EMA, updated in the step): as a config sets them (imagenet.gin: True, 0.99999).
    """
    import keras
    import tensorflow as tf
    from tfdp import accounting
    from tfdp.dp.ghost_norms import forms
    from tfdp.training.dp_model import DPModel
    model_name, batch, views, res, name = parse_case(case)
    refused = loops_refused(loops)
    if refused:
        raise ValueError(refused)
    os.makedirs(out_dir, exist_ok=True)
    set_plan(plan)
    x, y = batch_of(model_name, batch, res, views)
    metas = []
    # plain: Keras' own train_step, as model.compile(jit_compile=True) runs it, on all B K images
    keras.utils.set_random_seed(0)
    model = build_model(model_name, res)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fn = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
    plain_x, plain_y = x.reshape((batch * views, *x.shape[-3:])), y.repeat(views)
    metas.append(write_step(out_dir, f"{name}_plain", fn, (tf.constant(plain_x), tf.constant(plain_y)),
                            {"case": case, "kind": "plain", "batch": batch, "views": views}))
    # DP: DPModel.train_step on (x, y, mask), clipping="auto" as the trainer chooses
    keras.utils.set_random_seed(0)
    model = build_model(model_name, res)
    mechanism = accounting.DPMechanism(num_examples=60000, batch_size=batch, num_steps=1000,
                                       noise_multiplier=1.0, l2_clip_norm=1.0, delta=1e-5,
                                       normalize_update=normalize_update)
    dp = DPModel(model, mechanism, clipping="auto", noise_seed=0, ema_decay=ema_decay)
    dp.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=True)
    args = (tf.constant(x), tf.constant(y), tf.ones([batch]))

    def dp_step():
        return tf.function(lambda x, y, m: dp.train_step((x, y, m)), jit_compile=True)

    chunks = forms.recompute_trip_count(batch) if forms.recomputed_gradients() else 1
    extra = {"case": case, "batch": batch, "views": views, "plan": plan}
    metas.append(write_step(out_dir, f"{name}_dp", dp_step(), args,
                            {**extra, "kind": "dp", "clipping_path": dp.clipping_path,
                             "recompute_chunks": chunks, "normalize_update": normalize_update,
                             "ema_decay": ema_decay}))
    if chunks > 1 and loops in ("unrolled", "all"):
        with unrolled_loops() as patched:
            meta = write_step(out_dir, f"{name}_dp_unrolled", dp_step(), args,
                              {**extra, "kind": "dp_unrolled", "recompute_chunks": chunks})
        meta["unrolled_trips"] = patched.trips
        metas.append(meta)
    if chunks > 1 and chunks % 2 == 0 and loops in ("doubled", "all"):
        with unrolled_loops(per_trip=2) as patched:
            meta = write_step(out_dir, f"{name}_dp_doubled", dp_step(), args,
                              {**extra, "kind": "dp_doubled", "recompute_chunks": chunks})
        meta["doubled_trips"] = patched.trips
        metas.append(meta)
    if chunks > 1 and loops in ("coarse", "all"):
        # XLA's cost analysis counts a while loop's body once (HloCostAnalysis::HandleWhile),
        # whatever its trip count: the same step with coarser chunks gives the loops' work.
        saved = forms.RECOMPUTE_CHUNKS
        forms.RECOMPUTE_CHUNKS = chunks // 2
        try:
            coarse = forms.recompute_chunk_count(batch)
            metas.append(write_step(out_dir, f"{name}_dp_coarse", dp_step(), args,
                                    {**extra, "kind": "dp_coarse", "recompute_chunks": coarse}))
        finally:
            forms.RECOMPUTE_CHUNKS = saved
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


def doubled_corrected(dp, doubled, chunks):
    """The DP step's flops and bytes with every trip counted, from two chunks per trip.

    XLA reports `A + w` for the step (one trip's work w counted) and `A + 2 w`
    for the same step with two chunks per trip (`CASE_dp_doubled`: the same
    chunk shapes): w is their difference, and the step's cost is `A + n w`.
    The check of the unrolled count: no assumption about how a chunk's cost
    grows with its size (the coarse correction's), only that XLA counts two
    chunks of the same shapes as twice one.
    """
    out = dict(dp)
    for key in ("GFLOP", "GB_accessed"):
        out[key] = dp[key] + (chunks - 1) * (doubled[key] - dp[key])
    return out


# -- Per-layer analysis -----------------------------------------------------------------------


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
    from tfdp.dp.ghost_norms import forms
    from tfdp.models import ws_conv2d
    model_name, batch, _, res, name = parse_case(case)
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
        form = getattr(set_form, "real", forms.choose_form)(t, p, d, ws)  # tfdp's own pick
        meta = write_step(out_dir, f"{name}_layer{index:02d}", fn, (a, g), {
            "layer": layer.name, "T": t, "p": p, "d": d, "ws": ws, "tfdp_form": form,
            "rule_form": forms.choose_form(t, p, d, ws),
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


def run_jax(jax_python, out_dir, names, replay_seconds, target="default"):
    """Runs xla_step_cost_jax.py in the side interpreter for `target`; {name: record}.

    A step the target's compiler refuses raises (RuntimeError, with its message).
    """
    command = [jax_python, JAX_SCRIPT, out_dir, *names, f"--seconds={replay_seconds}",
               f"--target={target}"]
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
    failed = {n: r["error"] for n, r in records.items() if "error" in r}
    if failed:
        raise RuntimeError(f"{target} did not compile {sorted(failed)}: {failed}")
    return records


def every_trip_counted(metas, costs):
    """The DP step's record with its loops' every trip in GFLOP and GB_accessed (see the docstring).

    From `CASE_dp_unrolled` where exported (`count`: "unrolled"), else from
    `CASE_dp_coarse` (`loop_corrected`: "linear"), else the step's own
    ("as compiled": one chunk, every loop runs once). `temp_MB` is always
    the step's own (the loops' memory). `GFLOP_loops_once` /
    `GB_loops_once`: the step's own analysis. `exact`: the program counted
    has no more while loops than the step minus those unrolled (a TPU's
    compiled program does not show trip counts, so loops are counted, not
    their trips: what is left is the loop whose trip count is not static,
    the non-finite fallback's, counted as XLA counts a conditional).
    """
    by_kind = {m["kind"]: m for m in metas}
    dp_meta = by_kind["dp"]
    dp = costs[dp_meta["name"]]
    out = dict(dp, GFLOP_loops_once=dp["GFLOP"], GB_loops_once=dp["GB_accessed"])
    if "dp_unrolled" in by_kind:
        counted = costs[by_kind["dp_unrolled"]["name"]]
        out.update(GFLOP=counted["GFLOP"], GB_accessed=counted["GB_accessed"], count="unrolled",
                   unrolled_temp_MB=counted.get("temp_MB"))
        left = len(dp.get("loops") or []) - len(by_kind["dp_unrolled"].get("unrolled_trips", []))
        out["exact"] = len(counted.get("loops") or []) <= max(left, 0)
    elif "dp_coarse" in by_kind:
        out.update(loop_corrected(dp, costs[by_kind["dp_coarse"]["name"]],
                                  dp_meta["recompute_chunks"], by_kind["dp_coarse"]["recompute_chunks"]))
        out.update(count="linear", exact=False)
    else:
        out.update(count="as compiled", exact=dp_meta.get("recompute_chunks", 1) <= 1)
    return out


def ratio(dp, plain):
    return dp / plain if plain else float("nan")


def step_table(cases, costs):
    """One row per case: `costs[CASE_dp]` as `every_trip_counted` gives it (or a step's own)."""
    def mark(value, target):
        return f"{value:.2f}x" + ("" if value <= target else " (>)")
    timed = any("step_ms" in r for r in costs.values())
    head = ("| case | plain GFLOP | DP GFLOP | flops DP/plain | plain GB | DP GB | bytes DP/plain | "
            "plain temp MB | DP temp MB | temp DP/plain | DP loops once GFLOP / GB | count |")
    if timed:
        head += " plain ms | DP ms | time DP/plain |"
    lines = [head, "|---|" + "---|" * (head.count("|") - 2)]
    for case in cases:
        name = parse_case(case)[4]
        plain, dp = costs[f"{name}_plain"], costs[f"{name}_dp"]
        row = (f"| {case} | {plain['GFLOP']:.2f} | {dp['GFLOP']:.2f} | "
               f"{mark(ratio(dp['GFLOP'], plain['GFLOP']), TARGETS['flops'])} | "
               f"{plain['GB_accessed']:.3f} | {dp['GB_accessed']:.3f} | "
               f"{mark(ratio(dp['GB_accessed'], plain['GB_accessed']), TARGETS['bytes'])} | "
               f"{plain['temp_MB']:.1f} | {dp['temp_MB']:.1f} | "
               f"{mark(ratio(dp['temp_MB'], plain['temp_MB']), TARGETS['temp'])} | "
               f"{dp.get('GFLOP_loops_once', dp['GFLOP']):.2f} / "
               f"{dp.get('GB_loops_once', dp['GB_accessed']):.3f} | "
               f"{dp.get('count', 'as compiled')}{'' if dp.get('exact', True) else ' (lower bound)'} |")
        if timed:
            pm, dm = plain.get("step_ms", float("nan")), dp.get("step_ms", float("nan"))
            row += f" {pm:.2f} | {dm:.2f} | {ratio(dm, pm):.2f}x |"
        lines.append(row)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="wrn16_4:32,wrn16_4:128,nf_resnet50:8@224")
    parser.add_argument("--out_dir", default="/tmp/xla_step_cost")
    parser.add_argument("--jax_python", "--side_python", dest="jax_python", default=None,
                        help="a Python with JAX (jax[tpu] for a TPU target; required unless "
                             "--export_only)")
    parser.add_argument("--target", default="default",
                        help="where the steps compile: default (the side Python's JAX backend), "
                             "cpu, gpu, tpu:v4, tpu:v5e, tpu:v5p or tpu:v6e (libtpu's "
                             "compile-only client: no TPU needed)")
    parser.add_argument("--loops", choices=("unrolled", "doubled", "coarse", "all", "none"),
                        default="unrolled",
                        help="how the DP step's recompute loops get every trip counted: a variant "
                             "traced with them unrolled (exact), two chunks per trip (its check), "
                             "the old half-the-chunks linear correction, all three (the table "
                             "takes the unrolled), or none")
    parser.add_argument("--normalize_update", action="store_true",
                        help="the DP step with De et al.'s normalized update (imagenet.gin's)")
    parser.add_argument("--replay_seconds", type=float, default=0.0, help="0: no timing")
    parser.add_argument("--plan", choices=("tf32", "bf16", "host"), default="tf32",
                        help="the device the DP step's ghost rules plan for")
    parser.add_argument("--form", choices=("auto", "direct", "gram", "bu"), default="auto",
                        help="analysis only: force every kernel rule's form (auto: tfdp's choice)")
    parser.add_argument("--held", action="store_true",
                        help="analysis only: hold every direct-form gradient (no recompute; "
                             "ghost_norms.forms.RECOMPUTED_GRADIENTS = False)")
    parser.add_argument("--per_example_convs",
                        choices=("grouped", "per_example", "batch_grouped"), default=None,
                        help="how direct-form conv kernels build per-example gradients "
                             "(ghost_norms.forms.PER_EXAMPLE_CONVS; default: the plan's)")
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
        from tfdp.dp.ghost_norms import forms
        forms.RECOMPUTED_GRADIENTS = False
    if args.per_example_convs:
        from tfdp.dp.ghost_norms import forms
        forms.PER_EXAMPLE_CONVS = args.per_example_convs
        if loops_refused(args.loops):
            parser.error(loops_refused(args.loops))
    print(host.describe_host())
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"{' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}")
    for case in cases:
        if args.layers:
            metas = export_layers(case, args.out_dir, args.plan)
        else:
            metas = export_case(case, args.out_dir, args.plan, loops=args.loops,
                                normalize_update=args.normalize_update)
        for meta in metas:
            print(json.dumps(meta), flush=True)
        if args.export_only:
            continue
        costs = run_jax(args.jax_python, args.out_dir, [m["name"] for m in metas],
                        args.replay_seconds, target=args.target)
        backend = costs.pop("_backend", {})
        if not args.layers:
            by_kind = {m["kind"]: m for m in metas}
            if "dp_unrolled" in by_kind and len(by_kind) > 3:  # the checks of the unrolled count
                dp_meta = by_kind["dp"]
                dp, chunks = costs[dp_meta["name"]], dp_meta["recompute_chunks"]
                unrolled = costs[by_kind["dp_unrolled"]["name"]]
                others = {}
                if "dp_doubled" in by_kind:
                    others["doubled"] = doubled_corrected(dp, costs[by_kind["dp_doubled"]["name"]],
                                                          chunks)
                if "dp_coarse" in by_kind:
                    coarse = by_kind["dp_coarse"]
                    others["linear"] = loop_corrected(dp, costs[coarse["name"]], chunks,
                                                      coarse["recompute_chunks"])
                print(json.dumps({"name": dp_meta["name"], "unrolled_vs": {
                    way: {key: [round(other[key], 4), unrolled[key],
                                round(other[key] / unrolled[key] - 1.0, 4)]
                          for key in ("GFLOP", "GB_accessed")}
                    for way, other in others.items()}}))
            dp_name = by_kind["dp"]["name"]
            costs[dp_name] = every_trip_counted(metas, costs)
            print(json.dumps({"name": dp_name, "every_trip": {
                k: v for k, v in costs[dp_name].items()
                if "GFLOP" in k or "GB" in k or k in ("count", "exact", "temp_MB", "loops")}}))
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
