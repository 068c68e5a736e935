"""Per-example conv-kernel gradient norms: tfdp's patches vs a grouped filter gradient.

A candidate for the WRN-16-4 ghost step (BUILD.md, issue 11): the per-example
kernel gradients of a 3x3 'same' convolution of B examples are one
`Conv2DBackpropFilter` of a grouped convolution with B groups, where the batch
is folded into the channels ([1, H, W, B*C] by [1, H, W, B*O]). This script
times, side by side in one process over interleaved rounds (medians), the
per-example squared norms by `tfdp.dp.ghost_norms.conv2d_kernel_sq_norms`
(patches, then per-example products), by the grouped filter gradient, and
the plain batch's filter gradient for scale; and checks that the two norms
agree.

    python benchmarks/conv_norm_kernels.py --shape=32,32,32,64,64    # WRN-16-4 stage 1, B = 32
    python benchmarks/conv_norm_kernels.py --shape=32,16,16,128,128  # stage 2
"""

import argparse
import statistics
import time

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp.dp import ghost_norms  # noqa: E402


def variants(batch, height, width, channels, filters):
    x = tf.random.stateless_normal([batch, height, width, channels], seed=[0, 1])
    g = tf.random.stateless_normal([batch, height, width, filters], seed=[0, 2])

    @tf.function
    def patches():
        squares, _ = ghost_norms.conv2d_kernel_sq_norms(
            x, g, kernel_size=(3, 3), strides=(1, 1), dilation_rate=(1, 1), padding="same")
        return squares

    @tf.function
    def grouped():
        folded_x = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, height, width, -1])
        folded_g = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, height, width, -1])
        kernels = tf.raw_ops.Conv2DBackpropFilter(
            input=folded_x, filter_sizes=[3, 3, channels, batch * filters],
            out_backprop=folded_g, strides=[1, 1, 1, 1], padding="SAME")
        kernels = tf.reshape(kernels, [3, 3, channels, batch, filters])
        return tf.reduce_sum(tf.square(kernels), axis=[0, 1, 2, 4])

    @tf.function
    def plain_filter_gradient():
        return tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=[3, 3, channels, filters], out_backprop=g,
            strides=[1, 1, 1, 1], padding="SAME")

    return {"patches (tfdp)": patches, "grouped filter gradient": grouped,
            "plain batch filter gradient": plain_filter_gradient}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="32,32,32,64,64",
                        help="batch,height,width,channels,filters")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shape = [int(v) for v in args.shape.split(",")]
    print(host.describe_host())
    fns = variants(*shape)
    a, b = fns["patches (tfdp)"]().numpy(), fns["grouped filter gradient"]().numpy()
    print(f"shape {shape}: max relative difference of the norms {np.max(np.abs(a - b) / a):.1e}")
    for fn in fns.values():
        fn()  # trace
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    for name, ms in times.items():
        print(f"{name}: {min(ms):.1f} / {statistics.median(ms):.1f} / {max(ms):.1f} ms "
              "(min / median / max)")


if __name__ == "__main__":
    main()
