"""Stage 4, the model's input: frozen public feature extractors and the model builder's checks.

A frozen public feature extractor (ScatterNet, Tramer & Boneh 2021, App.
C.1; or a fine-tuning model's frozen trunk, De et al. 2022, Table 20)
computes every image's features once; the head trains on them, and the
export composes the two. The features of the private data are private state
of the run: cached in its workdir until it finishes, checked against the
data and the extractor before a resume reuses them, never exported. The
private data normalization of ScatterNet
features (Tramer & Boneh 2021, App. B) is released once per workdir. A
pretrained backbone is checked against the run's private data.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
from typing import Any, Dict, NamedTuple, Optional

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from tfdp import data
from tfdp import models
from tfdp import storage
from tfdp.data import fingerprint

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


class Features(NamedTuple):
    """What `cached_features` returns.

    Attributes:
      train, test: the sources the model reads (`ArraySource`s of float32
        `[N, h, w, K]` features, or the `TFDSSource`s unchanged).
      head_kwargs: the keyword arguments that pass the private feature mean
        and variance to the head builder (empty without data normalization).
      unsaved: `{"train": features, "test": features}` when they were
        computed and not yet in the workdir's cache (the trainer's chief
        keeps them with `write_feature_cache` once checkpoint 0 exists),
        else None (read from the cache, or no extractor).
    """

    train: Any
    test: Any
    head_kwargs: Dict[str, np.ndarray]
    unsaved: Optional[Dict[str, np.ndarray]]


def cached_features(train, test, extractor, data_normalization, workdir, *,
                    fingerprints=None):
    """Replaces pixels by cached features, privately normalized if asked.

    The features of every image are computed once by the frozen extractor
    and held in memory (`tfdp.data.ArraySource`): fine for the small
    datasets the ScatterNet and fine-tuning configs use (Fashion-MNIST:
    1.1 GB of float32 ScatterNet features; CIFAR-10: 3.7 GB; a backbone's
    pooled features far less), not meant for ImageNet. The trainer keeps them
    in the workdir's feature cache (`FEATURE_CACHE_DIR`, `write_feature_cache`)
    once checkpoint 0 is written, and a resumed run reads them from there
    after checking them (`read_feature_cache`). The cache holds features of
    private examples: private state of the run, in its workdir under the
    lock, never exported, and removed before the run is marked finished
    (`remove_feature_cache`). Without an extractor, the splits stay on disk.

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
      workdir: where the release and the feature cache are kept.
      fingerprints: `{"train": ..., "test": ...}`, the splits'
        `tfdp.data.fingerprint.split_fingerprint`s if already computed (None:
        computed here); the cache records them.

    Returns:
      A `Features` (train, test, head_kwargs, unsaved).

    Raises:
      ValueError: data normalization without ScatterNet features, a saved
        release whose settings differ from `data_normalization`, or a feature
        cache that does not hold this data's features under this extractor
        (`read_feature_cache`).
    """
    if data_normalization and (extractor is None or extractor.head is not None):
        raise ValueError("data_normalization needs features='scatternet'.")
    if extractor is None:
        return Features(train, test, {}, None)
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
    splits = {"train": train, "test": test}
    if fingerprints is None:
        fingerprints = {role: fingerprint.split_fingerprint(source)
                        for role, source in splits.items()}
    pure_tf = train.pure_tf  # the features keep the input's sampler (numpy or in-graph)
    arrays = {role: data.read_split(source) for role, source in splits.items()}
    computed = read_feature_cache(workdir, extractor, splits, fingerprints,
                                  arrays["train"].images)
    unsaved = None
    if computed is None:
        logging.info("Computing the features of the %s for %d + %d images once.",
                     extractor.name, train.num_examples, test.num_examples)
        computed = unsaved = {role: extractor.compute_features(split.images)
                              for role, split in arrays.items()}
    train, test = (data.ArraySource(*arrays[role]._replace(images=computed[role]),
                                    pure_tf=pure_tf) for role in ("train", "test"))
    if not data_normalization:
        return Features(train, test, {}, unsaved)
    if released is None:
        from tfdp.dp import data_normalization as data_norm  # pylint: disable=g-import-not-at-top

        mean, variance = data_norm.private_channel_mean_and_var(
            computed["train"],
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
    return Features(train, test, {k: np.asarray(released[k], np.float32)
                                  for k in ("feature_mean", "feature_variance")}, unsaved)


# -- The feature cache: private state of the run, in its workdir ---------------------------
FEATURE_CACHE_DIR = "feature_cache"
FEATURE_CACHE_RECORD = "cache.json"  # written last: without it, the cache is not there
ROLES = ("train", "test")
# The extractor is checked by running it again on the first PROBE_EXAMPLES training
# images and comparing with the cached features, channel by channel (the last axis): each
# may differ by PROBE_TOLERANCE of the channel's largest cached magnitude on those images.
# The same extractor on the same device gives the same features (measured: ScatterNet's
# features of 8 images alone equal the first 8 of a batch of 256, bit for bit, on the
# 2-core CPU); another device's matmul precision moves them by up to about 1e-3 (TF32) or
# 1e-2 (bf16) of their magnitude, and another extractor (other weights, another image
# size, another ScatterNet) by far more.
PROBE_EXAMPLES = 16
PROBE_TOLERANCE = 2e-2


def _array_record(array):
    array = np.ascontiguousarray(array)
    return {"shape": list(array.shape), "dtype": array.dtype.str,
            "sha256": hashlib.sha256(array.data).hexdigest()}


def _extractor_versions():
    """The versions the features may depend on, recorded for the messages (not compared)."""
    versions = {"tensorflow": tf.__version__}
    try:
        import kymatio  # pylint: disable=g-import-not-at-top

        versions["kymatio"] = kymatio.__version__
    except ImportError:
        pass
    return versions


def _cache_folder(workdir):
    """`WORKDIR/feature_cache`, refused where it is a symbolic link (never followed).

    Raises:
      ValueError: the folder is a link (it would read, write or delete the
        files of the folder it points to: another run's cache, a user's data).
    """
    folder = storage.join(workdir, FEATURE_CACHE_DIR)
    if not storage.is_url(folder) and os.path.islink(folder):
        raise ValueError(
            f"{folder} is a symbolic link: tfdp keeps a run's features only in a folder of "
            "its own and never writes or deletes through a link (the folder it points to is "
            "untouched). Remove the link, and run the same command again.")
    return folder


def _remove_cache_files(folder):
    """Removes tfdp's own cache files in `folder` (record first), not the folder."""
    storage.remove(storage.join(folder, FEATURE_CACHE_RECORD))  # first: no half a cache
    for role in ROLES:
        storage.remove(storage.join(folder, f"{role}.npy"))
    for path in storage.glob(folder, "*.npy.tmp-*"):
        storage.remove_any(path)


def write_feature_cache(workdir, extractor, fingerprints, computed):
    """Keeps `computed` (`{"train": features, "test": features}`) in the workdir's cache.

    Called by the trainer's chief once checkpoint 0 is written (so a run
    refused while its model is built leaves no private features behind).
    Arrays that no `cache.json` vouches for (an interrupted write's, tfdp's
    own) are removed first; each array is written whole
    (`tfdp.storage.write_array`), then `cache.json`, which records the
    extractor's name, the versions, the data's fingerprints and each array's
    shape, dtype and SHA-256. A failed write (a full disk) removes what it
    wrote, is logged, and the run goes on without a cache: it is an
    optimization, and the next checkpoint's write reports the disk.

    Args:
      workdir: the run's workdir (held under its lock by the caller).
      extractor: the `tfdp.models.FrozenFeatureExtractor` that computed them.
      fingerprints: `{"train": ..., "test": ...}` split fingerprints.
      computed: `{"train": np.float32 [N, ...], "test": np.float32 [M, ...]}`.
    """
    folder = _cache_folder(workdir)
    record = {"extractor": extractor.name, "versions": _extractor_versions(),
              "data": fingerprints,
              "arrays": {role: _array_record(computed[role]) for role in ROLES}}
    try:
        storage.makedirs(folder)
        _remove_cache_files(folder)  # no record here (else the features were read, not computed)
        for role in ROLES:
            storage.write_array(storage.join(folder, f"{role}.npy"), computed[role])
        storage.write_whole(storage.join(folder, FEATURE_CACHE_RECORD),
                            json.dumps(record, indent=1, sort_keys=True))
    except (OSError, tf.errors.OpError) as e:
        with contextlib.suppress(OSError, tf.errors.OpError):
            _remove_cache_files(folder)
            storage.rmdir_if_empty(folder)
        logging.warning("The feature cache %s could not be written (%s); the run goes on "
                        "without it, and a resume computes the features again.", folder, e)
        return
    logging.info("Kept the %s features in %s (private state of this run: never exported, "
                 "removed when the run finishes).", extractor.name, folder)


def read_feature_cache(workdir, extractor, splits, fingerprints, train_images):
    """The cached features of this run's splits, checked; None when there is no cache.

    A cache is reused only when it holds this data's features under this
    extractor:
      - the data: the fingerprints it recorded equal the splits' now
        (`tfdp.data.fingerprint.compare`, as a resume's check);
      - the arrays: each one's shape, dtype and SHA-256 equal what
        `cache.json` recorded (a truncated or edited file);
      - the extractor, by what it computes (not its name): run again on the
        first `PROBE_EXAMPLES` training images, it gives the cached features,
        each channel within `PROBE_TOLERANCE` of its largest magnitude.
    A cache that fails a check is refused, never replaced: the message says
    how to recompute it.

    Args:
      workdir: the run's workdir.
      extractor: this run's `tfdp.models.FrozenFeatureExtractor`.
      splits: `{"train": source, "test": source}`, the opened splits.
      fingerprints: their fingerprints now.
      train_images: the training split's images (uint8 [N, H, W, C]).

    Returns:
      `{"train": np.float32 [N, ...], "test": np.float32 [M, ...]}`, or None.

    Raises:
      ValueError: a cache of other data, an unreadable or corrupt one, or one
        computed by another extractor; the message says what to do.
    """
    folder = _cache_folder(workdir)
    record_path = storage.join(folder, FEATURE_CACHE_RECORD)
    if not storage.exists(record_path):
        return None
    fix = (f"To compute the features again, delete {folder} (tfdp keeps nothing else there; "
           "the run's checkpoints and privacy record stay, and the extractor is public, so "
           "this spends no privacy); or use a new workdir.")
    try:
        record = json.loads(storage.read_text(record_path))
        saved = record["data"]
        expected = {role: record["arrays"][role] for role in ROLES}
        if not isinstance(saved, dict) or not all(isinstance(e, dict)
                                                  for e in (*saved.values(), *expected.values())):
            raise TypeError("its data and arrays must be JSON objects")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"The feature cache {folder}: {FEATURE_CACHE_RECORD} cannot be read "
                         f"({type(e).__name__}: {e}). {fix}") from None
    changed = fingerprint.compare(saved, splits, current=fingerprints)
    if changed:
        raise ValueError(
            f"The feature cache {folder} holds the features of other data than this run "
            f"reads: {'; '.join(changed)}. Use the data it was computed from (the same "
            f"data_dir and splits). {fix}")
    computed = {}
    for role in ROLES:
        try:
            array = storage.read_array(storage.join(folder, f"{role}.npy"))
        except (OSError, ValueError, EOFError, tf.errors.OpError) as e:
            raise ValueError(f"The feature cache {folder}: {role}.npy cannot be read ({e}). "
                             f"{fix}") from None
        if _array_record(array) != expected[role]:
            raise ValueError(
                f"The feature cache {folder}: {role}.npy is not what {FEATURE_CACHE_RECORD} "
                f"recorded (shape {list(array.shape)}, dtype {array.dtype.str}; recorded "
                f"{expected[role].get('shape')}, {expected[role].get('dtype')} and a SHA-256): "
                f"it was truncated or changed. {fix}")
        computed[role] = array
    probe = np.asarray(extractor.compute_features(train_images[:PROBE_EXAMPLES]), np.float32)
    cached = computed["train"][:PROBE_EXAMPLES]
    problem = _probe_difference(probe, cached)
    if problem:
        raise ValueError(
            f"The feature cache {folder} does not hold what this run's {extractor.name} "
            f"computes: on the first {len(cached)} training images, {problem}. It was "
            f"computed by {record.get('extractor')!r} with {record.get('versions')}; this run "
            f"has {_extractor_versions()}. Another extractor (other weights, image size or "
            "version) gives other features; a device of lower matmul precision than the one "
            "that computed them (bf16 against float32) can too. The run's checkpoints trained "
            f"on the cached features: resume with the extractor and device they came from. "
            f"{fix}")
    logging.info("Read the %s features of %d + %d images from the feature cache %s (checked: "
                 "data, SHA-256, %d probe images).", extractor.name, len(computed["train"]),
                 len(computed["test"]), folder, len(cached))
    return computed


def _probe_difference(probe, cached):
    """Why `probe` is not `cached` within the per-channel tolerance, or None."""
    if probe.shape != cached.shape:
        return f"the features have shape {probe.shape[1:]}, cached {cached.shape[1:]}"
    channels = cached.reshape(-1, cached.shape[-1]) if cached.ndim > 1 else cached[:, None]
    errors = np.abs(probe.reshape(channels.shape) - channels).max(axis=0)
    scales = np.abs(channels).max(axis=0)
    floor = PROBE_TOLERANCE * 1e-3 * float(scales.max(initial=0.0))  # all-zero channels
    bad = ~(errors <= PROBE_TOLERANCE * scales + floor)
    if not bad.any():
        return None
    worst = int(np.argmax(np.where(bad, errors / np.maximum(scales, floor), -1.0)))
    return (f"{int(bad.sum())} of {len(scales)} channels differ by more than "
            f"{PROBE_TOLERANCE:g} of their largest magnitude (channel {worst}: "
            f"{errors[worst]:.3g} against {scales[worst]:.3g})")


def remove_feature_cache(workdir):
    """Removes the workdir's feature cache: before the run is marked finished, or after.

    Features of private examples are kept no longer than the run needs them:
    the trainer removes them before it writes FINISHED, and a rerun of a
    finished run removes any left behind (a kill in between). Only tfdp's
    own files are removed (the record first, the arrays, an interrupted
    write's temporaries); the folder too if it is then empty.
    """
    folder = _cache_folder(workdir)
    if not storage.isdir(folder):
        return
    _remove_cache_files(folder)
    storage.rmdir_if_empty(folder)
