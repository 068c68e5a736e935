"""Exports the private model as a SavedModel that serves uint8 images."""

import os
import shutil

import keras
import tensorflow as tf

PRIVACY_REPORT_ASSETS = ("privacy_report.json", "privacy_report.md")
OUTPUT_KEY = "logits"


def export_saved_model(model, export_dir, *, image_shape, asset_paths=()):
    """Writes a SavedModel whose `serve` signature maps uint8 images to logits.

    Written with Keras' own `keras.export.ExportArchive`, so it loads with
    `saved_model_cli run`, `tf.saved_model.load(...).signatures["serve"]` and
    `keras.layers.TFSMLayer`. The model's own first layer scales pixels with
    fixed constants, so the signature needs no other preprocessing. The
    directory is written to a temporary sibling and renamed into place, so
    `export_dir` exists only when the export is complete.

    Args:
      model: a built `keras.Model` mapping float32 `[batch, height, width,
        channels]` in [0, 255] to logits `[batch, num_classes]`.
      export_dir: where the SavedModel goes (replaced if it exists).
      image_shape: `(height, width, channels)` of the served images.
      asset_paths: files copied into the SavedModel's `assets/` folder (the
        privacy report), next to the model they describe.

    Returns:
      `export_dir`.

    Signature:
      `serve(images: uint8 [batch, height, width, channels])
       -> {"logits": float32 [batch, num_classes]}`, also `serving_default`.
      Images of another height, width or channel count fail with a message
      that names the expected `[batch, H, W, C]` uint8 shape; another dtype
      is refused by the signature itself.
    """
    image_shape = tuple(int(d) for d in image_shape)
    expected = f"uint8 images [batch, {', '.join(map(str, image_shape))}] ([batch, H, W, C])"

    def serve(images):
        tf.debugging.assert_equal(
            tf.shape(images)[1:], tf.constant(image_shape, tf.int32),
            message=f"serve expects {expected}; got another image shape",
        )
        return {OUTPUT_KEY: model(tf.cast(images, tf.float32), training=False)}

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(
        "serve", serve,
        input_signature=[tf.TensorSpec([None, *image_shape], tf.uint8, name="images")],
    )
    tmp_dir = export_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    archive.write_out(tmp_dir, verbose=False)
    os.makedirs(os.path.join(tmp_dir, "assets"), exist_ok=True)
    for path in asset_paths:
        shutil.copy(path, os.path.join(tmp_dir, "assets", os.path.basename(path)))
    shutil.rmtree(export_dir, ignore_errors=True)
    os.replace(tmp_dir, export_dir)
    return export_dir
