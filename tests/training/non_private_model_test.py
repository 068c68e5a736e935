"""NonPrivateModel: the non-private step is the plain mean-loss gradient step."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.training.non_private_model import NonPrivateModel


def _linear_model():
    inputs = keras.Input((2, 2, 1))
    x = keras.layers.Flatten()(inputs)
    outputs = keras.layers.Dense(3, kernel_initializer="ones", bias_initializer="zeros")(x)
    return keras.Model(inputs, outputs)


def _one_sgd_step(images, labels, mask=None, accumulation_steps=1):
    model = NonPrivateModel(_linear_model(), accumulation_steps=accumulation_steps)
    model.compile(optimizer=keras.optimizers.SGD(1.0))
    batch = (images, labels) if mask is None else (images, labels, mask)
    model.train_on_batch(*batch)
    return [v.numpy() for v in model.model.trainable_variables]


def _mean_loss_step(images, labels):
    """w - grad of the plain mean cross-entropy (what the step must equal)."""
    model = _linear_model()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            labels, model(images), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return [(v - g).numpy() for v, g in zip(model.trainable_variables, grads)]


def test_the_step_is_the_mean_loss_gradient_over_real_examples_only():
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (5, 2, 2, 1)).astype(np.float32)
    labels = np.array([0, 2, 1, 1, 0])
    expected = _mean_loss_step(images[:3], labels[:3])  # the 2 padded rows excluded
    mask = np.array([1, 1, 1, 0, 0], np.float32)
    for got in (_one_sgd_step(images, labels, mask),
                _one_sgd_step(images, labels, mask, accumulation_steps=2),
                _one_sgd_step(images[:3], labels[:3], accumulation_steps=3)):
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


def test_views_average_the_loss_per_example():
    # K = 2 identical views of each example give exactly the one-view step.
    rng = np.random.default_rng(1)
    images = rng.uniform(0, 255, (4, 2, 2, 1)).astype(np.float32)
    labels = np.array([0, 1, 2, 1])
    views = np.stack([images, images], axis=1)  # [4, 2, 2, 2, 1]
    for g, e in zip(_one_sgd_step(views, labels), _mean_loss_step(images, labels)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


_REPLICAS_SCRIPT = r"""
import sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from tfdp.training.non_private_model import NonPrivateModel

rng = np.random.default_rng(0)
images = rng.uniform(0, 255, (6, 2, 2, 1)).astype(np.float32)
labels = np.array([0, 2, 1, 1, 0, 2])
mask = np.array([1, 1, 1, 1, 1, 0], np.float32)  # 5 real examples: 3 + 2 over 2 replicas
results = []
for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        inputs = keras.Input((2, 2, 1))
        outputs = keras.layers.Dense(3, kernel_initializer="ones")(keras.layers.Flatten()(inputs))
        model = NonPrivateModel(keras.Model(inputs, outputs))
        model.compile(optimizer=keras.optimizers.SGD(1.0))
    ds = tf.data.Dataset.from_tensors((images, labels, mask))
    model.fit(strategy.experimental_distribute_dataset(ds), epochs=1, verbose=0)
    results.append(np.concatenate([v.numpy().ravel() for v in model.model.trainable_variables]))
np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-5)
print("SAME")
"""


@pytest.mark.slow  # a subprocess with 2 logical CPUs: about 20 s
def test_two_replicas_take_the_one_replica_step():
    # Each replica divides by the GLOBAL count of real examples; Keras SUMs the replicas.
    out = subprocess.run([sys.executable, "-c", _REPLICAS_SCRIPT], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "SAME" in out.stdout, out.stderr[-3000:]
