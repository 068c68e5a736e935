"""A frozen public feature extractor: features computed once, a head trained on them.

One mechanism for every model whose trainable part is a head on a FIXED map
of the images: Tramer & Boneh 2021's ScatterNet (App. C.1) and the frozen trunk
of a pretrained backbone (De et al. 2022, Sec. 4, Table 20: last-layer
fine-tuning with augmult 0; Tramer & Boneh 2021, Sec. 5.2: transfer). The
map spends no privacy (it is public and data independent), so the trainer
(`tfdp.experiment`, stage 4) computes the features of every image once,
keeps them in memory (`tfdp.data.ArraySource`), trains only the head with
DP-SGD, and exports `compose(head)`, which takes uint8-range images again.
"""

import dataclasses
from typing import Callable, Optional

import keras
import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class FrozenFeatureExtractor:
    """A fixed map images -> features, the head trained on it, and their composition.

    Attributes:
      name: what the logs and errors call it, e.g. "scatternet".
      compute_features: `images -> features`: uint8 (or float in [0, 255])
        `[N, H, W, C]` -> np.float32 `[N, *feature_shape]`.
      compose: `head -> keras.Model` on images: float32 `[batch, H, W, C]` in
        [0, 255] -> logits, sharing the head's variables (what is exported).
      head: the head `keras.Model` on features when the extractor comes with
        one (a fine-tuning model), or None when the trainer builds it with
        `model_fn` on the feature shape (ScatterNet).
    """

    name: str
    compute_features: Callable[[np.ndarray], np.ndarray]
    compose: Callable[[keras.Model], keras.Model]
    head: Optional[keras.Model] = None


def compute_model_features(model, images, *, batch_size=256):
    """Runs a frozen `model` over a whole data set in inference mode, for caching.

    Args:
      model: a `keras.Model` on float32 images `[batch, H, W, C]` in [0, 255].
      images: uint8 (or float in [0, 255]) `[N, H, W, C]`.
      batch_size: images per forward pass (memory grows with it).

    Returns:
      np.float32 `[N, *model.output_shape[1:]]`.

    Raises:
      ValueError: if images is not rank 4 or batch_size < 1.
    """
    images = np.asarray(images)
    if images.ndim != 4:
        raise ValueError(f"compute_model_features: images of shape {images.shape} must be "
                         "[num_examples, height, width, channels].")
    if batch_size < 1:
        raise ValueError(f"compute_model_features: batch_size={batch_size!r} must be >= 1.")

    @tf.function(input_signature=[tf.TensorSpec((None, *images.shape[1:]), tf.float32)])
    def forward(batch):
        return model(batch, training=False)

    out = np.empty((images.shape[0], *model.output_shape[1:]), np.float32)
    for start in range(0, images.shape[0], batch_size):
        batch = images[start:start + batch_size].astype(np.float32)
        out[start:start + batch.shape[0]] = forward(batch).numpy()
    return out
