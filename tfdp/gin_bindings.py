"""Gin bindings read from a config text, with macros resolved and names made canonical.

Gin prints a config (`gin.config_str()`, `gin.operative_config_str()`, the
text a checkpoint keeps) with the shortest unambiguous names
(`build_optimizer.learning_rate`) and macros unresolved
(`tfdp.OptimizationConfig.num_steps = %NUM_STEPS`). Two texts that set the same
values can therefore differ line by line, and two that differ only in a
macro's value can look alike. This module parses such a text with gin's own
parser and returns one value per setting, keyed by the configurable's full
name (`tfdp.training.build_optimizer`) and argument, with every macro
replaced by its value, so that settings can be compared (`tfdp.resume_rule`)
and traced to what calls them (`tfdp.main`).

It also holds which arguments of a configurable each of its branches reads
(`declare_branches`: `build_optimizer` reads `beta_1` only for Adam), so
that a bound argument the run's branch would not read is found before the
run starts (`unread_arguments`).

Pure Python over gin; no TensorFlow.
"""

import dataclasses
import inspect
import re
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
        if not statement.arg_name:  # `NAME = value` (or `scope/NAME = value`): a macro
            name = f"{statement.scope}/{statement.selector}" if statement.scope else (
                statement.selector)
            macros[name] = statement.value
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


@dataclasses.dataclass(frozen=True)
class Branches:
    """Which arguments of `configurable` each value of `setting` reads (`declare_branches`)."""

    configurable: str
    setting: Tuple[str, str]
    what: str
    reads: Dict[object, Tuple[str, ...]]

    def readers(self, argument):
        """The values of `setting` under which `argument` is read."""
        return [value for value, arguments in self.reads.items() if argument in arguments]

    def conditional(self, argument):
        """Whether `argument` is read under some values of `setting` but not all."""
        readers = self.readers(argument)
        return bool(readers) and len(readers) < len(self.reads)


_BRANCHES: Dict[str, list] = {}  # configurable -> [Branches], one per setting


def declare_branches(configurable: str, *, setting, what: str, reads) -> None:
    """Declares which of `configurable`'s arguments each value of `setting` reads.

    An argument named under some values of `setting` is read only under
    those; a binding of it while `setting` has another value (or a value
    not in `reads`, such as None) is an argument the run would drop
    (`unread_arguments`). Arguments named under no value, and `setting`
    itself, are not concerned.

    Args:
      configurable: the full name, e.g. "tfdp.training.build_optimizer".
      setting: `(configurable, argument)` whose value picks the branch, e.g.
        ("tfdp.training.build_optimizer", "name"); its default applies when
        it is not bound.
      what: what `setting` picks, for messages: "optimizer".
      reads: {value of `setting`: the arguments of `configurable` it reads}.
    """
    tables = [b for b in _BRANCHES.get(configurable, []) if b.setting != tuple(setting)]
    _BRANCHES[configurable] = tables + [Branches(
        configurable, tuple(setting), what,
        {value: tuple(args) for value, args in reads.items()})]


def _listed(values):
    """"'adam' or 'adamw'"."""
    texts = [repr(v) for v in values]
    return texts[0] if len(texts) == 1 else f"{', '.join(texts[:-1])} or {texts[-1]}"


def _branch_value(setting, scope, bindings):
    """(value, bound) of `setting` under `scope` in `bindings`, else its default (NO_DEFAULT)."""
    for key in ((f"{scope}/{setting[0]}", setting[1]) if scope else None, setting):
        if key is not None and key in bindings:
            return bindings[key], True
    return default_value(setting), False


# The bindings of the gin files that this run's --gin_param made unread (set by
# `tfdp.main`); operative_config.gin lists them as not read.
NOT_READ = []


def unread_arguments(config_text: str, files_text: str = None):
    """The bound arguments that their configurable's branch would not read.

    For each binding of an argument that a `declare_branches` table reads
    only under some values of its setting, the setting's value (bound, or
    the default) is looked up, macros resolved; if it does not read the
    argument, the binding is returned. Defaults that nothing binds are not
    concerned.

    A binding of the gin files alone, made unread by a --gin_param that
    changed the setting (gin cannot unbind the files' value), is returned
    apart, as `switched`: the caller says so rather than refusing.

    Args:
      config_text: `gin.config_str()` of the whole config.
      files_text: `gin.config_str()` of the gin files alone (before the
        --gin_param bindings), or None (every binding counts as refused).

    Returns:
      `(refused, switched)`: two lists of texts, one per binding, e.g.
      "tfdp.training.build_optimizer.beta_1 = 0.5: beta_1 is read only by
      the optimizer 'adam' or 'adamw', and this run's optimizer is
      'momentum' (tfdp.training.build_optimizer.name); remove the binding,
      or set tfdp.training.build_optimizer.name to 'adam' or 'adamw'".
    """
    bindings = resolved(config_text)
    files = resolved(files_text) if files_text else {}
    refused, switched = [], []
    for (selector, argument), value in sorted(bindings.items(), key=str):
        scope, _, configurable = selector.rpartition("/")
        for branches in _BRANCHES.get(configurable, ()):
            if branches.conditional(argument):
                _check_read(branches, scope, selector, argument, value, bindings, files,
                            refused, switched)
    return refused, switched


def _check_read(branches, scope, selector, argument, value, bindings, files, refused,
                switched):
    """`unread_arguments` for one binding and one table: appends to refused or switched."""
    readers = branches.readers(argument)
    chosen, bound = _branch_value(branches.setting, scope, bindings)
    if chosen is NO_DEFAULT or any(chosen == v and type(chosen) is type(v) for v in readers):
        return
    setting = setting_name(branches.setting)
    binding = f"{setting_name((selector, argument))} = {value!r}"
    why = (f"{argument} is read only by the {branches.what} {_listed(readers)}, and this "
           f"run's {branches.what} is {chosen!r} ({setting}"
           f"{'' if bound else ', not bound: its default'})")
    in_files = (selector, argument) in files and files[(selector, argument)] == value
    before, _ = _branch_value(branches.setting, scope, files)
    if in_files and any(before == v and type(before) is type(v) for v in readers):
        switched.append(f"A --gin_param chose the {branches.what} {chosen!r} ({setting}), "
                        f"so the config's {binding} is not read: {why}")
    else:
        refused.append(f"{binding}: {why}; remove the binding, or set {setting} to "
                       f"{_listed(readers)}" + (
                           f" (a binding of an included config, which gin cannot unbind, "
                           f"is accepted with a warning when --gin_param chooses the "
                           f"{branches.what})" if in_files else ""))


def error_message(error: BaseException) -> str:
    """The user-facing text of an error: gin's "In call to configurable" lines removed."""
    return re.sub(r"\n\s*In call to configurable [^\n]*", "", str(error)).strip()
