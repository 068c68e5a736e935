"""make_private: DP-SGD for your own Keras model and data, in a few lines.

The Python counterpart of `python -m tfdp.main` (which trains the shipped
configs from gin): it takes a Keras classifier, a dataset and a
`tfdp.PrivateTrainingConfig` made of the trainer's own `tfdp.PrivacyConfig`
and `tfdp.OptimizationConfig`, and wires the same pieces the trainer uses.
The model is checked by the DP validator (no BatchNorm), the data is read by
index with the Poisson sampler the accountant assumes (secret seeds from OS
entropy unless fixed), and one `tfdp.accounting.DPMechanism`, planned from
the config as the trainer plans it (`tfdp.planning.private_mechanism`), gives
the noise, epsilon, the privacy report and the export.

    config = tfdp.PrivateTrainingConfig(
        privacy=tfdp.PrivacyConfig(target_epsilon=3.0, target_delta=1e-5,
                                   l2_clip_norm=1.0),
        optimization=tfdp.OptimizationConfig(
            optimizer_fn=lambda: keras.optimizers.SGD(0.5), batch_size=256,
            num_steps=tfdp.num_steps_for_epochs(10, num_examples=len(images),
                                                batch_size=256)))
    private = tfdp.make_private(model, (images, labels), config)
    private.fit()
    print(private.privacy_report()["epsilon"])
    private.export("my_model")

Reference: Abadi et al. 2016 (DP-SGD); De et al. 2022, App. A.1, Algorithm 1;
How to DP-fy ML (Ponomareva et al. 2023), Sec. 5.3.3 for the report.
"""

import dataclasses
import math
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

from tfdp import configs
from tfdp import data
from tfdp import inputs
from tfdp import models
from tfdp import planning
from tfdp.dp import seeds
from tfdp.dp import precision
from tfdp.export import privacy_report
from tfdp.export import saved_model
from tfdp.training import callbacks as callbacks_lib
from tfdp.training import optimizers
from tfdp.training import distribute
from tfdp.training.dp_model import DPModel, refuse_example_weights

# A tf.data.Dataset of unknown cardinality (e.g. after `filter`) is read into memory up to
# this many examples; a longer one is refused, as an infinite one is, instead of filling
# the memory. Pass such data as arrays or as a prepared TFDS dataset instead.
MAX_UNKNOWN_CARDINALITY_EXAMPLES = 1_000_000


class PrivateTraining:
    """A Keras classifier wired for DP-SGD on one dataset; made by `make_private`.

    Attributes:
      model: the `tfdp.training.DPModel` (compiled) around your model.
      mechanism: the run's `tfdp.accounting.DPMechanism`.
      source: the training data, read by index (`tfdp.data.ArraySource` or
        `tfdp.data.TFDSSource`).
    """

    def __init__(self, model, mechanism, source, *, sampling_seed):
        self.model = model
        self.mechanism = mechanism
        self.source = source
        self._sampling_seed = sampling_seed

    @property
    def steps(self):
        """Optimizer updates taken so far."""
        return int(self.model.optimizer.iterations.numpy())

    def fit(self, *, verbose=True):
        """Trains the remaining steps on Poisson batches; returns the Keras `History`.

        Every example joins each step's batch independently with probability
        q = batch_size / N (the sampling the accountant assumes), with a
        secret seed drawn once per `PrivateTraining`; calling `fit` again
        continues the same stream after the steps already taken. The batches
        are read and trained as `python -m tfdp.main` does: in accumulation
        chunks, one update per logical batch.

        Args:
          verbose: log progress (steps of the total, loss, exact epsilon).
        """
        remaining = self.mechanism.num_steps - self.steps
        if remaining <= 0:
            return None
        # The trainer's own input and step (`python -m tfdp.main`): each logical batch's
        # accumulation chunks (`tfdp.inputs.train_dataset`, no augmentation), dealt to the
        # model's replicas (`distribute.distribute_chunks`), one update per batch.
        strategy, steps = self.model.distribute_strategy, self.model.accumulation_steps
        chunks = distribute.distribute_chunks(strategy, inputs.train_dataset(
            self.source, self.mechanism, seed=self._sampling_seed, start_step=self.steps,
            augment_fn=None, augment_seed=None, augmult=1,
            num_replicas=strategy.num_replicas_in_sync, accumulation_steps=steps),
            accumulation_steps=steps)
        progress = [callbacks_lib.ProgressLog(self.mechanism)] if verbose else []
        return self.model.fit(
            chunks, epochs=1, steps_per_epoch=remaining, verbose=0,
            callbacks=[callbacks_lib.PrivacyCallback(self.mechanism), *progress])

    def evaluate(self, test_data, *, batch_size=1000, split="test", data_dir=None):
        """`{"loss": ..., "accuracy": ...}` on data in any form `make_private` takes.

        Args:
          test_data: `(images, labels)` arrays, a `tf.data.Dataset` of
            `(image, label)` pairs, or a prepared TFDS dataset's name.
          batch_size: examples per evaluation batch.
          split: the split of a TFDS dataset named by `test_data` ("test"
            by default; never the training split unless asked for).
          data_dir: the TFDS data_dir of a named dataset (None: the one
            `make_private` read its training data from, else TFDS's default).

        Raises:
          ValueError: data `make_private` would refuse: images of another
            shape than the model takes, labels outside its logits, ...; a
            `data_dir` with data that is not a dataset's name.
        """
        if data_dir is None and isinstance(test_data, str):
            data_dir = getattr(self.source, "data_dir", None)
        source = _source(test_data, num_classes=self.source.num_classes, data_dir=data_dir,
                         split=split)
        _check_input_shape(self.model.model, source)
        result = self.model.evaluate(data.eval_batches(source, batch_size=batch_size),
                                     verbose=0, return_dict=True)
        return {key: float(value) for key, value in result.items()}

    def epsilon(self):
        """(epsilon, delta) of the steps taken so far (`DPMechanism.guarantee`)."""
        return self.mechanism.guarantee(self.steps)

    def privacy_report(self):
        """The privacy report of the steps taken so far (`tfdp.export.privacy_report`)."""
        return privacy_report.build_privacy_report(
            self.mechanism, steps_completed=self.steps,
            hyperparameters={"optimizer": keras.optimizers.serialize(
                self.model.optimizer)["config"]},
            exported_parameters="ema" if self.model.ema_variables else "last",
            clip_margin=precision.clip_margin_record(
                self.mechanism.l2_clip_norm, device=self.model.traced_matmul_inputs))

    def export(self, export_dir, *, overwrite=False, allow_untrained=False):
        """Writes a SavedModel serving images (pixel values 0 to 255), with the privacy report in `assets/`.

        The SavedModel is written into a new, uniquely named folder beside
        `export_dir` and renamed into place (`tfdp.export.export_saved_model`),
        so `export_dir` holds a complete export or what it held before, and
        no file of yours is ever deleted.

        Args:
          export_dir: a new or empty folder; or an earlier tfdp export, which
            is replaced only with `overwrite=True`.
          overwrite: replace an earlier tfdp export (recognized by its
            contents: `saved_model.pb`, `variables/`, `assets/` with only the
            privacy report).
          allow_untrained: export before `fit` has taken a step (a model that
            has not seen the data, with epsilon = 0 in its report).

        Returns:
          `export_dir`.

        Raises:
          ValueError: before any step without `allow_untrained=True`; an empty
            `export_dir`, one that is a file or a folder with other files, or an
            earlier export without `overwrite=True`. Nothing is written then.
        """
        if not os.fspath(export_dir).strip():
            raise ValueError(
                f"export_dir={os.fspath(export_dir)!r} names no folder: give the folder to "
                "write the SavedModel to, e.g. private.export('my_model').")
        if self.steps == 0 and not allow_untrained:
            raise ValueError(
                "No training step was taken yet: this would export the untrained model "
                "(epsilon = 0 in its report). Call fit() first, or pass "
                "allow_untrained=True.")
        report = self.privacy_report()
        with tempfile.TemporaryDirectory() as tmp:
            paths = privacy_report.write_privacy_report(report, tmp)
            with self.model.use_ema_parameters():
                return saved_model.export_saved_model(
                    self.model.model, os.fspath(export_dir),
                    image_shape=self.source.image_shape, asset_paths=paths,
                    overwrite=overwrite)


def make_private(model, train_data, config=None, *, class_weight=None, sample_weight=None,
                 **settings):
    """Wraps your Keras classifier for DP-SGD on your data, with a matching sampler.

    Args:
      model: a built `keras.Model` mapping float32 images `[batch, height,
        width, channels]` with pixel values in [0, 255] to logits `[batch,
        num_classes]`. It must treat examples independently (no BatchNorm;
        use GroupNorm, De et al. 2022, App. C.1).
      train_data: your training set, held privately, in one of three forms:
        `(images, labels)` arrays (uint8 `[N, H, W, C]`, integer `[N]`); a
        `tf.data.Dataset` of single `(image uint8 [H, W, C], label)` pairs
        (read once into memory); or the name of a prepared TFDS dataset (its
        "train" split, read by index from ArrayRecord files in
        `config.data_dir`).
      config: a `tfdp.PrivateTrainingConfig`: the CLI's `tfdp.PrivacyConfig`
        (C, delta, sigma or the target epsilon, accountant, num_microbatches,
        normalize_update, the seeds, clipping) and `tfdp.OptimizationConfig`
        (optimizer_fn, B the EXPECTED batch size: each example joins a
        step's batch with probability B / N; num_steps, optimizer updates,
        `num_steps_for_epochs`; accumulation_steps; ema_decay), plus
        `trainable` and `data_dir`. `optimizer_fn()` is called once; the
        optimizer sees only the noisy clipped gradient. A fixed seed
        (`sampling_seed`, `noise_seed`) reproduces the run, and the report
        says the guarantee assumes it stays secret; unset, each is drawn
        from OS entropy. `trainable` other than None is applied to `model`
        IN PLACE before anything else (`tfdp.models.set_trainable`):
        "head", "all" or fnmatch patterns of layer names (the head always
        trains; every BatchNormalization is frozen). Only the trainable
        variables are clipped, noised and updated; unlike
        `python -m tfdp.main`, a frozen trunk's features are not cached.
      class_weight, sample_weight: refused (ValueError) if given: a weight
        on an example's loss scales its sensitivity beyond l2_clip_norm
        (`tfdp.training.dp_model.refuse_example_weights`). They are named
        here so that passing them is explained, not a TypeError.
      **settings: refused (ValueError): the settings go in `config`; the
        message shows where each keyword given belongs.

    Returns:
      A `PrivateTraining`: `.fit()`, `.evaluate(test_data)`, `.epsilon()`,
      `.privacy_report()`, `.export(dir)`.

    Raises:
      ValueError: a config that is not a `PrivateTrainingConfig` (whose own
        checks refuse the settings only the trainer supports), a batch_size
        that is not a positive int, an optimizer_fn that is not a callable
        returning a `keras.optimizers.Optimizer`, an invalid `trainable`
        (also a pattern that matches no layer), a model that mixes examples,
        logits that do not cover the labels, data in another form or shape
        (images that do not match `model.input_shape`), an infinite or empty
        dataset (or one of unknown cardinality longer than
        `MAX_UNKNOWN_CARDINALITY_EXAMPLES`), invalid privacy parameters
        (`tfdp.accounting.plan_mechanism`), or class or sample weights.

    Reference:
      Abadi et al. 2016, Algorithm 1; De et al. 2022, App. A.1, Algorithm 1.
    """
    refuse_example_weights(class_weight, sample_weight, where="make_private")
    _refuse_keywords(settings)
    _check_config(config)
    privacy, optimization = config.privacy, config.optimization
    if config.trainable is not None:
        models.set_trainable(model, config.trainable)
    num_classes = _output_width(model)
    if not model.trainable_variables:
        raise ValueError(
            f"The model {getattr(model, 'name', '')!r} has no trainable variables (every layer "
            "is frozen, trainable=False): DP-SGD would have nothing to train. Unfreeze what "
            "should train (layer.trainable = True), or set PrivateTrainingConfig.trainable to "
            "'head' (the last Dense layer) or 'all'.")
    models.validate_dp_model(model)
    source = _source(train_data, num_classes=num_classes, data_dir=config.data_dir)
    _check_input_shape(model, source)
    mechanism = planning.private_mechanism(privacy, optimization,
                                           num_examples=source.num_examples)
    dp_model = DPModel(model, mechanism, accumulation_steps=optimization.accumulation_steps,
                       noise_seed=privacy.noise_seed, ema_decay=optimization.ema_decay,
                       clipping=privacy.clipping)
    dp_model.compile(optimizer=_build_optimizer(optimization.optimizer_fn))
    sampling_seed = (seeds.secret_seed() if privacy.sampling_seed is None
                     else privacy.sampling_seed)
    return PrivateTraining(dp_model, mechanism, source, sampling_seed=sampling_seed)


def num_steps_for_epochs(epochs, *, num_examples, batch_size):
    """Optimizer updates for `epochs` expected passes over N examples: ceil(epochs N / B).

    With Poisson sampling each step's batch holds B examples in expectation,
    so T steps read T B examples in expectation. Give the result to
    `tfdp.OptimizationConfig(num_steps=...)`, the one training length.

    >>> num_steps_for_epochs(3, num_examples=2000, batch_size=200)
    30

    Args:
      epochs: passes over the data (a number > 0, need not be whole).
      num_examples: N, the training examples (e.g. `len(images)`).
      batch_size: B, the expected batch size (`OptimizationConfig.batch_size`).

    Returns:
      num_steps, an int >= 1.

    Raises:
      ValueError: epochs not a number > 0; num_examples or batch_size not a
        positive int.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float, np.integer,
                                                           np.floating)) or not (
            0 < epochs < math.inf):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}.")
    for name, value in (("num_examples", num_examples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return max(1, math.ceil(epochs * int(num_examples) / int(batch_size)))


def _refuse_keywords(settings):
    """Refuses settings given as keywords, saying which config group takes each."""
    if not settings:
        return
    groups = {"PrivacyConfig": configs.PrivacyConfig,
              "OptimizationConfig": configs.OptimizationConfig,
              "PrivateTrainingConfig": configs.PrivateTrainingConfig}
    where = []
    for name in sorted(settings):
        owner = next((group for group, cls in groups.items()
                      if name in {f.name for f in dataclasses.fields(cls)}), None)
        if name == "optimizer":
            owner = "OptimizationConfig (as optimizer_fn, a builder)"
        elif name == "epochs":
            owner = "OptimizationConfig (as num_steps: tfdp.num_steps_for_epochs)"
        where.append(f"{name} -> {owner or 'no setting of make_private'}")
    raise ValueError(
        "make_private takes its settings in one config, not as keywords: "
        "make_private(model, train_data, tfdp.PrivateTrainingConfig(privacy=tfdp.PrivacyConfig("
        "...), optimization=tfdp.OptimizationConfig(...))). Given: " + "; ".join(where) + ".")


def _check_config(config):
    """Refuses a config that is not a PrivateTrainingConfig, a bad batch_size or optimizer_fn."""
    if not isinstance(config, configs.PrivateTrainingConfig):
        raise ValueError(
            f"config must be a tfdp.PrivateTrainingConfig, got {type(config).__name__}: e.g. "
            "tfdp.PrivateTrainingConfig(privacy=tfdp.PrivacyConfig(l2_clip_norm=1.0, "
            "target_delta=1e-5, target_epsilon=3.0), optimization=tfdp.OptimizationConfig("
            "optimizer_fn=lambda: keras.optimizers.SGD(0.5), batch_size=256, "
            "num_steps=1000)).")
    batch_size = config.optimization.batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or (
            batch_size < 1):
        raise ValueError(f"batch_size must be a positive int (the expected examples per step), "
                         f"got {batch_size!r}.")
    if not callable(config.optimization.optimizer_fn):
        raise ValueError(
            f"optimizer_fn={config.optimization.optimizer_fn!r} is not a builder: "
            "tfdp.OptimizationConfig.optimizer_fn is called to make the optimizer, e.g. "
            "optimizer_fn=lambda: keras.optimizers.SGD(0.5), or functools.partial("
            "tfdp.training.build_optimizer, 'sgd', learning_rate=0.5).")


def _build_optimizer(optimizer_fn):
    """`optimizer_fn()`, refused unless it is a `keras.optimizers.Optimizer`."""
    optimizer = optimizer_fn()
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            f"optimizer_fn() returned {type(optimizer).__name__}, not a "
            "keras.optimizers.Optimizer: e.g. optimizer_fn=lambda: keras.optimizers.SGD(0.5).")
    optimizers.refuse_step_miscounting(optimizer, where="make_private")
    return optimizer


def _check_input_shape(model, source):
    """Refuses images whose height, width or channels differ from `model.input_shape`."""
    expected = getattr(model, "input_shape", None)
    if not isinstance(expected, tuple) or len(expected) != 4:
        return  # several inputs, or no fixed rank: nothing to compare with
    got = tuple(source.image_shape)
    if any(e is not None and e != g for e, g in zip(expected[1:], got)):
        raise ValueError(
            f"The images are [N, {', '.join(map(str, got))}] but the model takes inputs "
            f"{expected} ([batch, height, width, channels]). Resize the images or build the "
            "model for their shape.")


def _output_width(model):
    outputs = getattr(model, "outputs", None)
    if outputs is not None and len(outputs) != 1:
        raise ValueError(
            f"The model has {len(outputs)} outputs; make_private trains a classifier with one "
            "output, logits [batch, num_classes]. Build a model of the output to train, e.g. "
            "keras.Model(model.inputs, model.outputs[0]).")
    shape = getattr(model, "output_shape", None)
    if not shape or len(shape) != 2 or shape[-1] is None:
        raise ValueError(f"The model must return logits [batch, num_classes]; its output "
                         f"shape is {shape}.")
    return int(shape[-1])


def _source(train_data, *, num_classes, data_dir=None, split="train"):
    """A source read by index, from arrays, a tf.data dataset or a TFDS name.

    Raises:
      ValueError: as `make_private` says; also a `data_dir` given with data
        that is not a dataset's name (it would be read nowhere).
    """
    if not isinstance(train_data, str) and data_dir is not None:
        raise ValueError(
            f"data_dir={data_dir!r} is read only for a prepared TFDS dataset given by name, "
            f"but the data is {type(train_data).__name__}: drop data_dir, or pass the "
            "dataset's name.")
    if isinstance(train_data, str):
        source = data.TFDSSource(train_data, split, data_dir=data_dir)
        if source.num_classes != num_classes:
            raise ValueError(
                f"The model returns {num_classes} logits, but {train_data!r} has "
                f"{source.num_classes} classes.")
        return source
    if isinstance(train_data, tf.data.Dataset):
        spec = train_data.element_spec
        if not (isinstance(spec, tuple) and len(spec) == 2 and spec[0].shape.rank == 3):
            raise ValueError(
                "A tf.data.Dataset must yield single (image [H, W, C], label) pairs, not "
                f"batches; got {spec}. Use dataset.unbatch(), or pass arrays.")
        train_data = _read_dataset(train_data)
    if not (isinstance(train_data, tuple) and len(train_data) == 2):
        raise ValueError(
            "train_data must be (images, labels) arrays, a tf.data.Dataset of (image, label) "
            f"or a TFDS dataset name; got {type(train_data).__name__}.")
    images, labels = _as_arrays(*train_data)
    if not images.shape or images.shape[0] == 0:
        raise ValueError("train_data holds no examples; DP-SGD needs a non-empty training set.")
    if images.dtype != np.uint8:
        raise ValueError(
            f"images must be uint8 pixels [N, height, width, channels], got {images.dtype} "
            f"{list(images.shape)}: the model scales pixels itself, so pass them unscaled.")
    if labels.dtype.kind not in "iu" or labels.shape != images.shape[:1]:
        example = f" (e.g. {labels.flat[0]!r})" if labels.size else ""
        raise ValueError(
            f"labels must be integers [N] = [{images.shape[0]}], one class id in [0, "
            f"{num_classes}) per image; got {labels.dtype} {list(labels.shape)}{example}. Map "
            "class names to ids first, e.g. names, labels = np.unique(labels, "
            "return_inverse=True).")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must be in [0, {num_classes}) (the model's logits), got values from "
            f"{labels.min()} to {labels.max()}.")
    return data.ArraySource(images, labels, num_classes)


def _as_arrays(images, labels):
    """`(images, labels)` as numpy arrays; images of different shapes are refused clearly."""
    given = images
    try:
        images = np.asarray(given)
    except ValueError:  # numpy: "inhomogeneous shape"
        images = None
    if images is None or images.dtype == object:
        try:
            shapes = sorted({tuple(np.shape(image)) for image in _first(given, 1000)})
        except (TypeError, ValueError):
            shapes = []
        raise ValueError(
            "The images have different shapes"
            + (f" ({', '.join(map(str, shapes[:3]))}{', ...' if len(shapes) > 3 else ''})"
               if shapes else "")
            + ": make_private trains on images of one shape [N, height, width, channels]. "
            "Resize or crop them to one size first (e.g. tf.image.resize_with_crop_or_pad), "
            "and build the model for it.")
    return images, np.asarray(labels)


def _first(items, count):
    return [item for _, item in zip(range(count), items)]


def _read_dataset(dataset):
    """`(images, labels)` arrays of a finite tf.data.Dataset of (image, label) pairs.

    Raises:
      ValueError: an infinite dataset (`.repeat()`), an empty one, or one of
        unknown cardinality with more than MAX_UNKNOWN_CARDINALITY_EXAMPLES
        examples (read no further).
    """
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "train_data is an infinite tf.data.Dataset (e.g. .repeat()); pass the finite "
            "training set once: N is the number of examples, and the sampler repeats it.")
    limit = MAX_UNKNOWN_CARDINALITY_EXAMPLES
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        dataset = dataset.take(limit + 1)
    pairs = list(dataset.as_numpy_iterator())
    if not pairs:
        raise ValueError("train_data is an empty tf.data.Dataset; DP-SGD needs a non-empty "
                         "training set.")
    if len(pairs) > limit and cardinality == tf.data.UNKNOWN_CARDINALITY:
        raise ValueError(
            f"train_data is a tf.data.Dataset of unknown cardinality with more than {limit} "
            "examples (tfdp.private_training.MAX_UNKNOWN_CARDINALITY_EXAMPLES), which are "
            "read into memory. Pass arrays, or a prepared TFDS dataset name (read from disk).")
    images, labels = zip(*pairs)
    shapes = {image.shape for image in images}
    if len(shapes) > 1:
        raise ValueError(
            f"The dataset's images have different shapes ({', '.join(map(str, sorted(shapes)[:3]))}"
            f"{', ...' if len(shapes) > 3 else ''}): make_private trains on images of one shape "
            "[height, width, channels]. Resize them first, e.g. dataset.map(lambda image, "
            "label: (tf.image.resize_with_crop_or_pad(image, 28, 28), label)).")
    return np.stack(images), np.asarray(labels)
