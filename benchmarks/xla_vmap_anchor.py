"""A measuring stick, not tfdp code: the reference's way to clip, compiled by XLA.

De et al. 2022 / jax_privacy clip with `jax.vmap` of the per-example
gradient: one global norm over the raw parameters (through weight
standardization); with augmult K the per-example loss is the mean over its
K views. This script builds, in JAX, `--model`

  - `wrn16_4` (default): WRN-16-4 on 32x32x3 images, 10 classes (GroupNorm
    with 16 groups + WS convs, the layout of jax_privacy's models/cifar.py);
  - `nf_resnet50`: NF-ResNet-50 on 224x224x3 images, 1000 classes (Scaled WS
    convs with gains and biases, the layout of `tfdp.models.build_nf_resnet`
    and of jax_privacy's models/imagenet_nfresnets.py);

compiles the plain SGD step (B K images) and the DP-SGD step (B examples x K
views) for `--target` (one chip of a TPU by libtpu's compile-only client, or
this CPU) and prints XLA's flops, bytes accessed and temp memory of each. It
has no loops: its figures count everything. `xla_step_cost.py` measures
tfdp's steps the same way (docs/performance.md has both).

    $TPU_VENV/bin/python benchmarks/xla_vmap_anchor.py [--target tpu:v5e|cpu] [--model M] \\
        [--augmult K] B [B ...]

`--model nf_resnet50 --logits IN.npz` instead loads the weights from IN.npz
(keyed by tfdp's variable paths, e.g. `stage1_block0/conv0/kernel`, plus
`images`: float32 [N, H, W, 3] pixels in [0, 255]), prints the logits as one
JSON line and stops: tests/benchmarks/xla_vmap_anchor_test.py checks that the
anchor computes tfdp's NF-ResNet-50.

Runs in the side venv of `xla_step_cost.py --target tpu:...` (jax[tpu]); no tfdp, no TensorFlow.
"""
import os

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no TPU metadata server to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import json, sys  # noqa: E401
import numpy as np
import jax, jax.numpy as jnp

TPU_TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
args = sys.argv[1:]
target = "tpu:v5e"; K = 1; model = "wrn16_4"
if "--model" in args:
    i = args.index("--model"); model = args[i + 1]; del args[i:i + 2]
if model not in ("wrn16_4", "nf_resnet50"):
    sys.exit(f"--model {model!r}: use wrn16_4 or nf_resnet50")
logits_npz = None
if "--logits" in args:
    i = args.index("--logits"); logits_npz = args[i + 1]; del args[i:i + 2]
if "--target" in args:
    i = args.index("--target"); target = args[i + 1]; del args[i:i + 2]
cpu = target == "cpu"
if "--augmult" in args:
    i = args.index("--augmult"); K = int(args[i + 1]); del args[i:i + 2]
BS = [int(a) for a in args] or [32]

def init(key, depth=16, width=4, nc=10):
    n = (depth - 4) // 6; ws = [16, 16 * width, 32 * width, 64 * width]
    keys = iter(jax.random.split(key, 100)); p = {}
    def conv(name, k, cin, cout):
        p[name] = {"w": jax.random.normal(next(keys), (k, k, cin, cout)) * (2.0 / (k * k * cin)) ** .5,
                   "g": jnp.ones((cout,)), "b": jnp.zeros((cout,))}
    def gn(name, c):
        p[name] = {"s": jnp.ones((c,)), "o": jnp.zeros((c,))}
    conv("stem", 3, 3, ws[0]); cin = ws[0]
    for s in range(3):
        for i in range(n):
            pre = f"s{s}b{i}"; cout = ws[s + 1]
            gn(pre + "gn1", cin); conv(pre + "c1", 3, cin, cout)
            gn(pre + "gn2", cout); conv(pre + "c2", 3, cout, cout)
            if cin != cout: conv(pre + "sc", 1, cin, cout)
            cin = cout
    gn("final", cin); p["fc"] = {"w": jax.random.normal(next(keys), (cin, nc)) * 0.01, "b": jnp.zeros((nc,))}
    return p, n

def wsconv(q, x, stride):
    w = q["w"]; m = w.mean((0, 1, 2)); v = w.var((0, 1, 2)); fan = np.prod(w.shape[:3])
    scale = jax.lax.rsqrt(jnp.maximum(v * fan, 1e-4)) * q["g"]
    w = w * scale - m * scale
    y = jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + q["b"] if "b" in q else y

def groupnorm(q, x, groups=16):
    b, h, w, c = x.shape; g = min(groups, c)
    xr = x.reshape(b, h, w, g, c // g); m = xr.mean((1, 2, 4), keepdims=True); v = xr.var((1, 2, 4), keepdims=True)
    return ((xr - m) * jax.lax.rsqrt(v + 1e-5)).reshape(b, h, w, c) * q["s"] + q["o"]

def wrn_apply(p, n, x):
    x = wsconv(p["stem"], x, 1)
    for s in range(3):
        for i in range(n):
            pre = f"s{s}b{i}"; stride = 2 if (s > 0 and i == 0) else 1
            h = jax.nn.relu(groupnorm(p[pre + "gn1"], x))
            y = wsconv(p[pre + "c1"], h, stride)
            y = wsconv(p[pre + "c2"], jax.nn.relu(groupnorm(p[pre + "gn2"], y)), 1)
            sc = wsconv(p[pre + "sc"], h, stride) if pre + "sc" in p else x
            x = y + sc
    x = jax.nn.relu(groupnorm(p["final"], x)).mean((1, 2))
    return x @ p["fc"]["w"] + p["fc"]["b"]

# NF-ResNet-50 (tfdp.models.build_nf_resnet's defaults: width 4, alpha 0.2, skip gains 1).
RELU_GAIN = float(np.sqrt(2.0 / (1.0 - 1.0 / np.pi)))
NF_ALPHA = 0.2  # the residual branch scale: the betas of nf_init and the sums of nf_apply

def nf_init(key, depths=(3, 4, 6, 3), nc=1000, alpha=NF_ALPHA):
    keys = iter(jax.random.split(key, 200)); p = {}; blocks = []
    def conv(name, k, cin, cout, bias=True):
        p[name] = {"w": jax.random.normal(next(keys), (k, k, cin, cout)) * (1.0 / (k * k * cin)) ** .5,
                   "g": jnp.ones((cout,))}
        if bias: p[name]["b"] = jnp.zeros((cout,))
    conv("stem", 7, 3, 64, bias=False); cin = 64; var = 1.0
    for s, (filters, depth, stride) in enumerate(zip((256, 512, 1024, 2048), depths, (1, 2, 2, 2))):
        for i in range(depth):
            pre = f"s{s}b{i}"; width = filters // 4; st = stride if i == 0 else 1
            conv(pre + "c0", 1, cin, width); conv(pre + "c1", 3, width, width); conv(pre + "c2", 1, width, filters)
            if cin != filters or st != 1: conv(pre + "sc", 1, cin, filters)
            p[pre + "skip"] = jnp.ones(())
            blocks.append((pre, st, float(np.sqrt(var)))); cin = filters
            var = (1.0 if i == 0 else var) + alpha ** 2
    p["fc"] = {"w": jax.random.normal(next(keys), (cin, nc)) * (1.0 / cin) ** .5, "b": jnp.zeros((nc,))}
    return p, blocks

def nf_apply(p, blocks, x, alpha=NF_ALPHA):
    x = x / 127.5 - 1.0
    x = wsconv(p["stem"], x, 2)
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    srelu = lambda v: jax.nn.relu(v) * RELU_GAIN
    for pre, st, beta in blocks:
        out = srelu(x) * (1.0 / beta)
        sc = wsconv(p[pre + "sc"], out, st) if pre + "sc" in p else x
        r = wsconv(p[pre + "c0"], out, 1)
        r = wsconv(p[pre + "c1"], srelu(r), st)
        r = wsconv(p[pre + "c2"], srelu(r), 1)
        x = sc + r * (p[pre + "skip"] * alpha)
    x = srelu(x).mean((1, 2))
    return x @ p["fc"]["w"] + p["fc"]["b"]

def xent(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]

if model == "wrn16_4":
    p0, n = init(jax.random.PRNGKey(0)); RES = 32; apply = wrn_apply
else:
    p0, n = nf_init(jax.random.PRNGKey(0)); RES = 224; apply = nf_apply

def nf_from_tfdp(named):
    """The anchor's NF-ResNet-50 parameters from tfdp's variable paths."""
    def conv(path):
        q = {"w": named[path + "/kernel"], "g": named[path + "/gain"]}
        if path + "/bias" in named: q["b"] = named[path + "/bias"]
        return q
    try:
        p = {"stem": conv("stem_conv"),
             "fc": {"w": named["logits/kernel"], "b": named["logits/bias"]}}
        for pre, _, _ in n:
            s_, b_ = pre[1:].split("b"); tf_pre = f"stage{int(s_) + 1}_block{b_}"
            for c in ("c0", "c1", "c2"):
                p[pre + c] = conv(f"{tf_pre}/conv{c[1]}")
            if f"{tf_pre}/conv_shortcut/kernel" in named: p[pre + "sc"] = conv(f"{tf_pre}/conv_shortcut")
            p[pre + "skip"] = named[f"{tf_pre}/skip_gain"]
    except KeyError as e:
        sys.exit(f"--logits: the weights have no {e}: not tfdp's NF-ResNet-50")
    if jax.tree.structure(p) != jax.tree.structure(p0):
        sys.exit("--logits: the weights do not match the anchor's NF-ResNet-50")
    return p

if logits_npz:
    if model != "nf_resnet50":
        sys.exit("--logits: only with --model nf_resnet50")
    with np.load(logits_npz) as z:
        named = {k: jnp.asarray(z[k]) for k in z.files}
    out = jax.jit(lambda p, x: apply(p, n, x))(nf_from_tfdp(named), named["images"])
    print(json.dumps({"logits": np.asarray(out, np.float64).tolist()}))
    sys.exit(0)

def plain_step(p, x, y):  # x: [B*K, RES, RES, 3]
    g = jax.grad(lambda p: xent(apply(p, n, x), y).mean())(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

def dp_step(p, x, y, key):  # x: [B, K, RES, RES, 3]; the per-example loss is the mean over K views
    def loss1(p, xi, yi):
        return xent(apply(p, n, xi), jnp.repeat(yi[None], xi.shape[0])).mean()
    g = jax.vmap(jax.grad(loss1), in_axes=(None, 0, 0))(p, x, y)
    norms = jnp.sqrt(sum(jnp.sum(jnp.reshape(a, (a.shape[0], -1)) ** 2, 1) for a in jax.tree.leaves(g)))
    f = jnp.minimum(1.0, 1.0 / (norms + 1e-12))
    s = jax.tree.map(lambda a: jnp.tensordot(f, a, 1), g)
    leaves, tdef = jax.tree.flatten(s); ks = jax.random.split(key, len(leaves))
    s = jax.tree.unflatten(tdef, [a + jax.random.normal(k, a.shape) for a, k in zip(leaves, ks)])
    return jax.tree.map(lambda a, b: a - 0.1 * b / x.shape[0], p, s)

if cpu:
    dev = jax.devices("cpu")[0]
else:
    from jax.experimental import topologies
    dev = topologies.get_topology_desc(topology_name=TPU_TOPOLOGIES[target.split(":", 1)[1]],
                                       platform="tpu").devices[0]
from jax.sharding import SingleDeviceSharding
sh = SingleDeviceSharding(dev)
spec = lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sh)
ps = jax.tree.map(spec, p0)
print(json.dumps({"model": model, "target": target, "device": str(getattr(dev, "device_kind", dev)), "jax": jax.__version__, "augmult": K, "params": int(sum(a.size for a in jax.tree.leaves(p0)))}), flush=True)
for B in BS:
    for name, fn, ins in (
            ("plain", plain_step, (jax.ShapeDtypeStruct((B * K, RES, RES, 3), jnp.float32, sharding=sh), jax.ShapeDtypeStruct((B * K,), jnp.int32, sharding=sh))),
            ("dp_vmap", dp_step, (jax.ShapeDtypeStruct((B, K, RES, RES, 3), jnp.float32, sharding=sh), jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh), jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sh)))):
        try:
            c = jax.jit(fn).lower(ps, *ins).compile()
            ca = c.cost_analysis(); ca = ca[0] if isinstance(ca, list) else ca
            m = c.memory_analysis()
            print(json.dumps({"B": B, "K": K, "step": name, "GFLOP": round(ca.get("flops", 0) / 1e9, 2),
                              "GB": round(ca.get("bytes accessed", 0) / 1e9, 3), "temp_MB": round(m.temp_size_in_bytes / 1e6, 1)}), flush=True)
        except Exception as e:
            print(json.dumps({"B": B, "step": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
