"""Image augmentations and augmentation-multiplicity views for tf.data.

Per-image functions `fn(image: float32 [H, W, C], seed: int [2]) -> float32
[H', W', C]` (values in [0, 255]) live in `augmentations`; `views` turns one of
them into K views per example, `[batch, K, H', W', C]` (De et al. 2022,
Sec. 3.1); `augtest` adds test-time augmentation voting (Sander et al. 2023,
Sec. 4.2).
"""

from tfdp.augment.augmentations import (
    AUGMENTATIONS,
    RRC_RATIO,
    RRC_SCALE,
    cifar_crop_flip,
    get_augmentation,
    identity,
    imagenet_resize_crop,
    mnist_crop,
    random_resized_crop,
    simclr_like,
)
from tfdp.augment.augtest import augtest_views, majority_vote
from tfdp.augment.views import (
    as_seed,
    augment_dataset,
    augmult_views,
    example_keyed_views,
    make_augmult_map_fn,
    to_uint8_pixels,
)

__all__ = [
    "AUGMENTATIONS",
    "RRC_RATIO",
    "RRC_SCALE",
    "as_seed",
    "augment_dataset",
    "augmult_views",
    "augtest_views",
    "example_keyed_views",
    "cifar_crop_flip",
    "get_augmentation",
    "identity",
    "imagenet_resize_crop",
    "majority_vote",
    "make_augmult_map_fn",
    "mnist_crop",
    "random_resized_crop",
    "simclr_like",
    "to_uint8_pixels",
]
