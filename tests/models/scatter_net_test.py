"""Tests for the ScatterNet layer and feature caching (Tramer & Boneh 2021, App. C.1)."""

import keras
import numpy as np
import pytest

pytest.importorskip("kymatio")

# pylint: disable=wrong-import-position
from tfdp.models.preprocessing import scatternet_input_layer
from tfdp.models.scatter_net import ScatterNet, num_scattering_paths
from tfdp.models.scatternet_models import (
    build_scatternet_classifier,
    build_scatternet_cnn,
    build_scatternet_linear,
    compute_scatternet_features,
)


def test_num_paths_for_j2_l8_is_81():
    # 1 low-pass + J*L = 16 first-order + L^2 * J(J-1)/2 = 64 second-order.
    assert num_scattering_paths(2, 8) == 81


@pytest.mark.parametrize(
    "image_shape, feature_shape", [((28, 28, 1), (7, 7, 81)), ((32, 32, 3), (8, 8, 243))]
)
def test_output_shapes_match_the_paper(image_shape, feature_shape):
    images = np.random.default_rng(0).uniform(0, 1, (2,) + image_shape).astype(np.float32)
    layer = ScatterNet()
    features = layer(images)
    assert tuple(features.shape) == (2,) + feature_shape
    assert features.dtype == "float32"
    assert layer.compute_output_shape((None,) + image_shape) == (None,) + feature_shape
    assert not layer.trainable_weights


def test_constant_image_has_only_the_low_pass_coefficient():
    # The low-pass filter averages (integral 1) and the wavelets have zero mean,
    # so a constant image v gives S0 = v and all other paths ~0.
    images = np.full((1, 28, 28, 1), 0.75, np.float32)
    features = ScatterNet()(images).numpy()
    np.testing.assert_allclose(features[..., 0], 0.75, rtol=1e-3)
    assert np.abs(features[..., 1:]).max() < 1e-3


def test_channels_are_ordered_input_channel_major():
    # Feature channel c * 81 + p is path p of input channel c (the authors'
    # `.view(-1, K, h, w)` of Kymatio's [B, C, 81, h, w] output).
    rgb = np.random.default_rng(1).uniform(0, 1, (1, 32, 32, 3)).astype(np.float32)
    features = ScatterNet()(rgb).numpy()
    gray = ScatterNet()
    for channel in range(3):
        alone = gray(rgb[..., channel : channel + 1]).numpy()
        np.testing.assert_allclose(
            features[..., channel * 81 : (channel + 1) * 81], alone, rtol=1e-4, atol=1e-5
        )


@pytest.mark.slow
def test_compute_features_applies_the_authors_scaling_in_batches():
    images = np.random.default_rng(2).integers(0, 256, (5, 28, 28, 1), dtype=np.uint8)
    features = compute_scatternet_features(images, batch_size=2)  # 3 batches, last partial
    assert features.shape == (5, 7, 7, 81) and features.dtype == np.float32
    expected = ScatterNet()(scatternet_input_layer(1)(images.astype(np.float32))).numpy()
    np.testing.assert_allclose(features, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_classifier_composes_scatternet_and_head():
    images = np.random.default_rng(3).integers(0, 256, (2, 28, 28, 1), dtype=np.uint8)
    head = build_scatternet_cnn((7, 7, 81), 10, groups=27)
    classifier = build_scatternet_classifier(head, (28, 28, 1))
    assert classifier.count_params() == head.count_params() == 33_066
    features = compute_scatternet_features(images, jit_compile=False)
    np.testing.assert_allclose(
        classifier(images.astype(np.float32)).numpy(), head(features).numpy(), atol=1e-4
    )


def test_classifier_rejects_a_head_of_the_wrong_shape():
    head = build_scatternet_linear((8, 8, 243), 10)
    with pytest.raises(ValueError, match="head expects features of shape \\(8, 8, 243\\)"):
        build_scatternet_classifier(head, (28, 28, 1))


def test_saving_round_trip(tmp_path):
    head = build_scatternet_linear((7, 7, 81), 10, groups=9)
    classifier = build_scatternet_classifier(head, (28, 28, 1))
    path = str(tmp_path / "scatternet.keras")
    classifier.save(path)
    loaded = keras.models.load_model(path)
    images = np.random.default_rng(4).uniform(0, 255, (1, 28, 28, 1)).astype(np.float32)
    np.testing.assert_allclose(loaded(images).numpy(), classifier(images).numpy(), atol=1e-5)


def test_rejects_image_sizes_not_divisible_by_four():
    with pytest.raises(ValueError, match="divisible by 2\\*\\*num_scales = 4"):
        ScatterNet()(np.zeros((1, 30, 30, 1), np.float32))
