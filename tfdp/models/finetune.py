"""Private fine-tuning of a pretrained backbone (De et al. 2022, Sec. 4).

`build_finetune_model` loads a backbone from where users keep one
(`load_backbone`: a `.keras` file, a tfdp workdir, or `keras.applications`
with a local weights file), replaces its classifier by a new head for the
new classes, and chooses what trains (`set_trainable`). The model it returns
is

    images [B, H, W, C] float32 in [0, 255]
      -> "trunk": channel conversion, resizing, the backbone's preprocessing,
                  the backbone up to its features
      -> "trunk_gate": stop_gradient while the trunk is frozen (no backward pass into it)
      -> "head":  (Flatten,) Dense(num_classes)       -> logits [B, num_classes]

so the SavedModel export takes images (pixel values 0 to 255) and returns logits. With only the head
trainable, the trunk is a frozen public feature extractor
(`frozen_feature_extractor`): the trainer computes its features once and
trains the head on them, as it does for ScatterNet features.

BatchNormalization layers are always frozen: `trainable = False`, which in
Keras 3 also makes them normalize with their moving (pretrained, public)
statistics in training mode, so no example is mixed with another
(`tfdp.models.validation.is_frozen_batch_norm`).
"""

import fnmatch
import json
import os
import zipfile

import gin
import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp import storage
from tfdp.models import validation
from tfdp.models.feature_extractor import FrozenFeatureExtractor, compute_model_features

APPLICATIONS_PREFIX = "keras.applications."
TRUNK = "trunk"
HEAD = "head"
# What a tfdp workdir holds (tfdp.experiment writes them; not imported: models/ sits below).
_OPERATIVE_CONFIG = "operative_config.gin"
_CHECKPOINT_DIR = "checkpoints"
_EXPORT_PB = os.path.join("export", "saved_model.pb")
_FINISHED = "FINISHED"
# ITU-R 601 luma weights, as tf.image.rgb_to_grayscale.
_LUMA = (0.2989, 0.5870, 0.1140)


class BackboneError(ValueError):
    """A backbone that cannot be loaded: the message says what was wrong and how to fix it."""


@gin.configurable(module="tfdp.models")
def build_finetune_model(
    num_classes,
    input_shape,
    *,
    backbone=gin.REQUIRED,
    backbone_weights=None,
    trainable="head",
    head_initializer="zeros",
    backbone_input_shape=None,
    feature_layer=None,
    name="finetune",
):
    """Builds a classifier from a pretrained backbone, with a new head.

    Args:
      num_classes: logits of the new head.
      input_shape: `(H, W, C)` of the images it is trained on, e.g. (28, 28, 1).
        They are converted to the backbone's channels (1 -> 3 by repeating
        the gray value; 3 -> 1 by ITU-R 601 luma) and bilinearly resized to
        its height and width, on pixels in [0, 255].
      backbone: where the pretrained model is (`load_backbone`): a `.keras`
        file, a tfdp workdir, or "keras.applications.<Name>".
      backbone_weights: for keras.applications only: a LOCAL weights file
        (`.h5` / `.weights.h5`, with or without the top). Nothing downloads.
      trainable: "head" (only the new head), "all" (every layer), or a list
        of fnmatch patterns of backbone layer names (`set_trainable`); the
        head always trains, BatchNormalization never does.
      head_initializer: Keras initializer (name or object) of the new head's
        kernel; its bias starts at zero. The default "zeros" starts from
        uniform predictions, with nothing random in the new layer (the usual
        choice for fine-tuning a classifier, e.g. big_vision's zero-init head).
      backbone_input_shape: `(h, w, c)` the backbone takes; None reads it
        from the backbone (for keras.applications: its default, 224x224x3,
        unless given).
      feature_layer: name of the backbone layer whose OUTPUT are the
        features; None takes the input of the backbone's last Dense layer
        (its classifier).
      name: model name.

    Returns:
      A `keras.Model`: float32 images `[batch, H, W, C]` in [0, 255] ->
      float32 logits `[batch, num_classes]`, made of two nested models named
      "trunk" (images -> features) and "head" (features -> logits).

    Raises:
      BackboneError (a ValueError): see `load_backbone`; also a backbone
        without a Dense layer and no feature_layer, or an unknown
        feature_layer.
      ValueError: an invalid `trainable` (`set_trainable`), or channels that
        cannot be converted (only 1 <-> 3 and equal counts are).

    Reference:
      De et al. 2022, "Unlocking High-Accuracy Differentially Private Image
      Classification through Scale", Sec. 4 (fine-tuning);
      Tramer & Boneh 2021, Sec. 5.2 (transfer learning).
    """
    backbone_model, preprocess = load_backbone(
        backbone, backbone_weights=backbone_weights, input_shape=backbone_input_shape)
    # A keras.applications model without its top ends in its pooled features.
    features = _feature_tensor(backbone_model, feature_layer,
                               pooled_output=backbone.startswith(APPLICATIONS_PREFIX))
    if len(backbone_model.inputs) != 1:
        raise BackboneError(f"The backbone {backbone!r} takes {len(backbone_model.inputs)} "
                            "inputs; a fine-tuning backbone takes one batch of images.")
    # One input tensor, not a list: a nested model of that structure is what the ghost-norm
    # path inlines (keras.models.clone_model checks the structure).
    backbone_trunk = keras.Model(backbone_model.inputs[0], features, name="backbone_trunk")
    target = tuple(backbone_model.input_shape[1:])
    if len(target) != 3 or any(d is None for d in target):
        if backbone_input_shape is None:
            raise BackboneError(
                f"The backbone {backbone!r} takes inputs {backbone_model.input_shape}, without "
                "a fixed (height, width, channels): pass backbone_input_shape=(h, w, c).")
        target = tuple(backbone_input_shape)

    images = keras.Input(shape=tuple(input_shape), name="images")
    x = _adapt_images(images, tuple(input_shape), target)
    if preprocess is not None:
        x = preprocess(x)
    trunk = keras.Model(images, backbone_trunk(x), name=TRUNK)

    head_inputs = keras.Input(shape=tuple(trunk.output_shape[1:]), name="features")
    h = head_inputs
    if len(trunk.output_shape) > 2:
        h = keras.layers.Flatten(name="head_flatten")(h)
    logits = keras.layers.Dense(num_classes, kernel_initializer=head_initializer,
                                bias_initializer="zeros", name="head_logits")(h)
    head = keras.Model(head_inputs, logits, name=HEAD)

    gate = _StopGradientIfFrozen(lambda: not trunk.trainable_variables, name="trunk_gate")
    model = keras.Model(images, head(gate(trunk(images))), name=name)
    set_trainable(model, trainable)
    # Where the backbone came from, for the trainer's data check and the report (a plain
    # attribute: not a Keras-tracked one).
    object.__setattr__(model, PROVENANCE_ATTRIBUTE, backbone_provenance(backbone))
    return model


PROVENANCE_ATTRIBUTE = "_tfdp_backbone_provenance"


def backbone_provenance(backbone):
    """What is known of a backbone's training: its source, and for a tfdp workdir its data.

    A fine-tuned model's privacy guarantee covers only the fine-tuning data;
    the backbone's own training is outside it, so its data must be public, or
    disjoint from the fine-tuning data (`tfdp.train_and_evaluate` refuses a
    tfdp-workdir backbone trained on an overlapping split of the same dataset).

    Args:
      backbone: as `load_backbone`.

    Returns:
      A JSON-serializable dict: `source` (the path or name) and `kind`
      ("tfdp workdir", "keras file", "keras.applications"); for a tfdp workdir
      also `dataset`, `train_split`, `input_source` (from its operative
      config: "array_record", "in_memory" or "jpeg_folder") and `privacy`
      ("NOT PRIVATE", or `{"epsilon", "delta"}` from its privacy report); for
      the others `verified: False` (their training data cannot be checked).
    """
    if backbone.startswith(APPLICATIONS_PREFIX):
        return {"source": backbone, "kind": "keras.applications", "verified": False}
    if os.path.isfile(backbone):
        return {"source": os.path.abspath(backbone), "kind": "keras file", "verified": False}
    bindings = _operative_bindings(os.path.join(backbone, _OPERATIVE_CONFIG))
    privacy = "NOT PRIVATE"
    report_path = os.path.join(backbone, "privacy_report.json")
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        privacy = {"epsilon": report["epsilon"], "delta": report["delta"]}
    return {"source": os.path.abspath(backbone), "kind": "tfdp workdir", "verified": True,
            "dataset": _data_setting(bindings, "dataset"),
            "train_split": _data_setting(bindings, "train_split", "train"),
            "input_source": bindings.get(("open_split", "source"), "array_record"),
            "privacy": privacy}


class _StopGradientIfFrozen(keras.layers.Layer):
    """Identity whose gradient is cut when the trunk before it has nothing to train.

    TensorFlow's backward pass continues from a layer's output gradient into
    every recorded op below it, also when no variable there trains (a
    tf.function prunes that work only if nothing uses it). With a frozen
    trunk this layer makes it explicit: no gradient op is built for the trunk,
    so it runs forward only, on every augmult view (`stop_gradient`). The
    check is made each time the model is traced, so `set_trainable` after
    building takes effect on the next trace (recompile a DPModel after it).
    The callable is not tracked as a sub-layer: the trunk's variables stay
    the trunk's.
    """

    def __init__(self, is_frozen, **kwargs):
        super().__init__(**kwargs)
        self._is_frozen = is_frozen

    def call(self, inputs):
        return keras.ops.stop_gradient(inputs) if self._is_frozen() else inputs


def set_trainable(model, trainable):
    """Chooses which layers of `model` train; BatchNormalization layers never do.

    The head is `model`'s nested "head" model when it has one (as
    `build_finetune_model` builds), else its last Dense layer (any Keras
    classifier). The head always trains.

    Args:
      model: a `keras.Model` (modified in place: its layers' `trainable`).
      trainable: "head" (only the head), "all" (every layer but
        BatchNormalization), or a non-empty list of fnmatch patterns
        (`"conv2d*"`, `"block4_*"`), matched against each layer's name and its
        "/"-joined path below `model` (e.g. "trunk/backbone_trunk/conv2d");
        the matching layers and the head train.

    Returns:
      The names of the layers whose variables train (sorted).

    Raises:
      ValueError: any other `trainable`; a pattern that matches no layer, or
        only BatchNormalization layers (which stay frozen), named with the
        layer names it could match; a model without a head to find.
    """
    head = _head_layer(model)
    leaves = [(path, layer) for path, layer in _leaf_layers(model)
              if layer is not head and not _is_inside(layer, head)]
    if isinstance(trainable, str):
        if trainable not in ("head", "all"):
            raise ValueError(f"trainable={trainable!r}: use 'head', 'all' or a list of "
                             "fnmatch patterns of layer names.")
        chosen = {id(layer) for _, layer in leaves} if trainable == "all" else set()
    elif (isinstance(trainable, (list, tuple)) and trainable
          and all(isinstance(p, str) and p for p in trainable)):
        chosen = set()
        for pattern in trainable:
            matched = [layer for path, layer in leaves
                       if fnmatch.fnmatchcase(layer.name, pattern)
                       or fnmatch.fnmatchcase(path, pattern)]
            if not matched:
                names = [path for path, _ in leaves]
                raise ValueError(
                    f"trainable pattern {pattern!r} matches no layer of {model.name!r}, so it "
                    "would train nothing. Layer names (and paths) it can match: "
                    f"{', '.join(names[:40])}{' ...' if len(names) > 40 else ''}. Fix or "
                    "remove the pattern (the head always trains).")
            if all(isinstance(layer, keras.layers.BatchNormalization) for layer in matched):
                raise ValueError(
                    f"trainable pattern {pattern!r} matches only BatchNormalization layers "
                    f"({', '.join(layer.name for layer in matched[:10])}), which always stay "
                    "frozen (a trainable BatchNorm mixes the examples of a batch, which DP-SGD "
                    "forbids). Remove the pattern.")
            chosen.update(id(layer) for layer in matched)
    else:
        raise ValueError(f"trainable={trainable!r}: use 'head', 'all' or a non-empty list "
                         "of fnmatch patterns (strings) of layer names.")
    # Containers first (their setter recurses), then each leaf on its own.
    model.trainable = True
    for _, layer in leaves:
        layer.trainable = (id(layer) in chosen
                           and not isinstance(layer, keras.layers.BatchNormalization))
    head.trainable = True
    _freeze_batch_norms(model)
    return sorted({layer.name for layer in _all_sublayers(model) if layer.trainable_weights
                   and not isinstance(layer, keras.Model)})


def frozen_feature_extractor(model, *, batch_size=256):
    """The frozen public feature extractor of a head-only fine-tuning model, or None.

    Args:
      model: a model from `build_finetune_model` (nested "trunk" and "head");
        any other model gives None.
      batch_size: images per forward pass when computing the features.

    The trunk computes each example's features from a batch of images, so it
    is probed like the model DPModel trains, in inference mode: one image
    must not move another's features (`tfdp.models.refuse_example_mixing`);
    only the head is wrapped in the DPModel, whose own probe would not see a
    trunk layer that centres by the batch mean.

    Returns:
      None unless `model` has a "trunk" without trainable variables and a
      "head"; else a `FrozenFeatureExtractor` whose `compute_features` runs
      the trunk in inference mode, whose `head` is the model's head (features
      `[batch, *trunk.output_shape[1:]]` -> logits) and whose `compose`
      returns `model` itself (it shares the head's variables).

    Raises:
      tfdp.models.ExampleMixingError: a trunk whose features of one image
        depend on the other images of its batch.
    """
    try:
        trunk, head = model.get_layer(TRUNK), model.get_layer(HEAD)
    except ValueError:
        return None
    if trunk.trainable_variables or not head.trainable_variables:
        return None
    validation.refuse_example_mixing(trunk, training=False)

    def compose(trained_head):
        if trained_head is not head:
            raise ValueError("This extractor composes only its own head.")
        return model

    return FrozenFeatureExtractor(
        name=f"frozen trunk of {model.name!r}",
        compute_features=lambda images: compute_model_features(
            trunk, images, batch_size=batch_size),
        compose=compose, head=head)


def load_backbone(backbone, *, backbone_weights=None, input_shape=None):
    """Loads a pretrained Keras model from a `.keras` file, a tfdp workdir or keras.applications.

    * A path ending in ".keras": `keras.saving.load_model` (tfdp's own layers
      are registered; other custom layers must be registered by the user).
    * A tfdp workdir (a folder with operative_config.gin): the model is
      rebuilt by calling the workdir's `train_and_evaluate.model_fn` with its
      bindings from operative_config.gin (macros resolved; the current gin
      config is not used), for the num_classes and input shape of the
      workdir's export, and its weights are read from the latest checkpoint
      in checkpoints/. They are the EXPORTED parameters: the EMA ones if the
      run kept an EMA (`ema_decay`), else the last iterate - the model the
      workdir's evaluation and export report on, and a post-processing of
      that run's (public) training. The workdir must be finished (FINISHED).
    * "keras.applications.<Name>": the constructor is built with
      `weights=None` (nothing downloads) and then `backbone_weights`, a local
      file, is loaded into it: first with the ImageNet top (include_top,
      1000 classes), then without it (average pooled features).

    Args:
      backbone: the path or name, a str.
      backbone_weights: the local weights file, for keras.applications only.
      input_shape: (h, w, c) for keras.applications (None: its default).

    Returns:
      `(model, preprocess)`: the backbone `keras.Model` (float32 inputs)
      and None, or for keras.applications the layer applying that family's
      `preprocess_input` to pixels in [0, 255].

    Raises:
      BackboneError (a ValueError): a path that does not exist, a folder
        that is not a tfdp workdir, a workdir without checkpoint, export or
        FINISHED, or trained on precomputed features; an unknown application
        name; keras.applications without backbone_weights, or weights (for
        any route) that do not match the architecture; backbone_weights
        given for another route.
    """
    if not isinstance(backbone, str) or not backbone:
        raise BackboneError(
            f"backbone={backbone!r}: give a '.keras' file, a tfdp workdir or "
            "'keras.applications.<Name>' (e.g. --gin_param=PRETRAINED_BACKBONE='\"/path\"').")
    if backbone.startswith(APPLICATIONS_PREFIX):
        return _load_application(backbone, backbone_weights, input_shape), _app_preprocessing(
            backbone)
    if backbone_weights is not None:
        raise BackboneError(
            f"backbone_weights={backbone_weights!r} is only for keras.applications backbones; "
            f"{backbone!r} holds its own weights. Remove backbone_weights.")
    if not os.path.exists(backbone):
        raise BackboneError(
            f"The backbone {backbone!r} does not exist. Give an existing '.keras' file, a tfdp "
            "workdir (the --workdir of a finished pretraining run), or "
            "'keras.applications.<Name>' with a local backbone_weights file.")
    if os.path.isfile(backbone):
        if not backbone.endswith(".keras"):
            raise BackboneError(
                f"The backbone file {backbone!r} is not a '.keras' file. Save the model with "
                "model.save('backbone.keras'); for a weights file of keras.applications, set "
                "backbone='keras.applications.<Name>' and backbone_weights to the file.")
        if not zipfile.is_zipfile(backbone):
            # Keras says "File not found" for a file that exists but is not a zip archive.
            raise BackboneError(
                f"The backbone {backbone!r} exists ({os.path.getsize(backbone)} bytes) but is "
                "not a valid '.keras' file: a .keras file is a zip archive, and this one is "
                "not (a truncated or corrupt copy or download?). Copy it again, or save the "
                "model again with model.save('backbone.keras').")
        try:
            return keras.saving.load_model(backbone, compile=False), None
        except (zipfile.BadZipFile, KeyError, EOFError) as e:
            raise BackboneError(
                f"The backbone {backbone!r} is a corrupt '.keras' file ({type(e).__name__}: "
                f"{e}): copy it again, or save the model again with "
                "model.save('backbone.keras').") from None
        except (ValueError, TypeError, OSError) as e:
            raise BackboneError(f"Could not load the Keras model {backbone!r}: {e}. If it "
                                "uses custom layers, register them with "
                                "keras.saving.register_keras_serializable.") from e
    return _load_workdir(backbone), None


def _load_workdir(workdir):
    # TensorFlow reads checkpoint paths as glob patterns: a workdir named `sweep[lr=0.5]` is
    # read through its open folder (`storage.tf_path`).
    with storage.folder_aliased(workdir):
        return _load_aliased_workdir(workdir)


def _load_aliased_workdir(workdir):
    config_path = os.path.join(workdir, _OPERATIVE_CONFIG)
    if not os.path.isfile(config_path):
        raise BackboneError(
            f"The backbone folder {workdir!r} is not a tfdp workdir: it has no "
            f"{_OPERATIVE_CONFIG}. Give the --workdir of a pretraining run (python -m "
            "tfdp.main ...), a '.keras' file, or 'keras.applications.<Name>'.")
    checkpoint = tf.train.latest_checkpoint(
        storage.tf_path(os.path.join(workdir, _CHECKPOINT_DIR)))
    if checkpoint is None:
        raise BackboneError(
            f"The tfdp workdir {workdir!r} has no checkpoint in {_CHECKPOINT_DIR}/, so there "
            "are no weights to load. Run (or resume) its training first, with the same "
            "command and --workdir.")
    if not (os.path.isfile(os.path.join(workdir, _FINISHED))
            and os.path.isfile(os.path.join(workdir, _EXPORT_PB))):
        raise BackboneError(
            f"The tfdp workdir {workdir!r} is not finished (no {_FINISHED} or export): its "
            f"checkpoint {storage.user_path(checkpoint)} may be partway through training. Run the same "
            "training command again to finish it, then fine-tune from it.")
    bindings = _operative_bindings(config_path)
    if _data_setting(bindings, "features") is not None:
        raise BackboneError(
            f"The tfdp workdir {workdir!r} trained a head on precomputed features "
            f"({_data_setting(bindings, 'features')!r}); its model does not take "
            "images. Use a workdir trained on pixels (features = None).")
    model_fn = bindings.get(("train_and_evaluate", "model_fn"))
    if not isinstance(model_fn, gin.config.ConfigurableReference):
        raise BackboneError(f"{config_path} binds no train_and_evaluate.model_fn; it is not "
                            "the operative config of a tfdp run.")
    image_shape, num_classes = _export_signature(os.path.join(workdir, _EXPORT_PB))
    kwargs = _configurable_kwargs(model_fn.configurable, bindings)
    model = model_fn.configurable.wrapped(num_classes=num_classes, input_shape=image_shape,
                                          **kwargs)
    _restore_exported_parameters(model, checkpoint)
    logging.info("Backbone %s rebuilt from %s with %s(%s) and weights from %s.",
                 model.name, config_path, model_fn.configurable.name, kwargs,
                 storage.user_path(checkpoint))
    return model


def _data_setting(bindings, name, default=None):
    """A `tfdp.DataConfig` setting of a workdir's operative config (`_operative_bindings`).

    Workdirs of older tfdp versions bound it as an argument of
    `train_and_evaluate` (`tfdp.configs.MOVED`); both are read.
    """
    for key in (("DataConfig", name), ("train_and_evaluate", name)):
        if key in bindings:
            return bindings[key]
    return default


def _operative_bindings(config_path):
    """`{(configurable name, argument): value}` of an operative config, macros resolved."""
    from gin import config_parser  # pylint: disable=g-import-not-at-top

    with open(config_path) as f:
        text = f.read()
    try:
        statements = [s for s in config_parser.ConfigParser(
            text, gin.config.ParserDelegate(skip_unknown=True))
            if isinstance(s, config_parser.BindingStatement)]
    except (ValueError, SyntaxError) as e:
        raise BackboneError(f"Could not parse {config_path}: {e}") from e
    macros = {s.selector: s.value for s in statements if not s.arg_name and not s.scope}

    def resolve(value):
        if isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
            name = value.scoped_selector.rsplit("/", 1)[0]
            if name not in macros:
                raise BackboneError(f"{config_path} uses macro {name} but does not define it.")
            return resolve(macros[name])
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    bindings = {}
    for s in statements:
        if s.arg_name:
            key = (s.selector.rsplit(".", 1)[-1], s.arg_name)
            bindings[key if not s.scope else (f"{s.scope}/{key[0]}", s.arg_name)] = resolve(
                s.value)
    return bindings


def _configurable_kwargs(configurable, bindings):
    """The keyword arguments the operative config bound for `configurable`."""
    kwargs = {}
    for (selector, arg), value in bindings.items():
        if selector.rsplit("/", 1)[-1] != configurable.name:
            continue
        if "/" in selector:
            raise BackboneError(
                f"The workdir's operative config binds {configurable.name}.{arg} in scope "
                f"{selector.rsplit('/', 1)[0]!r}, which rebuilding cannot reproduce; save the "
                "model to a '.keras' file instead.")
        if isinstance(value, gin.config.ConfigurableReference):
            fn = value.configurable.wrapped
            inner = _configurable_kwargs(value.configurable, bindings)
            value = fn(**inner) if value.evaluate else _partial(fn, inner)
        kwargs[arg] = value
    for arg in ("num_classes", "input_shape"):
        kwargs.pop(arg, None)  # the trainer passes them; taken from the export
    return kwargs


def _partial(fn, kwargs):
    import functools  # pylint: disable=g-import-not-at-top

    return functools.partial(fn, **kwargs)


def _export_signature(path):
    """`(image_shape, num_classes)` of a tfdp export's `serve` signature."""
    from tensorflow.core.protobuf import saved_model_pb2  # pylint: disable=g-import-not-at-top

    saved = saved_model_pb2.SavedModel()
    with open(path, "rb") as f:
        saved.ParseFromString(f.read())
    signature = saved.meta_graphs[0].signature_def["serve"]
    image = [d.size for d in signature.inputs["images"].tensor_shape.dim]
    logits = [d.size for d in signature.outputs["logits"].tensor_shape.dim]
    return tuple(image[1:]), int(logits[-1])


def _restore_exported_parameters(model, checkpoint):
    """Reads the exported parameters (EMA if kept, else last) of a tfdp checkpoint into `model`.

    A tfdp checkpoint holds `model=DPModel` (the wrapped model as its
    `model` attribute, the EMA as `ema_state/variables_list/<i>` in the
    order of the trainable variables). The object graph is matched, so an
    architecture that differs fails here.
    """
    reader = tf.train.load_checkpoint(checkpoint)
    has_ema = reader.has_tensor("model/ema_state/variables_list/0/.ATTRIBUTES/VARIABLE_VALUE")
    holder = tf.Module(name="dp_model")
    holder.model = model
    ema = []
    if has_ema:
        ema = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
               for v in model.trainable_variables]
        holder.ema_state = tf.Module(name="ema_state")
        holder.ema_state.variables_list = ema
    try:
        status = tf.train.Checkpoint(model=holder).read(checkpoint).expect_partial()
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.InvalidArgumentError) as e:
        raise BackboneError(
            f"The weights in {storage.user_path(checkpoint)} do not match the model rebuilt from the workdir's "
            f"operative_config.gin ({model.name}): {str(e)[:500]}. Was the workdir written by "
            "another version of the model builder?") from e
    for variable, average in zip(model.trainable_variables, ema):
        variable.assign(average)
    logging.info("Backbone weights: the %s parameters of %s.", "EMA" if has_ema else "last",
                 storage.user_path(checkpoint))


def _application_constructor(backbone):
    name = backbone[len(APPLICATIONS_PREFIX):]
    constructor = getattr(keras.applications, name, None)
    if not name or not callable(constructor) or not name[:1].isupper():
        known = sorted(n for n in dir(keras.applications)
                       if n[:1].isupper() and callable(getattr(keras.applications, n)))
        raise BackboneError(f"Unknown Keras application {backbone!r}. Known: "
                            f"{', '.join(APPLICATIONS_PREFIX + n for n in known)}.")
    return name, constructor


def _load_application(backbone, backbone_weights, input_shape):
    name, constructor = _application_constructor(backbone)
    if backbone_weights is None:
        raise BackboneError(
            f"{backbone} needs backbone_weights: a LOCAL weights file (nothing downloads at "
            "run time). Download it on a machine with network access, e.g. "
            f"keras.applications.{name}(weights='imagenet') saves it under ~/.keras/models/; "
            "for a randomly initialized backbone, save "
            f"keras.applications.{name}(weights=None) to a '.keras' file and give that.")
    if not os.path.isfile(backbone_weights):
        raise BackboneError(f"backbone_weights {backbone_weights!r} does not exist or is not a "
                            "file; give the local weights file of " + backbone + ".")
    shape = None if input_shape is None else tuple(input_shape)
    errors = []
    for include_top in (True, False):
        kwargs = {"weights": None, "include_top": include_top, "input_shape": shape}
        if not include_top:
            kwargs["pooling"] = "avg"
        try:
            model = constructor(**kwargs)
        except ValueError as e:
            errors.append(f"include_top={include_top}: {e}")
            continue
        try:
            model.load_weights(backbone_weights)
        except (ValueError, KeyError, OSError, TypeError) as e:
            errors.append(f"include_top={include_top}: {' '.join(str(e).split())[:300]}")
            continue
        logging.info("Backbone %s (include_top=%s) with weights %s.", backbone, include_top,
                     backbone_weights)
        return model
    raise BackboneError(
        f"The weights file {backbone_weights!r} does not match {backbone} (tried with and "
        f"without the ImageNet top): {'; '.join(errors)}. Give the weights file of this "
        "very application (e.g. resnet50_weights_tf_dim_ordering_tf_kernels.h5 or its "
        "_notop variant for ResNet50).")


def _app_preprocessing(backbone):
    """A layer applying the application family's `preprocess_input` to [0, 255] pixels."""
    _, constructor = _application_constructor(backbone)
    family = getattr(keras.applications, constructor.__module__.rsplit(".", 1)[-1], None)
    preprocess = getattr(family, "preprocess_input", None)
    if preprocess is None:
        raise BackboneError(f"No preprocess_input found for {backbone}.")
    return keras.layers.Lambda(preprocess, name="backbone_preprocessing")


def _feature_tensor(backbone, feature_layer, *, pooled_output=False):
    """The symbolic features of `backbone`: a named layer's output or the last Dense's input.

    Args:
      backbone: the loaded `keras.Model`.
      feature_layer: None, or the name of the layer whose output are the features.
      pooled_output: without a Dense layer, take the backbone's single 2-D output (a
        keras.applications model without its top: its pooled features). Any other
        backbone without a Dense layer needs `feature_layer`: its output may as well be
        class scores.

    Raises:
      BackboneError: an unknown feature_layer, or no Dense layer (and no pooled output)
        to take the features from; the message lists the layers.
    """
    names = [layer.name for layer in backbone.layers]
    if feature_layer is not None:
        try:
            return backbone.get_layer(feature_layer).output
        except ValueError:
            raise BackboneError(
                f"feature_layer={feature_layer!r} is not a layer of the backbone "
                f"{backbone.name!r}; its layers: {', '.join(names)}.") from None
    try:
        dense = [layer for layer in backbone.layers if isinstance(layer, keras.layers.Dense)]
        if dense:
            return dense[-1].input
        outputs = list(backbone.outputs or [])
        if pooled_output and len(outputs) == 1 and len(outputs[0].shape) == 2:
            return outputs[0]  # a notop application: its pooled features
    except AttributeError as e:  # a layer never called: Keras knows no symbolic tensor
        raise BackboneError(
            f"The features of the backbone {backbone.name!r} cannot be located ({e}). Name "
            "the layer whose output are the features with feature_layer= (its layers: "
            f"{', '.join(names)}).") from None
    raise BackboneError(
        f"The backbone {backbone.name!r} has no Dense layer whose input would be the "
        "features; name the layer whose output are the features with feature_layer= (e.g. "
        f"tfdp.models.build_finetune_model.feature_layer = '{names[-1] if names else 'NAME'}'; "
        f"its layers: {', '.join(names)}).")


def _adapt_images(images, input_shape, target):
    """Channels then size of `images` to the backbone's `target` (h, w, c), on [0, 255] pixels."""
    x = images
    have, want = input_shape[-1], target[-1]
    if have != want:
        if (have, want) == (1, 3):
            x = keras.layers.Concatenate(axis=-1, name="gray_to_rgb")([x, x, x])
        elif (have, want) == (3, 1):
            luma = np.asarray(_LUMA, np.float32)
            x = keras.layers.Lambda(
                lambda t: keras.ops.sum(t * luma, axis=-1, keepdims=True), name="rgb_to_gray")(x)
        else:
            raise ValueError(f"Cannot convert {have}-channel images to the backbone's {want} "
                             "channels; only 1 <-> 3 are converted.")
    if tuple(input_shape[:2]) != tuple(target[:2]):
        x = keras.layers.Resizing(target[0], target[1], interpolation="bilinear",
                                  name="resize_to_backbone")(x)
    return x


def _head_layer(model):
    try:
        return model.get_layer(HEAD)
    except ValueError:
        pass
    dense = [layer for layer in _all_sublayers(model) if isinstance(layer, keras.layers.Dense)]
    if not dense:
        raise ValueError(f"{model.name!r} has no Dense layer to treat as its head; build it with "
                         "tfdp.models.build_finetune_model.")
    return dense[-1]


def _all_sublayers(model):
    for layer in getattr(model, "layers", []):
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_sublayers(layer)


def _leaf_layers(model, prefix=""):
    """`(path, layer)` of every non-model layer below `model`, nested models expanded."""
    for layer in getattr(model, "layers", []):
        path = f"{prefix}{layer.name}"
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer, path + "/")
        else:
            yield path, layer


def _is_inside(layer, container):
    return isinstance(container, keras.Model) and any(
        layer is inner for inner in _all_sublayers(container))


def _freeze_batch_norms(model):
    for layer in _all_sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
