"""Stage 4, the model's input: frozen public feature extractors and the model builder's checks.

A frozen public feature extractor (ScatterNet, Tramer & Boneh 2021, App.
C.1; or a fine-tuning model's frozen trunk, De et al. 2022, Table 20)
computes every image's features once; the head trains on them, and the
export composes the two. The private data normalization of ScatterNet
features (Tramer & Boneh 2021, App. B) is released once per workdir. A
pretrained backbone is checked against the run's private data.
"""

import dataclasses
import json
import os

import gin
import numpy as np
from absl import logging

from tfdp import data
from tfdp import models
from tfdp import storage

DATA_NORMALIZATION_FILE = "data_normalization.json"


def check_builder_bindings(model_fn):
    """Refuses gin bindings of what the trainer passes to `model_fn` itself.

    The trainer calls `model_fn(num_classes=..., input_shape=...)` from the
    data, and gin lets explicit arguments win over bindings silently, so a
    binding such as `build_tramer_cnn.num_classes = 5` would be ignored.
    """
    try:
        bound = sorted(set(gin.get_bindings(model_fn)) & {"num_classes", "input_shape"})
    except (ValueError, TypeError):  # not a gin configurable: nothing can be bound
        return
    if bound:
        raise ValueError(
            f"model_fn's {', '.join(bound)} is bound in the gin config, but the trainer sets "
            "it from the dataset (and gin would ignore the binding). Remove the binding; "
            "change the dataset or image_size instead.")


def check_output_width(model, num_classes, dataset):
    """Refuses a model whose logits do not cover the dataset's classes, before training.

    Otherwise the first labels past the logits fail deep inside the loss, with
    a long TF traceback.
    """
    width = model.output_shape[-1] if len(model.output_shape) == 2 else None
    if width != num_classes:
        raise ValueError(
            f"model_fn built a model with output shape {model.output_shape}, but {dataset!r} "
            f"has {num_classes} classes: the model must return logits [batch, {num_classes}]. "
            "Check model_fn and its num_classes.")


def feature_extractor(features, model_fn, train, *, augmult, augmentation):
    """The frozen public feature extractor (`tfdp.models.FrozenFeatureExtractor`), if any.

    One mechanism for two cases. `features="scatternet"`: the ScatterNet
    (Tramer & Boneh 2021, App. C.1), whose head `model_fn` builds later on
    the feature shape. `features=None`: `model_fn` builds the model on
    pixels; if only its head trains (`build_finetune_model` with
    trainable="head") and there is no augmentation (augmult 0), its frozen
    trunk is the extractor and its head is trained on cached features (De et
    al. 2022, Table 20: last layer, augmult 0). With augmult > 0 the trunk
    runs forward on every view instead, and only the head's variables get
    gradients.

    Returns:
      `(extractor, model, backbone)`: the extractor or None, the model built
      on pixels (None for ScatterNet, whose head is built on the features),
      and the model's pretrained backbone's provenance
      (`tfdp.models.backbone_provenance`) or None.

    Raises:
      ValueError: an unknown `features`, or a backbone trained on examples of
        this run's private split (`check_backbone_data`).
    """
    if features == "scatternet":
        image_shape = train.image_shape
        return models.FrozenFeatureExtractor(
            name="scatternet", compute_features=models.compute_scatternet_features,
            compose=lambda head: models.build_scatternet_classifier(head, image_shape)
        ), None, None
    if features is not None:
        raise ValueError(f"Unknown features {features!r}; use None or 'scatternet'.")
    model = model_fn(num_classes=train.num_classes, input_shape=train.image_shape)
    backbone = check_backbone_data(model, train)
    extractor = models.frozen_feature_extractor(model)
    if extractor is not None and (augmult > 0 or augmentation is not None):
        logging.info("Only the head trains, but with augmult=%d the %s runs forward on every "
                     "view (no backward pass through it) instead of once.", augmult,
                     extractor.name)
        return None, model, backbone
    return extractor, (None if extractor is not None else model), backbone


def check_backbone_data(model, train):
    """The provenance of `model`'s pretrained backbone, refused if it saw this run's data.

    The guarantee of a fine-tuning run covers its own training only: the
    backbone's weights are a released function of the backbone's training
    data, which must therefore be public or disjoint from the private data
    (De et al. 2022, Sec. 4: pretraining on public data). For a tfdp-workdir
    backbone this is checked: a backbone trained (privately or not) on a
    split of the same dataset (any spelling TFDS accepts: versions and configs
    do not make another dataset, `tfdp.data.dataset_identity`) that shares an
    example with this run's split is refused, and so is one trained on
    another dataset built from the same images (`tfdp.data.image_collection`:
    ImageNet-32 and ImageNet), whose examples cannot be matched. Where the
    splits cannot be compared (a JPEG folder, a name that is not a TFDS
    dataset), the backbone is reported as not checked, with why. Keras files
    and keras.applications weights cannot be checked; the report says so.

    Returns:
      The provenance dict (`tfdp.models.backbone_provenance`), or None for a
      model without a pretrained backbone.

    Raises:
      ValueError: on a backbone trained on overlapping data or on the same
        collection of images, or a backbone workdir that does not record its
        dataset.
    """
    backbone = getattr(model, models.finetune.PROVENANCE_ATTRIBUTE, None)
    if backbone is None:
        return None
    if not backbone["verified"]:
        logging.warning(
            "The pretrained backbone %s (%s) cannot be checked: this run's guarantee assumes "
            "its training data is public, or disjoint from %s %s. The report says so.",
            backbone["source"], backbone["kind"], train.name, train.split)
        return backbone
    if backbone["dataset"] is None:
        raise ValueError(
            f"The backbone workdir {backbone['source']} does not record the dataset it was "
            "trained on (its operative_config.gin binds no tfdp.DataConfig.dataset), "
            "so tfdp cannot check that it shares no example with this run's private data. "
            "Export it as a .keras file if its training data is public.")
    why_not = _backbone_not_comparable(backbone, train)
    if why_not:
        logging.warning(
            "The pretrained backbone %s was trained on %s %r, which tfdp cannot compare with "
            "this run's %s %r (%s): this run's guarantee assumes the two share no example. "
            "The report says so.", backbone["source"], backbone["dataset"],
            backbone["train_split"], train.name, train.split, why_not)
        return dict(backbone, verified=False, not_checked_because=why_not)
    trained = ("WITHOUT privacy" if backbone["privacy"] == "NOT PRIVATE" else
               f"at epsilon = {backbone['privacy']['epsilon']:.4g}")
    # Datasets are compared as TFDS identities, not strings: "fashion_mnist:3.0.1" and
    # "Fashion_MNIST" are fashion_mnist (tfdp.data.dataset_identity).
    if data.same_dataset(backbone["dataset"], train.name):
        if data.splits_overlap(train.name, backbone["train_split"], train.split,
                               data_dir=train.data_dir,
                               image_size=getattr(train, "image_size", None)):
            raise ValueError(
                f"The backbone {backbone['source']} was trained {trained} on "
                f"{backbone['dataset']} {backbone['train_split']!r}, which shares examples with "
                f"this run's private split {train.split!r} of {train.name}. Its weights would "
                "release those examples outside this run's guarantee. Pretrain on a disjoint "
                "public split (e.g. 'train[:2000]' and fine-tune on 'train[2000:]'), or train "
                "from scratch.")
    elif data.image_collection(backbone["dataset"]) == data.image_collection(train.name):
        raise ValueError(
            f"The backbone {backbone['source']} was trained {trained} on "
            f"{backbone['dataset']} {backbone['train_split']!r}, a dataset built from the same "
            f"images as this run's {train.name} ({data.image_collection(train.name)}), whose "
            "examples tfdp cannot match against this run's split: it may have seen this run's "
            "private examples. Pretrain on another collection of images.")
    return backbone


def _backbone_not_comparable(backbone, train):
    """Why the backbone's training split cannot be matched with `train`'s, or None.

    Splits are matched as ranges of one TFDS dataset's example order; a JPEG
    folder's slices follow its own index table instead, and a name that TFDS
    cannot parse (a JPEG folder's free-text name) names no TFDS dataset.
    """
    sources = {backbone.get("input_source", "array_record"),
               "jpeg_folder" if isinstance(train, data.JPEGFolderSource) else "tfds"}
    if "jpeg_folder" in sources:
        return "a JPEG folder's slices follow its own index table, not a TFDS example order"
    for name in (backbone["dataset"], train.name):
        if not data.is_tfds_dataset(name):
            return f"{name!r} is not a TFDS dataset"
    return None


def cached_features(train, test, extractor, data_normalization, workdir):
    """Replaces pixels by cached features, privately normalized if asked.

    The features of every image are computed once by the frozen extractor
    and held in memory (`tfdp.data.ArraySource`): fine for the small
    datasets the ScatterNet and fine-tuning configs use (Fashion-MNIST,
    CIFAR-10: about 1 GB of float32 ScatterNet features, far less for a
    backbone's pooled features), not meant for ImageNet. Without an
    extractor, the splits stay on disk.

    The private mean and variance are released once per run: they are saved,
    with the sigma and bounds they were released under, to
    `workdir/data_normalization.json` and reused on resume, so a restarted run
    never draws (and spends privacy on) a second noisy release. A saved
    release under other settings is refused, never reused.

    Args:
      train, test: the splits' sources (`tfdp.data.TFDSSource`).
      extractor: None or a `tfdp.models.FrozenFeatureExtractor`.
      data_normalization: None, or the mechanism's `DataNormalization`
        (ScatterNet only: the head builder takes the released statistics).
      workdir: where the release is kept.

    Returns:
      `(train, test, head_kwargs)`: the sources (`ArraySource`s of float32
      `[N, h, w, K]` features, or the `TFDSSource`s unchanged), and the keyword
      arguments that pass the private feature mean and variance to the head
      builder.

    Raises:
      ValueError: data normalization without ScatterNet features, or a
        saved release whose settings differ from `data_normalization`.
    """
    if data_normalization and (extractor is None or extractor.head is not None):
        raise ValueError("data_normalization needs features='scatternet'.")
    if extractor is None:
        return train, test, {}
    path = os.path.join(workdir, DATA_NORMALIZATION_FILE)
    released = None
    if data_normalization and storage.exists(path):
        released = json.loads(storage.read_text(path))
        settings = dataclasses.asdict(data_normalization)
        if released.get("released_with") != settings:
            raise ValueError(
                f"{path} holds a private normalization released with "
                f"{released.get('released_with', 'unrecorded settings')}, but this run asks for "
                f"{settings}. Reusing it would misstate the privacy cost, and releasing "
                "another would spend privacy twice in one workdir: restore the original "
                "settings, or use a new workdir.")
    logging.info("Computing the features of the %s for %d + %d images once.",
                 extractor.name, train.num_examples, test.num_examples)
    pure_tf = train.pure_tf  # the features keep the input's sampler (numpy or in-graph)
    train, test = (data.read_split(source) for source in (train, test))
    train = train._replace(images=extractor.compute_features(train.images))
    test = test._replace(images=extractor.compute_features(test.images))
    sources = data.ArraySource(*train, pure_tf=pure_tf), data.ArraySource(*test, pure_tf=pure_tf)
    if not data_normalization:
        return (*sources, {})
    if released is None:
        from tfdp.dp import data_normalization as data_norm  # pylint: disable=g-import-not-at-top

        mean, variance = data_norm.private_channel_mean_and_var(
            train.images,
            l2_clip_norm_mean=data_normalization.l2_clip_norm_mean,
            l2_clip_norm_square=data_normalization.l2_clip_norm_square,
            noise_multiplier=data_normalization.noise_multiplier,
            threshold=data_normalization.threshold,
        )
        released = {"feature_mean": mean.numpy().tolist(),
                    "feature_variance": variance.numpy().tolist(),
                    "released_with": dataclasses.asdict(data_normalization)}
        storage.makedirs(workdir)
        storage.write_whole(path, json.dumps(released))
    return (*sources, {k: np.asarray(released[k], np.float32)
                       for k in ("feature_mean", "feature_variance")})
