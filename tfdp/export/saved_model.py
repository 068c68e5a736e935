"""Exports the private model as a SavedModel that serves images with pixel values 0 to 255."""

import os
import shutil
import tempfile
import uuid

import keras
import tensorflow as tf

from tfdp import storage

PRIVACY_REPORT_ASSETS = ("privacy_report.json", "privacy_report.md")
# What a non-private run (`privacy=None`) puts into assets/ instead.
NOT_PRIVATE_ASSETS = ("NOT_PRIVATE.json", "NOT_PRIVATE.md")
OUTPUT_KEY = "logits"
# What `export_saved_model` writes: a folder with exactly these entries is an earlier export.
_EXPORT_ENTRIES = frozenset({"saved_model.pb", "fingerprint.pb", "variables", "assets"})


def export_saved_model(model, export_dir, *, image_shape, asset_paths=(), overwrite=False):
    """Writes a SavedModel whose `serve` signature maps images (pixel values 0 to 255) to logits.

    Written with Keras' own `keras.export.ExportArchive`, so it loads with
    `saved_model_cli run`, `tf.saved_model.load(...).signatures["serve"]` and
    `keras.layers.TFSMLayer`. The model's own first layer scales pixels with
    fixed constants, so the signature needs no other preprocessing.

    The SavedModel is written into a new folder with a unique name beside
    `export_dir` (`.NAME.tmp-XXXXXXXX`), then renamed into place, so
    `export_dir` holds a complete export or what it held before. (On an
    object store, a gs:// URL, nothing renames a folder atomically: an
    earlier export is removed and the new one written in place, and the
    trainer's FINISHED, written last, is what says it is complete.)
    Nothing but
    an earlier export is ever replaced: a non-empty `export_dir` must hold
    exactly what this function writes (`saved_model.pb`, `variables/`,
    `assets/` with only the privacy report or only the NOT_PRIVATE
    statement, `fingerprint.pb`) and
    `overwrite=True` must be given. On any error the temporary folder is
    removed.

    Args:
      model: a built `keras.Model` mapping float32 `[batch, height, width,
        channels]` in [0, 255] to logits `[batch, num_classes]`.
      export_dir: where the SavedModel goes: a new or empty folder, or an
        earlier export to replace (with `overwrite=True`).
      image_shape: `(height, width, channels)` of the served images.
      asset_paths: files copied into the SavedModel's `assets/` folder (the
        privacy report), next to the model they describe.
      overwrite: replace an earlier export in `export_dir`.

    Returns:
      `export_dir`.

    Raises:
      ValueError: `export_dir` is a file, a folder with other files, or an
        earlier export without `overwrite=True`; nothing is written then.

    Signature:
      `serve(images: float32 [batch, height, width, channels])
       -> {"logits": float32 [batch, num_classes]}`, also `serving_default`:
      pixel values in [0, 255], as uint8 images hold them. This is what
      `signatures["serve"]`, `saved_model_cli run` (a uint8 or float `.npy`
      is converted to float32) and TF Serving call. The loaded object's
      `serve` function also takes uint8 and float64 images (a `tf.Tensor`
      or NumPy array of those dtypes; a Python list is read as float32),
      and `keras.layers.TFSMLayer(path, call_endpoint="serve")` calls it.
      Refused with a message: images of another rank, height, width or
      channel count (the message names the expected `[batch, H, W, C]`);
      float values below 0, above 255 or NaN (images scaled to [-1, 1]);
      a float image whose largest value is in (0, 2] (an image scaled to
      [0, 1], also when resizing overshot 1 or when it is batched with
      [0, 255] images: pass `images * 255`). A real [0, 255] float image
      that dark is refused too; pass it as uint8, which is never read that
      way. A
      batch of 0 images gives 0 rows of logits. Other dtypes (int32, a
      float16 tensor) are refused by TensorFlow itself ("Could not find
      matching concrete function").
    """
    _check_target(export_dir, overwrite)
    serve = _serve_function(model, tuple(int(d) for d in image_shape))
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", serve)
    if storage.is_url(export_dir):
        _write_in_place(archive, export_dir, asset_paths, overwrite)
        return export_dir
    parent, name = os.path.split(os.path.abspath(export_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        archive.write_out(tmp_dir, verbose=False)
        os.makedirs(os.path.join(tmp_dir, "assets"), exist_ok=True)
        for path in asset_paths:
            shutil.copy(path, os.path.join(tmp_dir, "assets", os.path.basename(path)))
        _check_target(export_dir, overwrite)  # again: it may have changed meanwhile
        if os.path.isdir(export_dir) and os.listdir(export_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.replace(export_dir, old_dir)  # onto the empty old_dir
            try:
                os.replace(tmp_dir, export_dir)
            except OSError:
                os.replace(old_dir, export_dir)  # put the earlier export back
                raise
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.replace(tmp_dir, export_dir)  # a new name, or onto an empty folder
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return export_dir


def _serve_function(model, image_shape):
    """The `serve` tf.function of `export_saved_model`, traced for float32, uint8 and float64.

    float32 is traced first: it becomes the signature, and a Python list is
    converted to the first trace that fits.
    """
    shape_text = f"[batch, {', '.join(map(str, image_shape))}] ([batch, H, W, C])"
    num_classes = int(model.output_shape[-1])

    def checked_images(images):
        """`images` as float32 after the checks of its shape and, for floats, its range."""
        shape = tf.shape(images)
        right_shape = tf.cond(  # the rank first: shapes of two lengths do not compare
            tf.equal(tf.size(shape), 1 + len(image_shape)),
            lambda: tf.reduce_all(tf.equal(shape[1:], tf.constant(image_shape, tf.int32))),
            lambda: tf.constant(False))
        checks = [tf.debugging.Assert(right_shape, [
            f"serve expects images {shape_text}; got images of shape", shape])]
        if images.dtype != tf.uint8:
            checks.append(tf.debugging.Assert(
                tf.reduce_all(tf.logical_and(images >= 0, images <= 255)), [
                    f"serve expects {images.dtype.name} pixel values in [0, 255] (as uint8 "
                    "images hold them); this batch has a value below 0, above 255 or NaN. "
                    "Images scaled to [-1, 1]? Pass (images + 1) * 127.5."]))
            # Each image on its own (a batch may join several callers' images): its largest
            # value is 0 (black in any scale) or above 2 (a [0, 1] image resized may overshoot
            # 1 a little).
            largest = tf.reduce_max(images, axis=list(range(1, 1 + len(image_shape))))
            checks.append(tf.debugging.Assert(
                tf.reduce_all(tf.logical_or(tf.equal(largest, 0), largest > 2)), [
                    f"serve expects {images.dtype.name} pixel values in [0, 255] (as uint8 "
                    "images hold them); an image of this batch has its largest value in "
                    "(0, 2]: images scaled to [0, 1]? Pass images * 255 (or uint8 images, "
                    "which are never read this way)."]))
        # The model runs after the checks: otherwise its first op to fail (a GroupNorm's
        # reshape) could report first, and the message would not name the shape.
        # tf.identity: a cast of float32 to float32 is no op, and would carry no dependency.
        with tf.control_dependencies(checks):
            return tf.identity(tf.cast(images, tf.float32))

    @tf.function
    def serve(images):
        images = checked_images(images)
        logits = tf.cond(  # a batch of 0 images: 0 rows of logits
            tf.shape(images)[0] > 0, lambda: model(images, training=False),
            lambda: tf.zeros([0, num_classes], tf.float32))
        return {OUTPUT_KEY: logits}

    for dtype in (tf.float32, tf.uint8, tf.float64):
        serve.get_concrete_function(tf.TensorSpec([None, *image_shape], dtype, name="images"))
    return serve


def _write_in_place(archive, export_dir, asset_paths, overwrite):
    """The export on an object store: into a fresh `export_dir` (an earlier export removed).

    A unique temporary name beside it, then a rename, would not make it
    atomic there (a folder rename copies object by object), so it is written
    in place; what makes a run's outputs one fact is its FINISHED, which the
    trainer clears before and writes after (`tfdp.workdir`).
    """
    del overwrite  # checked by _check_target
    if storage.isdir(export_dir) and storage.listdir(export_dir):
        storage.rmtree(export_dir)
    # Keras writes into a local folder; each file is then uploaded whole.
    local = tempfile.mkdtemp(prefix=f".export.tmp-{uuid.uuid4().hex[:8]}-")
    try:
        archive.write_out(local, verbose=False)
        os.makedirs(os.path.join(local, "assets"), exist_ok=True)
        for path in asset_paths:
            shutil.copy(path, os.path.join(local, "assets", os.path.basename(path)))
        for folder, _, names in os.walk(local):
            relative = os.path.relpath(folder, local)
            target = export_dir if relative == "." else storage.join(export_dir, relative)
            storage.makedirs(target)
            for name in names:
                storage.copy(os.path.join(folder, name), storage.join(target, name))
    finally:
        shutil.rmtree(local, ignore_errors=True)


def is_export(path):
    """True if `path` is a folder holding exactly what `export_saved_model` writes."""
    if not storage.isdir(path):
        return False
    entries = set(storage.listdir(path))
    assets = storage.join(path, "assets")
    return ({"saved_model.pb", "variables"} <= entries <= _EXPORT_ENTRIES
            and storage.isdir(assets)
            and (set(storage.listdir(assets)) <= set(PRIVACY_REPORT_ASSETS)
                 or set(storage.listdir(assets)) <= set(NOT_PRIVATE_ASSETS)))


def _check_target(export_dir, overwrite):
    """Refuses an export_dir that is a file, holds other files, or an export not to overwrite."""
    if storage.exists(export_dir) and not storage.isdir(export_dir):
        raise ValueError(f"Cannot export to {export_dir}: it is a file, not a folder. Choose "
                         "a new folder name.")
    if not storage.isdir(export_dir) or not storage.listdir(export_dir):
        return
    if not is_export(export_dir):
        shown = ", ".join(sorted(storage.listdir(export_dir))[:5])
        raise ValueError(
            f"Cannot export to {export_dir}: it holds files that are not a tfdp export "
            f"({shown}, ...), and tfdp never deletes files it did not write. Choose a new "
            "or empty folder.")
    if not overwrite:
        raise ValueError(f"{export_dir} holds an earlier tfdp export; pass overwrite=True "
                         "to replace it, or choose a new folder.")
