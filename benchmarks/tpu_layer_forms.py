"""Per-layer forms of per-example conv kernel gradients, as one TPU chip's compiler costs them.

Compile-only (libtpu's deviceless client, no TPU needed): for each WRN-16-4 convolution shape
and chunk size n (and K augmult views per example), compiles each way of computing the n
examples' kernel gradients, or what the DP step does with them, and prints one JSON line per
(layer, n, K, form, precision) with XLA's cost analysis of the TPU program (GFLOP, GB accessed),
its temp memory (MB), the compiler's estimated cycles of the program's top-level instructions
(`Mcycles`, from their backend_config: unlike the flops, it sees HIGHEST's extra passes) and the
convolutions/dots of the optimized HLO (from `tpu_hlo_ops`):

  grouped  tfdp's form (`conv.conv2d_example_gradients`): the input transposed to [C, H, W, n],
           the output gradient to a depthwise kernel [oh, ow, 1, n O], one convolution with
           feature_group_count = n per stride phase (and per view), as tf.nn.depthwise_conv2d
           lowers; the result [C, kh, kw, n O].
  vmap     jax.vmap of jax.grad of one example's conv (the reference's per-example gradient).
  batch_grouped: tfdp's batch-group route: the input as [n C, H, W, 1], the output gradient as
           the filter [oh, ow, 1, n O], one convolution with batch_group_count = n (stride 1,
           K = 1 only: an error record otherwise); norm_batch_grouped: then each example's squares.
  slices   im2col patches by slicing (no arithmetic, as tfdp's conv2d_patches) and einsum
           'nrd,nro->ndo' (a batched matmul).
  shifts   one batched matmul 'nrc,nro->nco' per kernel offset, over the input's strided
           slice for that offset (no patches materialized).
  patches  as slices, with JAX's `conv_general_dilated_patches` (a grouped conv builds them).
  plain    the kernel gradient of the whole chunk (the baseline: no per-example form is cheaper).
  gram     the Gram form's squared norms: per example sum_rs (p_r.p_s)(g_r.g_s), sliced patches.
  w1       the clipped weighted sum over held gradients h [n, kh, kw, C, O]: sum_i f_i h_i.
  w2       book-keeping's weighted sum: the plain kernel gradient of the factor-scaled g.
  loop     each example's kernel gradient as its own plain kernel-gradient conv (batch K),
           unrolled over the n examples (no groups, no patches).
  norm_slices_bf16: norm_slices with x and g rounded to bfloat16 first (the patches in bf16).
  norm_grouped / norm_vmap / norm_slices / norm_shifts: the form, then each example's squared norm
           (what the norms pass of the DP step computes; the held gradients are then dropped).
  norm_each  as norm_loop, but each example's squares taken from its own convolution's output,
           with no stack of the n gradients (the compiler can fuse the squares into the conv).
  norm_each_staged: as norm_each, the squares summed in stages of 32 (zero-padded), as
           tfdp's `precision.staged_sum` bounds its sums' rounding.
  norm_each_ws: as norm_each, each gradient first projected as weight standardization's chain
           rule does (`P_o h_o = h_o - mean(h_o) 1 - (u_o . h_o) u_o`, u the unit kernel, an
           input), its coefficients from h itself (two passes over h).
  norm_each_ws_pre: as norm_each_ws, the coefficients from the activations instead:
           `1 . h_o = sum_t box_t g_to` (box: the input's window sums) and `u_o . h_o = sum_t
           z_to g_to` (z: the layer's output before its gain, an input the forward pass made).
  sum_each_ws_pre: the recompute's clipped sum with norm_each_ws_pre's vectors: each example's
           vector built again, its squares, the reclip factor (f, first: inputs), accumulated.
  sum_each   the same without weight standardization.
  w2_ws      w2, then the projection of the sum (book-keeping for a WS kernel).

Every input is float32; `--precision` DEFAULT (one bf16 pass on a TPU, the compiler's choice)
and/or HIGHEST (float32-exact products: several bf16 passes, if the compiler splits them).
Outputs: the squared norms [n] where the form gives norms, else the gradients.

Usage (a venv with jax[tpu], $TPU_VENV; one libtpu process at a time):
  TPU_SKIP_MDS_QUERY=1 $TPU_VENV/bin/python benchmarks/tpu_layer_forms.py [--target v5e] [--n 8,16,32,128]
      [--k 1] [--layers all|NAME,...] [--forms all|grouped,vmap,...] [--precision DEFAULT,HIGHEST]
      [--dump DIR]
`--dump DIR` writes each case's optimized HLO text (DIR/layer_n_K_form_precision.hlo.txt).
  python benchmarks/tpu_layer_forms.py --table KEY OUT.jsonl...   (KEY: GFLOP, GB or temp_MB)
prints earlier runs' JSON lines as a markdown table: a row per (layer, n, K, precision), a
column per form (GFLOP also as a multiple of the plain kernel gradient's).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_hlo_ops  # noqa: E402

if sys.argv[1:2] != ["--table"]:  # the tables of earlier runs need no JAX
    import jax  # noqa: E402
    import jax.numpy as jnp  # noqa: E402
    from jax.sharding import SingleDeviceSharding  # noqa: E402

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}

# WRN-16-4 on 32x32 images: name -> (input size, C, O, kernel, stride)
LAYERS = {
    "stem_3x3_3_16": (32, 3, 16, 3, 1),
    "s1_3x3_16_64": (32, 16, 64, 3, 1),
    "s1_3x3_64_64": (32, 64, 64, 3, 1),
    "s1_1x1_16_64": (32, 16, 64, 1, 1),
    "s2_3x3s2_64_128": (32, 64, 128, 3, 2),
    "s2_3x3_128_128": (16, 128, 128, 3, 1),
    "s2_1x1s2_64_128": (32, 64, 128, 1, 2),
    "s3_3x3s2_128_256": (16, 128, 256, 3, 2),
    "s3_3x3_256_256": (8, 256, 256, 3, 1),
    "s3_1x1s2_128_256": (16, 128, 256, 1, 2),
}
# how many times each shape occurs in WRN-16-4 (for the whole-step estimate)
COUNT = {"stem_3x3_3_16": 1, "s1_3x3_16_64": 1, "s1_3x3_64_64": 3, "s1_1x1_16_64": 1,
         "s2_3x3s2_64_128": 1, "s2_3x3_128_128": 3, "s2_1x1s2_64_128": 1,
         "s3_3x3s2_128_256": 1, "s3_3x3_256_256": 3, "s3_1x1s2_128_256": 1}

DN = ("NHWC", "HWIO", "NHWC")


def same_pad(size, k, s):
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def geometry(name):
    size, c, o, k, s = LAYERS[name]
    pad = same_pad(size, k, s)
    out = -(-size // s)
    return size, c, o, k, s, pad, out


def conv(x, w, s, pad, prec):
    return jax.lax.conv_general_dilated(x, w, (s, s), (pad, pad), dimension_numbers=DN,
                                        precision=prec)


def grouped(x, g, k, s, pad, views, prec):
    """tfdp's conv2d_example_gradients: [n, k, k, C, O] of x [n K, H, W, C], g [n K, oh, ow, O]."""
    x = jnp.pad(x, ((0, 0), pad, pad, (0, 0)))
    out_h = g.shape[1]
    read = (out_h - 1) * s + k
    x = x[:, :read, :read]
    c, o = x.shape[-1], g.shape[-1]
    total = None
    for v in range(views):
        a, gv = x[v::views], g[v::views]
        n = a.shape[0]
        kernel = jnp.transpose(gv, (1, 2, 0, 3)).reshape(out_h, out_h, 1, n * o)
        phases = {}
        for r in range(min(s, k)):
            for t in range(min(s, k)):
                ph = a[:, r::s, t::s] if s > 1 else a
                lhs = jnp.transpose(ph, (3, 1, 2, 0))  # [C, H', W', n]
                phases[r, t] = jax.lax.conv_general_dilated(
                    lhs, kernel, (1, 1), "VALID", dimension_numbers=DN,
                    feature_group_count=n, precision=prec)  # [C, ka, kb, n O]
        if s > 1:
            ka = -(-k // s)
            rows = []
            for r in range(s):
                row = []
                for t in range(s):
                    if (r, t) in phases:
                        b = phases[r, t]
                        row.append(jnp.pad(b, ((0, 0), (0, ka - b.shape[1]), (0, ka - b.shape[2]),
                                               (0, 0))))
                    else:
                        row.append(jnp.zeros_like(phases[0, 0]))
                rows.append(jnp.stack(row, axis=3))
            grid = jnp.stack(rows, axis=2).reshape(c, ka * s, ka * s, -1)
            out = grid[:, :k, :k]
        else:
            out = phases[0, 0]
        total = out if total is None else total + out
    n = x.shape[0] // views
    return jnp.transpose(total.reshape(c, k, k, n, o), (3, 1, 2, 0, 4))


def batch_grouped(x, g, k, s, pad, views, prec):
    """tfdp's batch-group route (`forms.PER_EXAMPLE_CONVS = "batch_grouped"`), stride 1, K = 1:
    the input as [n C, H, W, 1], example-major, the output gradient as the filter
    [oh, ow, 1, n O], one convolution with batch_group_count = n; [n, k, k, C, O]."""
    if s != 1 or views != 1:
        raise ValueError("batch_grouped: stride 1 and K = 1 only here")
    x = jnp.pad(x, ((0, 0), pad, pad, (0, 0)))
    n, c = x.shape[0], x.shape[-1]
    oh, o = g.shape[1], g.shape[-1]
    x = x[:, :oh + k - 1, :oh + k - 1]
    lhs = jnp.transpose(x, (0, 3, 1, 2)).reshape(n * c, x.shape[1], x.shape[2], 1)
    rhs = jnp.transpose(g, (1, 2, 0, 3)).reshape(oh, oh, 1, n * o)
    out = jax.lax.conv_general_dilated(lhs, rhs, (1, 1), "VALID", dimension_numbers=DN,
                                       batch_group_count=n, precision=prec)  # [C, k, k, n O]
    return jnp.transpose(out.reshape(c, k, k, n, o), (3, 1, 2, 0, 4))


def vmapped(x, g, k, s, pad, views, prec):
    n = x.shape[0] // views
    c, o = x.shape[-1], g.shape[-1]
    xs = x.reshape(n, views, *x.shape[1:])
    gs = g.reshape(n, views, *g.shape[1:])
    w0 = jnp.zeros((k, k, c, o), x.dtype)

    def one(xi, gi):
        _, vjp = jax.vjp(lambda w: conv(xi, w, s, pad, prec), w0)
        return vjp(gi)[0]

    return jax.vmap(one)(xs, gs)


def patches(x, k, s, pad, prec):
    p = jax.lax.conv_general_dilated_patches(x, (k, k), (s, s), (pad, pad),
                                             dimension_numbers=DN, precision=prec)
    return p.reshape(p.shape[0], -1, p.shape[-1])  # [n K, R, C k k] (channel-major order)


def sliced_patches(x, k, s, pad):
    """im2col by slicing (as tfdp's `conv.conv2d_patches`): [n K, R, k k C], no arithmetic."""
    x = jnp.pad(x, ((0, 0), pad, pad, (0, 0)))
    out = (x.shape[1] - k) // s + 1
    cols = [x[:, y:y + (out - 1) * s + 1:s, t:t + (out - 1) * s + 1:s]
            for y in range(k) for t in range(k)]
    p = jnp.concatenate(cols, axis=-1) if len(cols) > 1 else cols[0]
    return p.reshape(p.shape[0], -1, p.shape[-1])


def slice_form(x, g, k, s, pad, views, prec):
    n = x.shape[0] // views
    p = sliced_patches(x, k, s, pad)
    p = p.reshape(n, -1, p.shape[-1])
    gg = g.reshape(n, -1, g.shape[-1])
    return jnp.einsum("nrd,nro->ndo", p, gg, precision=prec)


def shift_form(x, g, k, s, pad, views, prec):
    """One batched matmul 'nrc,nro->nco' per kernel offset over a strided slice of the input.

    No patches: each offset's slice can be read by its dot directly. [n, k, k, C, O].
    """
    n = x.shape[0] // views
    x = jnp.pad(x, ((0, 0), pad, pad, (0, 0)))
    out = g.shape[1]
    gg = g.reshape(n, -1, g.shape[-1])
    taps = []
    for y in range(k):
        for t in range(k):
            a = x[:, y:y + (out - 1) * s + 1:s, t:t + (out - 1) * s + 1:s]
            taps.append(jnp.einsum("nrc,nro->nco", a.reshape(n, -1, a.shape[-1]), gg,
                                   precision=prec))
    return jnp.stack(taps, axis=1).reshape(n, k, k, x.shape[-1], g.shape[-1])


def patch_form(x, g, k, s, pad, views, prec):
    n = x.shape[0] // views
    p = patches(x, k, s, pad, prec)
    p = p.reshape(n, -1, p.shape[-1])
    gg = g.reshape(n, -1, g.shape[-1])
    return jnp.einsum("nrd,nro->ndo", p, gg, precision=prec)


def plain(x, g, k, s, pad, prec):
    c, o = x.shape[-1], g.shape[-1]
    w0 = jnp.zeros((k, k, c, o), x.dtype)
    _, vjp = jax.vjp(lambda w: conv(x, w, s, pad, prec), w0)
    return vjp(g)[0]


def gram(x, g, k, s, pad, views, prec):
    n = x.shape[0] // views
    p = sliced_patches(x, k, s, pad).reshape(n, -1, k * k * x.shape[-1])
    gg = g.reshape(n, -1, g.shape[-1])
    a = jnp.einsum("nrd,nsd->nrs", p, p, precision=prec)
    b = jnp.einsum("nro,nso->nrs", gg, gg, precision=prec)
    return jnp.sum(a * b, axis=(1, 2))


def sq(h):
    return jnp.sum(jnp.square(h.reshape(h.shape[0], -1)), axis=1)


def staged(t):
    """`sum(t)` in stages of 32 terms (zero-padded), as `precision.staged_sum` sums."""
    t = t.reshape(-1)
    while t.shape[0] > 32:
        t = jnp.sum(jnp.pad(t, (0, -t.shape[0] % 32)).reshape(-1, 32), axis=1)
    return jnp.sum(t)


def ws_project(h, u):
    """`P_o h_o` of weight standardization's chain rule, coefficients from h: [k, k, C, O]."""
    centred = h - jnp.mean(h, axis=(0, 1, 2), keepdims=True)
    return centred - jnp.sum(centred * u, axis=(0, 1, 2), keepdims=True) * u


def window_sums(x, k, s, pad):
    """Each output position's sum of its input window over every channel: [n K, oh, ow]."""
    ones = jnp.ones((k, k, x.shape[-1], 1), x.dtype)
    return conv(x, ones, s, pad, jax.lax.Precision.HIGHEST)[..., 0]


def ws_coefficients(x, g, z, k, s, pad, views):
    """Per example and output channel, `mean(h_o)` and `u_o . h_o` from activations: [n, O] each."""
    n, c = x.shape[0] // views, x.shape[-1]
    box = window_sums(x, k, s, pad).reshape(n, -1)
    gg = g.reshape(n, -1, g.shape[-1])
    mean = jnp.sum(box[:, :, None] * gg, axis=1) / (k * k * c)
    along = jnp.sum(z.reshape(n, -1, z.shape[-1]) * gg, axis=1)
    return mean, along


def reclip(f, first, again):
    return f * jnp.where(again <= first, 1.0, jnp.sqrt(first / again))


def build(form, name, n, views, prec):
    """(function, argument specs)."""
    size, c, o, k, s, pad, out = geometry(name)
    x = jax.ShapeDtypeStruct((n * views, size, size, c), jnp.float32)
    g = jax.ShapeDtypeStruct((n * views, out, out, o), jnp.float32)
    f = jax.ShapeDtypeStruct((n,), jnp.float32)
    h = jax.ShapeDtypeStruct((n, k, k, c, o), jnp.float32)
    h0 = jax.ShapeDtypeStruct((k, k, c, o), jnp.float32)  # one kernel: u, the unit kernel
    if form == "grouped":
        return (lambda x, g: grouped(x, g, k, s, pad, views, prec)), (x, g)
    if form == "vmap":
        return (lambda x, g: vmapped(x, g, k, s, pad, views, prec)), (x, g)
    if form == "batch_grouped":
        return (lambda x, g: batch_grouped(x, g, k, s, pad, views, prec)), (x, g)
    if form == "norm_batch_grouped":
        return (lambda x, g: sq(batch_grouped(x, g, k, s, pad, views, prec))), (x, g)
    if form == "patches":
        return (lambda x, g: patch_form(x, g, k, s, pad, views, prec)), (x, g)
    if form == "slices":
        return (lambda x, g: slice_form(x, g, k, s, pad, views, prec)), (x, g)
    if form == "norm_slices":
        return (lambda x, g: sq(slice_form(x, g, k, s, pad, views, prec))), (x, g)
    if form == "norm_slices_bf16":  # patches built from bf16 inputs (what one pass multiplies)
        def f16(x, g):
            n = x.shape[0] // views
            p = sliced_patches(x.astype(jnp.bfloat16), k, s, pad)
            p = p.reshape(n, -1, p.shape[-1])
            gg = g.astype(jnp.bfloat16).reshape(n, -1, g.shape[-1])
            return sq(jnp.einsum("nrd,nro->ndo", p, gg, preferred_element_type=jnp.float32))
        return f16, (x, g)
    if form in ("loop", "norm_loop"):  # each example's kernel gradient, one plain conv each
        def per_example(x, g):
            n = x.shape[0] // views
            h = jnp.stack([plain(x[i * views:(i + 1) * views], g[i * views:(i + 1) * views],
                                 k, s, pad, prec) for i in range(n)])
            return sq(h) if form == "norm_loop" else h
        return per_example, (x, g)
    if form == "shifts":
        return (lambda x, g: shift_form(x, g, k, s, pad, views, prec)), (x, g)
    if form == "norm_shifts":
        return (lambda x, g: sq(shift_form(x, g, k, s, pad, views, prec))), (x, g)
    if form == "norm_grouped":
        return (lambda x, g: sq(grouped(x, g, k, s, pad, views, prec))), (x, g)
    if form == "norm_vmap":
        return (lambda x, g: sq(vmapped(x, g, k, s, pad, views, prec))), (x, g)
    if form == "norm_patches":
        return (lambda x, g: sq(patch_form(x, g, k, s, pad, views, prec))), (x, g)
    if form == "plain":
        return (lambda x, g: plain(x, g, k, s, pad, prec)), (x, g)
    if form == "gram":
        return (lambda x, g: gram(x, g, k, s, pad, views, prec)), (x, g)
    if form == "w1":
        return (lambda f, h: jnp.einsum("n,nabco->abco", f, h, precision=prec)), (f, h)
    if form in ("w2", "w2_ws"):
        def w2(x, g, f, *u):
            gs = g * jnp.repeat(f, views)[:, None, None, None]
            total = plain(x, gs, k, s, pad, prec)
            return ws_project(total, u[0]) if u else total
        return w2, ((x, g, f, h0) if form == "w2_ws" else (x, g, f))
    if form in ("norm_each", "norm_each_staged", "norm_each_ws"):
        total = staged if form == "norm_each_staged" else jnp.sum

        def norm_each(x, g, *u):
            out = []
            for i in range(x.shape[0] // views):
                hi = plain(x[i * views:(i + 1) * views], g[i * views:(i + 1) * views],
                           k, s, pad, prec)
                out.append(total(jnp.square(ws_project(hi, u[0]) if u else hi)))
            return jnp.stack(out)
        return norm_each, ((x, g, h0) if form == "norm_each_ws" else (x, g))
    if form in ("norm_each_ws_pre", "sum_each_ws_pre", "sum_each"):
        ws = form != "sum_each"

        def vectors(x, g, u, z):
            mean, along = ws_coefficients(x, g, z, k, s, pad, views) if ws else (None, None)
            for i in range(x.shape[0] // views):
                hi = plain(x[i * views:(i + 1) * views], g[i * views:(i + 1) * views],
                           k, s, pad, prec)
                yield hi - mean[i] - along[i] * u if ws else hi

        def norms(x, g, u, z):
            return jnp.stack([jnp.sum(jnp.square(v)) for v in vectors(x, g, u, z)])

        def clipped_sum(x, g, u, z, f, first):
            total = 0.0
            for i, v in enumerate(vectors(x, g, u, z)):
                total = total + reclip(f[i], first[i], jnp.sum(jnp.square(v))) * v
            return total

        if form == "norm_each_ws_pre":
            return norms, (x, g, h0, g)
        if form == "sum_each_ws_pre":
            return clipped_sum, (x, g, h0, g, f, f)
        return (lambda x, g, f, first: clipped_sum(x, g, None, None, f, first)), (x, g, f, f)
    raise ValueError(form)


FORMS = ["plain", "grouped", "vmap", "slices", "shifts", "patches", "norm_grouped", "norm_vmap",
         "norm_slices", "norm_slices_bf16", "norm_shifts", "loop", "norm_loop", "norm_each",
         "norm_each_staged", "norm_each_ws", "norm_each_ws_pre", "gram", "w1", "w2", "w2_ws",
         "sum_each", "sum_each_ws_pre", "batch_grouped", "norm_batch_grouped"]


def table(paths, key="GFLOP"):
    """Markdown: per (layer, n, K, precision), each form's `key` (and GFLOP / the plain form's)."""
    rows, forms = {}, []
    for r in tpu_hlo_ops.json_records(paths):
        if "layer" not in r or "error" in r:
            continue
        rows.setdefault((r["layer"], r["n"], r["K"], r["precision"]), {})[r["form"]] = r
        if r["form"] not in forms:
            forms.append(r["form"])
    forms = [f for f in FORMS if f in forms]
    print("| layer | n | K | prec | " + " | ".join(forms) + " |")
    print("|---" * (4 + len(forms)) + "|")
    order = {name: i for i, name in enumerate(LAYERS)}
    for (layer, n, k, prec), by in sorted(rows.items(),
                                          key=lambda kv: (kv[0][2], kv[0][1], order[kv[0][0]],
                                                          kv[0][3])):
        base = by.get("plain", {}).get("GFLOP")
        cells = []
        for f in forms:
            if f not in by:
                cells.append("")
                continue
            v = by[f].get(key)
            if v is None:
                cells.append("")
                continue
            ratio = f" ({by[f]['GFLOP'] / base:.2g}x)" if base and key == "GFLOP" else ""
            cells.append(f"{v:.4g}{ratio}")
        print(f"| {layer} | {n} | {k} | {prec[:4]} | " + " | ".join(cells) + " |")


def main():
    if sys.argv[1:2] == ["--table"]:  # --table KEY FILE...: tables of earlier runs' JSON lines
        return table(sys.argv[3:], sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5e", choices=sorted(TOPOLOGIES))
    ap.add_argument("--n", default="8,16,32,128")
    ap.add_argument("--k", default="1")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--forms", default="all")
    ap.add_argument("--precision", default="DEFAULT,HIGHEST")
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    from jax.experimental import topologies
    dev = topologies.get_topology_desc(topology_name=TOPOLOGIES[args.target],
                                       platform="tpu").devices[0]
    sh = SingleDeviceSharding(dev)
    layers = list(LAYERS) if args.layers == "all" else args.layers.split(",")
    forms = FORMS if args.forms == "all" else args.forms.split(",")
    print(json.dumps({"target": args.target, "device_kind": dev.device_kind,
                      "jax": jax.__version__}), flush=True)
    for views in [int(v) for v in args.k.split(",")]:
        for n in [int(v) for v in args.n.split(",")]:
            for name in layers:
                size, c, o, k, s, pad, out = geometry(name)
                # the plain step's kernel-gradient MACs of these n K images, for reference
                base = 2 * n * views * out * out * k * k * c * o
                for form in forms:
                    for pname in args.precision.split(","):
                        prec = getattr(jax.lax.Precision, pname)
                        rec = {"layer": name, "n": n, "K": views, "form": form,
                               "precision": pname, "plain_model_GFLOP": round(base / 1e9, 4)}
                        try:
                            fn, specs = build(form, name, n, views, prec)
                            specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sh)
                                     for t in specs]
                            t0 = time.time()
                            comp = jax.jit(fn).lower(*specs).compile()
                            rec["compile_s"] = round(time.time() - t0, 2)
                            ca = comp.cost_analysis()
                            ca = ca[0] if isinstance(ca, list) else ca
                            m = comp.memory_analysis()
                            rec.update({"GFLOP": round(ca.get("flops", 0) / 1e9, 4),
                                        "GB": round(ca.get("bytes accessed", 0) / 1e9, 4),
                                        "temp_MB": round(m.temp_size_in_bytes / 1e6, 2),
                                        "arg_MB": round(m.argument_size_in_bytes / 1e6, 2)})
                            text = comp.as_text()
                            ops, top = tpu_hlo_ops.parse_module(text)
                            rec["ops_GFLOP"] = round(sum(op.flops for op in ops) / 1e9, 4)
                            # the compiler's own estimate: sees an operand precision's passes
                            rec["Mcycles"] = round(sum(t[7] for t in top) / 1e6, 4)
                            rec["ops"] = [op.short() for op in ops if op.flops]
                            if args.dump:
                                os.makedirs(args.dump, exist_ok=True)
                                with open(os.path.join(
                                        args.dump, f"{name}_n{n}_K{views}_{form}_{pname}.hlo.txt"),
                                        "w") as fh:
                                    fh.write(text)
                        except Exception as e:  # a form the compiler refuses: say so
                            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
