"""The tap rules' registry and what rules share (a bias and activation site).

Norms: `tfdp.dp.ghost_norms.registry` keeps which layer class has which rule;
a bias's norms are `tfdp.dp.ghost_norms.broadcast`'s.
"""

from tfdp.dp.ghost_norms import broadcast as broadcast_norms
from tfdp.dp.ghost_norms import registry as layer_rules


def register(*layer_classes):
    """Decorator: registers a tap rule `(layer, inputs, recorder) -> outputs`."""

    def decorate(rule):
        for cls in layer_classes:
            layer_rules.register_layer_rule(cls, rule)
        return rule

    return decorate


def require(condition, reason):
    if not condition:
        raise layer_rules.UnsupportedLayer(reason)


def bias_and_activation(layer, z, recorder):
    if layer.bias is not None:
        z = recorder.site(
            layer, [layer.bias], [z], lambda z: z + layer.bias,
            lambda ins, out, g, k: broadcast_norms.broadcast_sq_norms(
                g, layer.bias.shape, num_views=k))
    return z if layer.activation is None else layer.activation(z)
