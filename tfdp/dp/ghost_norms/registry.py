"""Which rule a layer class has: a registry that `tfdp.training.ghost_taps` fills.

Pure Python: the registry never imports Keras; `tfdp.training.ghost_taps.registry`
registers the Keras layer classes' tap rules here.
"""

from typing import Any, Callable, Optional

_LAYER_RULES: dict = {}


class UnsupportedLayer(Exception):
    """A registered rule cannot handle this instance (e.g. a LoRA kernel).

    Raised by a rule before it records anything; the layer then keeps the
    vectorized per-example path for its variables.
    """


def register_layer_rule(layer_class: type, rule: Callable[..., Any]) -> None:
    """Registers `rule` for instances of exactly `layer_class`.

    Subclasses are not matched: a subclass may change the forward pass (as
    `WSConv2D` does to `Conv2D`), so it needs a rule of its own.

    Args:
      layer_class: a layer class (the registry never imports Keras itself).
      rule: whatever the caller dispatches to; `tfdp.training.ghost_clipping`
        registers its tap functions here.
    """
    _LAYER_RULES[layer_class] = rule


def find_layer_rule(layer: Any) -> Optional[Callable[..., Any]]:
    """The rule registered for `type(layer)`, or None."""
    return _LAYER_RULES.get(type(layer))
