"""Gin bindings read from a config text, with macros resolved and names made canonical.

Gin prints a config (`gin.config_str()`, `gin.operative_config_str()`, the
text a checkpoint keeps) with the shortest unambiguous names
(`build_optimizer.learning_rate`) and macros unresolved
(`train_and_evaluate.num_steps = %NUM_STEPS`). Two texts that set the same
values can therefore differ line by line, and two that differ only in a
macro's value can look alike. This module parses such a text with gin's own
parser and returns one value per setting, keyed by the configurable's full
name (`tfdp.training.build_optimizer`) and argument, with every macro
replaced by its value, so that settings can be compared (`tfdp.resume_rule`)
and traced to what calls them (`tfdp.main`).

Pure Python over gin; no TensorFlow.
"""

import dataclasses
import inspect
from typing import Dict, Tuple

import gin
from gin import config_parser


@dataclasses.dataclass(frozen=True)
class Reference:
    """`@name` (or `@name()`, evaluate=True) in a binding's value; `name` is canonical."""

    name: str
    evaluate: bool = False

    def __repr__(self):
        return f"@{self.name}{'()' if self.evaluate else ''}"


@dataclasses.dataclass(frozen=True)
class _Macro:
    name: str


class _Delegate:
    """gin's parser delegate: references and macros as plain values (nothing looked up)."""

    def configurable_reference(self, scoped_name, evaluate):
        if scoped_name.endswith("/gin.macro"):  # `%NAME` parsed as a reference
            return _Macro(scoped_name[:-len("/gin.macro")])
        return Reference(canonical_name(scoped_name), bool(evaluate))

    def macro(self, name):
        return _Macro(name)


def canonical_name(selector: str) -> str:
    """The full name of the configurable `selector` names (scope kept), or `selector`.

    `build_optimizer` -> `tfdp.training.build_optimizer`; a name gin does not
    know (a typo, a configurable of an unloaded module) is returned as given.
    """
    scope, _, name = selector.rpartition("/")
    try:
        full = gin.config.parse_value(f"@{name}").configurable.selector
    except (ValueError, KeyError, SyntaxError, AttributeError):
        full = name
    return f"{scope}/{full}" if scope else full


def parse(config_text: str) -> Tuple[Dict[str, object], Dict[Tuple[str, str], object]]:
    """`(macros, bindings)` of a gin config text, as written (macros NOT resolved).

    Returns:
      `macros`: {NAME: value}; `bindings`: {("scope/full.configurable.name",
      argument): value}; values are Python literals, `Reference`s, and
      `_Macro` placeholders (resolve them with `resolved`).

    Raises:
      ValueError, SyntaxError: a text gin cannot parse.
    """
    macros, bindings = {}, {}
    for statement in config_parser.ConfigParser(config_text, _Delegate()):
        if not isinstance(statement, config_parser.BindingStatement):
            continue
        if not statement.arg_name:  # `NAME = value`: a macro
            macros[statement.selector] = statement.value
            continue
        selector = canonical_name(statement.selector)
        if statement.scope:
            selector = f"{statement.scope}/{selector}"
        bindings[(selector, statement.arg_name)] = statement.value
    return macros, bindings


def resolve(value, macros, _seen=()):
    """`value` with every macro replaced by its value in `macros` (recursively)."""
    if isinstance(value, _Macro):
        if value.name not in macros or value.name in _seen:
            return f"%{value.name} (undefined)"
        return resolve(macros[value.name], macros, (*_seen, value.name))
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v, macros, _seen) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, macros, _seen) for k, v in value.items()}
    return value


def resolved(config_text: str) -> Dict[Tuple[str, str], object]:
    """{(configurable, argument): value} of a config text, macros resolved."""
    macros, bindings = parse(config_text)
    return {key: resolve(value, macros) for key, value in bindings.items()}


def found(value, kinds):
    """Every object of `kinds` inside a value, through dicts, lists and tuples."""
    if isinstance(value, kinds):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from found(item, kinds)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from found(item, kinds)


def references(value):
    """Every `Reference` inside a (resolved or not) value."""
    return found(value, Reference)


def macro_uses(value):
    """The names of the macros a value (not resolved) refers to."""
    return (macro.name for macro in found(value, _Macro))


def setting_name(key) -> str:
    """`(configurable, argument)` -> "configurable.argument", e.g. "...build_optimizer.momentum"."""
    return f"{key[0]}.{key[1]}"


NO_DEFAULT = object()


def default_value(key):
    """The default of argument `key[1]` of configurable `key[0]`, or NO_DEFAULT if unknown."""
    selector, argument = key
    try:
        wrapped = gin.config.parse_value(f"@{selector.rpartition('/')[2]}").configurable.wrapped
        parameter = inspect.signature(wrapped).parameters[argument]
    except (ValueError, KeyError, SyntaxError, AttributeError, TypeError):
        return NO_DEFAULT
    if parameter.default is inspect.Parameter.empty:
        return NO_DEFAULT
    return parameter.default
