"""Per-example gradient norms of a weight-standardized model: raw kernels against standardized ones.

De et al. 2022 (Sec. 3.1, App. C.1) clip each example's gradient with respect to the raw kernels
W of its weight-standardized convolutions, through the standardization `W_hat = (W - mean) *
scale`: per output channel o, `dL/dW_o = scale_o P_o dL/dW_hat_o`, with P_o the projection that
removes the component along 1 and along W_hat_o. Clipping with respect to W_hat instead (and
applying the standardization's Jacobian to the noisy sum, which is post-processing) would take
the projection out of every per-example pass, the pass that keeps a TPU's per-example norms
from fusing into their convolutions (docs/performance.md, "What a per-example form can reach on
a TPU"). This script measures how far apart the two clipped quantities are on real images:
for each of N examples, the norm of the whole per-example gradient (every trainable variable)
in the two parameterizations, and their ratio. A ratio of 1 would make the change free; the
further below 1, the harder clipping with respect to W_hat clips that example than the
paper's recipe does, and the more the ratio varies across examples, the less a single rescaled
clip norm can make up for it.

The standardized-kernel gradients come from a clone of the model whose WSConv2D layers are
plain Conv2D layers holding the standardized kernels (the same function of the input; the
script checks the logits agree).

Usage (the venv of README's command 1; Fashion-MNIST from `tools/prepare_fashion_mnist.py`):
  python benchmarks/ws_clip_space.py [--model wrn16_4] [--norm_order conv_gn_relu]
      [--examples 64] [--train_steps 0] [--data fashion_mnist|generated] [--seed 0]
The model is measured at its initialization (the builder's, seeded by `--seed`), or after
`--train_steps` steps of non-private SGD (batch 32, learning rate 0.1, momentum 0.9) on 6,000
training images of another draw, which may share some with the measured ones (`train_loss`:
the mean of the last 20 steps' losses). Prints the host line, then one JSON line.
"""

import argparse
import json

import numpy as np

from tfdp import host

host.enable_onednn()  # before TensorFlow's import, which reads TF_ENABLE_ONEDNN_OPTS

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdp.models.wide_resnet import build_wide_resnet  # noqa: E402
from tfdp.models.ws_conv2d import WSConv2D  # noqa: E402

_DEPTH_WIDTH = {"wrn16_4": (16, 4), "wrn10_1": (10, 1)}


def load_images(data, count, seed):
    """float32 `[count, 32, 32, 1]` pixels in [0, 255] and int `[count]` labels.

    The model's first layer rescales pixels itself (`build_wide_resnet`); Fashion-MNIST's
    28 x 28 images are padded with black to 32 x 32.
    """
    rng = np.random.default_rng(seed)
    if data == "generated":
        images = rng.integers(0, 256, (count, 28, 28, 1)).astype(np.uint8)
        labels = rng.integers(0, 10, count)
    else:
        import tensorflow_datasets as tfds
        source = tfds.data_source("fashion_mnist", split="train")
        chosen = rng.choice(len(source), count, replace=False)
        records = [source[int(i)] for i in chosen]
        images = np.stack([r["image"] for r in records])
        labels = np.array([r["label"] for r in records])
    return np.pad(images.astype(np.float32), [[0, 0], [2, 2], [2, 2], [0, 0]]), labels


def standardized_clone(model):
    """The same function with every WSConv2D a Conv2D holding the kernel it convolves with.

    Only the model's own layers are replaced: a WS convolution inside a subclassed block
    (NF-ResNet's `NFResBlock`) is out of `keras.models.clone_model`'s reach, so NF-ResNets are
    not measured.
    """
    def clone_layer(layer):
        if not isinstance(layer, WSConv2D):
            return layer.__class__.from_config(layer.get_config())
        config = keras.layers.Conv2D(1, 1).get_config()
        config.update({k: v for k, v in layer.get_config().items() if k in config})
        return keras.layers.Conv2D.from_config(config)

    clone = keras.models.clone_model(model, clone_function=clone_layer)
    for source, target in zip(model.layers, clone.layers):
        if isinstance(source, WSConv2D):
            weights = [source.standardized_kernel().numpy()]
            weights += [source.bias.numpy()] if source.use_bias else []
        else:
            weights = [w.numpy() for w in source.weights]
        target.set_weights(weights)
    return clone


def per_example_norms(model, images, labels):
    """float64 `[N]`: each example's whole gradient norm (every trainable variable)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def squared_norm(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[None], model(x[None], training=False))
        grads = tape.gradient(loss, model.trainable_variables)
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float64) ** 2) for g in grads])

    return np.sqrt([float(squared_norm(x, y)) for x, y in zip(images, labels)])


def train(model, images, labels, steps, seed):
    """`steps` of non-private SGD (batch 32, learning rate 0.1, momentum 0.9).

    Returns the mean of the last 20 steps' losses, or None for no step.
    """
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    rng = np.random.default_rng(seed + 1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(step(images[chosen], labels[chosen]))
              for chosen in (rng.integers(0, len(images), 32) for _ in range(steps))]
    return float(np.mean(losses[-20:])) if losses else None


def summary(values):
    return {"median": float(np.median(values)), "p10": float(np.percentile(values, 10)),
            "p90": float(np.percentile(values, 90)), "min": float(np.min(values)),
            "max": float(np.max(values))}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(_DEPTH_WIDTH), default="wrn16_4")
    parser.add_argument("--norm_order", choices=("conv_gn_relu", "conv_relu_gn"),
                        default="conv_gn_relu")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--train_steps", type=int, default=0)
    parser.add_argument("--data", choices=("fashion_mnist", "generated"), default="fashion_mnist")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.examples < 1 or args.train_steps < 0:
        parser.error(f"--examples={args.examples}, --train_steps={args.train_steps}: measure "
                     "at least 1 example after 0 or more steps")

    keras.utils.set_random_seed(args.seed)
    images, labels = load_images(args.data, args.examples, args.seed)
    depth, width = _DEPTH_WIDTH[args.model]
    model = build_wide_resnet(depth, width, 10, input_shape=(32, 32, 1),
                              norm_order=args.norm_order)
    train_loss = None
    if args.train_steps:
        train_loss = train(model, *load_images(args.data, 6000, args.seed + 1),
                           args.train_steps, args.seed)
    clone = standardized_clone(model)
    gap = float(np.max(np.abs(model(images[:8]).numpy() - clone(images[:8]).numpy())))
    if gap > 1e-4:
        raise SystemExit(f"the clone's logits differ from the model's by {gap:.3g}: "
                         "it is not the same function, so its gradients would not be W_hat's")
    raw = per_example_norms(model, images, labels)
    standardized = per_example_norms(clone, images, labels)
    print(host.describe_host())
    print(json.dumps({
        "model": args.model, "norm_order": args.norm_order, "data": args.data,
        "seed": args.seed, "train_steps": args.train_steps, "train_loss": train_loss,
        "examples": args.examples, "logit_gap": gap,
        "raw_over_standardized": summary(raw / standardized),
        "norm_raw": summary(raw), "norm_standardized": summary(standardized)}))


if __name__ == "__main__":
    main()
