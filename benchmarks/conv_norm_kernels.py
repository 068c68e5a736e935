"""Per-example conv-kernel gradient norms: tfdp's two routes, side by side.

The direct form of a conv kernel's ghost norm (`tfdp.dp.ghost_norms`) builds
every example's kernel gradient either from the input's patches (the CPU
route) or as grouped convolutions with the batch as channels
(`conv2d_example_gradients`, the GPU and TPU route: `grouped_conv_gradients`).
This script times, side by side in one process over interleaved rounds
(medians), `conv2d_kernel_sq_norms` (squares and the weighted sum at unit
factors) on each route, and the plain batch's filter gradient for scale, with
or without XLA; and checks that the two routes' norms agree.

    python benchmarks/conv_norm_kernels.py --shape=32,32,32,64,64    # WRN-16-4 stage 1, B = 32
    python benchmarks/conv_norm_kernels.py --shape=32,32,32,64,128 --stride=2 --jit_compile
    python benchmarks/conv_norm_kernels.py --shape=32,32,32,16,64 --kernel=1  # a 1x1 shortcut
"""

import argparse
import statistics
import time

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp.dp import ghost_norms  # noqa: E402
from tfdp.dp.ghost_norms import forms  # noqa: E402  (the switches)


def variants(batch, height, width, channels, filters, kernel=3, stride=1, jit_compile=False):
    x = tf.random.stateless_normal([batch, height, width, channels], seed=[0, 1])
    out_h, out_w = -(-height // stride), -(-width // stride)
    g = tf.random.stateless_normal([batch, out_h, out_w, filters], seed=[0, 2])
    geometry = dict(kernel_size=(kernel, kernel), strides=(stride, stride),
                    dilation_rate=(1, 1), padding="same")

    def route(grouped):
        def norms():
            saved = forms.GROUPED_CONV_GRADIENTS, forms.RECOMPUTED_GRADIENTS
            # held on both routes: the routes' kernels, not the recompute, are compared here
            forms.GROUPED_CONV_GRADIENTS, forms.RECOMPUTED_GRADIENTS = grouped, False
            try:  # read while tracing
                squares, weighted_sum = ghost_norms.conv2d_kernel_sq_norms(x, g, **geometry)
                return squares, weighted_sum(tf.ones_like(squares))
            finally:
                forms.GROUPED_CONV_GRADIENTS, forms.RECOMPUTED_GRADIENTS = saved
        return tf.function(norms, jit_compile=jit_compile)

    @tf.function(jit_compile=jit_compile)
    def plain_filter_gradient():
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=[kernel, kernel, channels, filters], out_backprop=g,
            strides=[1, stride, stride, 1], padding="SAME")

    return {"patches (CPU route)": route(False), "grouped convolutions (GPU/TPU route)":
            route(True), "plain batch filter gradient": plain_filter_gradient}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="32,32,32,64,64",
                        help="batch,height,width,channels,filters")
    parser.add_argument("--kernel", type=int, default=3)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--jit_compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shape = [int(v) for v in args.shape.split(",")]
    print(host.describe_host())
    fns = variants(*shape, kernel=args.kernel, stride=args.stride, jit_compile=args.jit_compile)
    names = list(fns)
    a, b = fns[names[0]]()[0].numpy(), fns[names[1]]()[0].numpy()
    print(f"shape {shape}, {args.kernel}x{args.kernel} kernel, stride {args.stride}, "
          f"jit_compile={args.jit_compile}: max relative difference of the norms "
          f"{np.max(np.abs(a - b) / a):.1e}")
    for fn in fns.values():
        fn()  # trace
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), fn())
            times[name].append(1000 * (time.perf_counter() - start))
    for name, ms in times.items():
        print(f"{name}: {min(ms):.1f} / {statistics.median(ms):.1f} / {max(ms):.1f} ms "
              "(min / median / max)")


if __name__ == "__main__":
    main()
