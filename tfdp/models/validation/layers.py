"""The layers of a model, nested ones included, and which BatchNormalization is frozen."""

import keras


def _direct_children(layer):
    """Returns the layers directly nested in `layer`, in a stable order."""
    children = list(layer.layers) if isinstance(layer, keras.Model) else []
    for value in vars(layer).values():
        if isinstance(value, keras.layers.Layer):
            children.append(value)
        elif isinstance(value, (list, tuple)):
            children.extend(v for v in value if isinstance(v, keras.layers.Layer))
        elif isinstance(value, dict):
            children.extend(v for v in value.values() if isinstance(v, keras.layers.Layer))
    return children


def iter_layers(layer):
    """Yields (path, layer) for `layer` and every layer nested in it, each once.

    Nested layers are found through `keras.Model.layers` and through the
    attributes of any layer (sub-layers kept in attributes, lists, tuples or
    dicts), so functional, sequential and subclassed models are all covered.
    The walk is depth first; a layer reachable twice is yielded once.

    Args:
      layer: a `keras.layers.Layer` (a `keras.Model` is one).

    Yields:
      (path, layer) pairs, path being the "/"-joined layer names from `layer`
      down, starting with (layer.name, layer).
    """
    seen = set()
    stack = [(layer.name, layer)]
    while stack:
        path, current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield path, current
        children = _direct_children(current)
        stack.extend((f"{path}/{child.name}", child) for child in reversed(children))


def is_frozen_batch_norm(layer):
    """True for a `keras.layers.BatchNormalization` that runs in inference mode in every call.

    Such a layer normalizes each example with its moving mean and variance,
    which are fixed (public, pretrained) statistics, so it mixes no examples
    and its statistics never change. Keras 3 runs a BatchNormalization with
    `trainable=False` in inference mode even when called with
    `training=True`: its `call` takes the batch moments only under
    `if training and self.trainable:` (keras/src/layers/normalization/
    batch_normalization.py, `BatchNormalization.call`, and the class doc's
    "About setting `layer.trainable = False`"). Only the exact class is
    trusted (synchronized or not: synchronization only changes the batch
    moments, which a frozen layer never computes); a subclass may override
    `call`.

    Args:
      layer: any `keras.layers.Layer`.

    Returns:
      bool.
    """
    return type(layer) is keras.layers.BatchNormalization and not layer.trainable
