r"""Entry point: `python -m tfdp.main --gin_file=NAME.gin --workdir=DIR`.

The ONLY place gin is parsed. `--gin_file` is repeatable and later files
override earlier ones; a name without a directory is looked up in the working
directory and then in the configs shipped with tfdp (the repository's `gin/`
folder, shipped as the package data `tfdp/gin_configs`), so

  python -m tfdp.main --gin_file=fashion_mnist.gin --workdir=/tmp/fmnist
  python -m tfdp.main --gin_file=fashion_mnist.gin --gin_file=smoke.gin \
      --gin_param='NUM_STEPS=10' --workdir=/tmp/smoke

work from any directory.
"""

import contextlib
import difflib
import importlib.resources
import logging as std_logging
import math
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from tfdp import host

# Before anything imports TensorFlow, which reads TF_ENABLE_ONEDNN_OPTS at import
# (`import tfdp` has already done it; this says so where the trainer starts).
host.enable_onednn()

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin config file(s), in order; a bare name "
                          "is looked up in tfdp's gin/ folder.")
flags.DEFINE_multi_string("gin_param", [], "Gin bindings applied after the files, "
                          "e.g. --gin_param=NUM_STEPS=100.")
flags.DEFINE_string("workdir", None, "Where checkpoints, metrics, the privacy report and "
                    "the exported SavedModel are written.")


class ConfigError(ValueError):
    """A gin file that cannot be found, or bindings that do not parse."""


def shipped_gin_configs() -> dict:
    """Maps each shipped config name (e.g. 'fashion_mnist.gin') to its path."""
    folder = importlib.resources.files("tfdp") / "gin_configs"
    return {p.name: str(p) for p in folder.iterdir() if p.name.endswith(".gin")}


def resolve_gin_file(name: str) -> str:
    """Finds a gin file: as given, else among the configs shipped with tfdp.

    Raises:
      ConfigError: if it is found in neither place; the message lists the
        shipped configs.
    """
    if os.path.isfile(name):
        return name
    shipped = shipped_gin_configs()
    if os.path.dirname(name) == "" and name in shipped:
        return shipped[name]
    available = ", ".join(sorted(shipped)) or "(none)"
    raise ConfigError(
        f"Gin file {name!r} not found (looked in the working directory and in tfdp's "
        f"gin/ folder). Available configs: {available}."
    )


def parse_config(gin_files, gin_params, *, refuse_repeats=False):
    """Parses the gin files then the bindings, after registering tfdp's configurables.

    Raises:
      ConfigError: on an unknown file (also one a config includes), a
        binding gin cannot parse (an unclosed bracket names its file or
        --gin_param), or a macro the config uses but leaves unset (a required
        macro: the message names the --gin_param to add); a --gin_param that
        is no binding or holds an inf or NaN, or (with `refuse_repeats`, the
        command line's own flags) sets a name twice.
    """
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import experiment  # registers the configurables  # noqa: F401

    if not gin_files:
        raise ConfigError(
            "No --gin_file given. Pass one, e.g. --gin_file=fashion_mnist.gin. "
            f"Available configs: {', '.join(sorted(shipped_gin_configs()))}."
        )
    paths = [resolve_gin_file(f) for f in gin_files]
    _check_params(gin_params, refuse_repeats=refuse_repeats)  # tfdp's configurables registered
    # `include 'NAME.gin'` inside a config also resolves among the shipped ones.
    gin.add_config_file_search_path(str(importlib.resources.files("tfdp") / "gin_configs"))
    import tokenize  # pylint: disable=g-import-not-at-top

    try:
        with _quiet_include_lookup():
            # The files first, then the bindings: what the files alone bind tells an
            # overridden macro from a misspelt one (`_check_macros_are_used`).
            gin.parse_config_files_and_bindings(paths, [], finalize_config=False)
            files_config = gin.config_str(max_line_length=100_000)
            gin.parse_config_files_and_bindings([], gin_params)
    except tokenize.TokenError as e:
        # Gin's tokenizer names neither the file nor the binding.
        raise ConfigError(
            f"Could not parse the gin config: {_unclosed(paths, gin_params)}: {e.args[0]} "
            "(an unclosed '(', '[', '{' or string?).") from None
    except (ValueError, KeyError, SyntaxError, ImportError, OSError) as e:
        _refuse_moved_setting(e)
        unset = re.findall(r"No bindings specified for '([A-Za-z_][A-Za-z0-9_]*)/gin\.macro'",
                           str(e))
        if unset:
            # A required macro (e.g. PRETRAINED_BACKBONE) that the config leaves to the user.
            raise ConfigError(
                f"The config needs a value for gin macro {unset[0]}, which it leaves for you "
                f"to set (see the comment in the config): add --gin_param='{unset[0]}=...', "
                f"e.g. --gin_param='{unset[0]}=\"/path/to/it\"' for a path (strings in "
                "double quotes).") from None
        # OSError: an `include` of a file gin cannot find.
        raise ConfigError(f"Could not parse the gin config {paths} {gin_params}: {e}") from e
    _check_macros_are_used(files_config, gin_params)
    _check_bindings_are_called()
    _check_arguments_are_read(files_config)
    return paths


_BINDING = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*(?:/[A-Za-z_][A-Za-z0-9_.]*)*)\s*=(.*)$",
                      re.DOTALL)


def _check_params(gin_params, *, refuse_repeats=False):
    """Refuses a --gin_param that is no binding, has no gin value, an inf or NaN, or repeats one.

    `refuse_repeats`: the command line's own --gin_param flags, where a name
    given twice is a mistake (a caller's list may override its own defaults).

    Raises:
      ConfigError: naming the --gin_param and what to give instead.
    """
    import tokenize  # pylint: disable=g-import-not-at-top

    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    seen = {}
    for param in gin_params:
        match = _BINDING.match(param)
        if match is None:
            raise ConfigError(
                f"--gin_param={param!r} is not a binding: give NAME=VALUE (a macro, "
                "NUM_STEPS=100) or configurable.parameter=VALUE (tfdp.OptimizationConfig."
                "num_steps=100). Imports and includes belong in a gin file (--gin_file).")
        name, text = match.group(1), match.group(2).strip()
        try:
            value = gin.config.parse_value(text)
        except tokenize.TokenError:
            value = None  # an unclosed bracket: the parse below names it
        except ValueError as e:
            if "No configurable matching" not in str(e):
                raise ConfigError(f"--gin_param={param!r}: {e}") from None
            value = None  # `@name` of a configurable a gin file's import registers: parsed below
        except SyntaxError as e:
            raise ConfigError(
                f"--gin_param={param!r}: {text!r} is not a gin value ({e.args[0] if e.args else e}"
                "). Give a number, True/False/None, a string in quotes, a list, a dict, or "
                "@a.configurable.") from None
        if not all(math.isfinite(number) for number in gin_bindings.found(value, float)):
            raise ConfigError(
                f"--gin_param={param!r}: {name} must be a finite number ({text} is read as "
                f"{value!r}). Give a finite value.")
        if name in seen and refuse_repeats:
            raise ConfigError(
                f"--gin_param sets {name} twice ({seen[name]!r} and {param!r}); the second "
                "would silently win. Give it once.")
        seen[name] = param


# gin's refusal of an argument the trainer no longer takes, e.g. an older layout's
# `tfdp.train_and_evaluate.batch_size` (its "In file ..., line N" lines follow).
_UNKNOWN_TRAINER_ARGUMENT = re.compile(
    r"Configurable '(?:[\w.]*\.)?train_and_evaluate' doesn't have a parameter named '(\w+)'\.?")


def _refuse_moved_setting(error):
    """Raises ConfigError naming the new home of a setting gin refused on the trainer, if one.

    The settings that were arguments of `tfdp.train_and_evaluate` live in the
    config objects (`tfdp.configs.MOVED`). Gin refuses the old name as an
    unknown parameter, naming the file and line (or the --gin_param); this adds
    where the setting lives now.
    """
    from tfdp import configs  # pylint: disable=g-import-not-at-top

    match = _UNKNOWN_TRAINER_ARGUMENT.search(str(error))
    if match and match.group(1) in configs.MOVED:
        where = str(error)[match.end():].strip().replace("In bindings string",
                                                         "In the --gin_param bindings,")
        raise ConfigError(configs.moved_setting_error(match.group(1), where)) from None


def _unclosed(paths, gin_params):
    """Which gin file or --gin_param does not tokenize (an unclosed bracket), as text."""
    import io  # pylint: disable=g-import-not-at-top
    import tokenize  # pylint: disable=g-import-not-at-top

    def broken(text):
        try:
            for _ in tokenize.generate_tokens(io.StringIO(text).readline):
                pass
        except tokenize.TokenError:
            return True
        return False

    for path in paths:
        with open(path) as f:
            if broken(f.read()):
                return f"gin file {path}"
    for param in gin_params:
        if broken(param):
            return f"--gin_param={param!r}"
    return f"one of {paths} (or a file they include) or {gin_params}"


class _IncludeLookupFilter(std_logging.Filter):
    """Drops gin's "Path not found: NAME.gin" (logged at ERROR on the root logger).

    Gin first looks an `include 'NAME.gin'` up as a Python package resource
    and logs that error when it is not one, then finds the file on the
    search path: the message is wrong, and a missing file still fails
    (`ConfigError`).
    """

    def filter(self, record):
        return not record.getMessage().startswith("Path not found: ")


@contextlib.contextmanager
def _quiet_include_lookup():
    root = std_logging.getLogger()
    quiet = _IncludeLookupFilter()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def _check_macros_are_used(files_config="", gin_params=()):
    """Refuses a gin macro that no binding uses, e.g. a misspelt `NOISE_MULTIPLYER = 1.0`.

    Gin accepts any `NAME = value` as a macro, so a typo in a macro name would
    otherwise train with the config's own value, silently. Macros and their
    uses are read from the parsed config (`gin.config_str`, `tfdp.gin_bindings.parse`).

    A macro of the files that a `--gin_param` binding made unused is not a
    typo: `--gin_param=tfdp.OptimizationConfig.num_steps=3` replaces the
    config's `num_steps = %NUM_STEPS`. It is accepted, and a warning says
    which binding overrides which macro (the value the trainer, the sampler
    and the accountant all read is the binding's).

    Args:
      files_config: `gin.config_str()` of the gin files alone, before the
        --gin_param bindings.
      gin_params: the --gin_param bindings.

    Raises:
      ConfigError: naming each unused macro and the closest used one.
    """
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    macros, bindings = gin_bindings.parse(gin.config_str(max_line_length=100_000))
    used = {name for value in [*macros.values(), *bindings.values()]
            for name in gin_bindings.macro_uses(value)}
    unused = sorted(set(macros) - used)
    overridden = _overridden_macros(unused, files_config, gin_params)
    conflicts = []
    for name, (value, bindings, set_by_param) in overridden.items():
        overrides = " and ".join(f"'{b}'" for b in bindings)
        if set_by_param:
            conflicts.append(
                f"{name} = {value!r} is set by --gin_param, but --gin_param {overrides} "
                f"replaced the binding that used {name}, so {name} would not be used")
            continue
        logging.warning(
            "--gin_param %s overrides the config's macro %s = %r: the trainer, the sampler and "
            "the accountant all read the binding's value, and %s is not used.",
            overrides, name, value, name)
    if conflicts:
        raise ConfigError("; ".join(conflicts) + ". Give only one of the two (the macro sets "
                          "every binding that uses it).")
    unused = [name for name in unused if name not in overridden]
    if unused:
        hints = []
        for name in unused:
            close = difflib.get_close_matches(name, sorted(used), n=1)
            hints.append(f"{name}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise ConfigError(
            f"Gin macro(s) set but used by no binding: {', '.join(hints)}. A misspelt macro "
            "would leave the config's own value in place. Valid macros here: "
            f"{', '.join(sorted(used))}.")


def _overridden_macros(unused, files_config, gin_params):
    """{macro: (value, [the --gin_param bindings in its place], set by a --gin_param)}.

    Among the `unused` macros, those that the files alone used and whose every
    use a --gin_param rebound.
    """
    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    if not unused or not files_config:
        return {}
    try:
        file_macros, file_bindings = gin_bindings.parse(files_config)
        param_statements = [gin_bindings.parse(param) for param in gin_params]
    except (ValueError, SyntaxError):
        return {}
    set_by_params = {name: value for macros, _ in param_statements
                     for name, value in macros.items()}
    found = {}
    for name in unused:
        users = {key for key, value in file_bindings.items()
                 if name in gin_bindings.macro_uses(value)}
        rebound = [f"{gin_bindings.setting_name(key)} = {bindings[key]!r}"
                   for _, bindings in param_statements for key in bindings if key in users]
        if users and rebound:
            found[name] = (set_by_params.get(name, file_macros.get(name)), rebound,
                           name in set_by_params)
    return found


# Configurables that train_and_evaluate calls itself, not through a binding's `@reference`.
# The config objects (`tfdp.configs`) are built by the trainer from their bindings; a
# non-private run's tfdp.PrivacyConfig bindings are listed as not used (`tfdp.modes`).
_CALLED_BY = {"tfdp.train_and_evaluate": (
    "tfdp.training.make_strategy", "tfdp.data.open_split", "tfdp.DataConfig",
    "tfdp.AugmentationConfig", "tfdp.PrivacyConfig", "tfdp.OptimizationConfig",
    "tfdp.EvaluationConfig", "tfdp.RuntimeConfig")}
_ROOT = "tfdp.train_and_evaluate"


def _check_bindings_are_called():
    """Refuses bindings of configurables that the run never calls, before anything runs.

    Gin accepts a binding of any registered configurable, and one that is
    never called is silently ignored: `tfdp.models.build_wide_resnet.depth =
    40` on a config whose model_fn is the Tramer CNN trained the CNN and said
    nothing. The configurables a run calls are `train_and_evaluate`, what it
    calls itself (`make_strategy`, `open_split`), and every configurable that a binding of a
    called one references (`@tfdp.models.build_tramer_cnn`), transitively,
    macros resolved. These are exactly the configurables that gin's operative
    config lists after the run (tests/configs_test.py checks this on every
    shipped config), but they are known before any I/O.

    Raises:
      ConfigError: naming each binding of a configurable that is not called,
        and the configurables that are.
    """
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    macros, bindings = gin_bindings.parse(gin.config_str(max_line_length=100_000))
    called, queue = set(), [_ROOT]
    while queue:
        selector = queue.pop()
        if selector in called:
            continue
        called.add(selector)
        queue.extend(_CALLED_BY.get(selector.rpartition("/")[2], ()))
        unscoped = selector.rpartition("/")[2]
        for (bound, _), value in bindings.items():
            if bound in (selector, unscoped):
                queue.extend(ref.name for ref in gin_bindings.references(
                    gin_bindings.resolve(value, macros)))
    called_names = called | {name.rpartition("/")[2] for name in called}
    uncalled = sorted(f"{gin_bindings.setting_name(key)} = {value!r}"
                      for key, value in bindings.items() if key[0] not in called_names)
    if uncalled:
        raise ConfigError(
            f"Gin binding(s) of a function this run never calls: {'; '.join(uncalled)}. "
            "Gin would ignore them and train without them. This run calls "
            f"{', '.join(sorted(called))}. Remove the binding, or make the run call that "
            "function (e.g. tfdp.train_and_evaluate.model_fn = @tfdp.models.build_wide_resnet "
            "to train a WRN).")


def _check_arguments_are_read(files_config=""):
    """Refuses a bound argument that the run's branch of its function would not read.

    `build_optimizer.beta_1` is read only by Adam, `momentum` only by the "momentum"
    optimizer, `make_strategy.tpu` only under the TPU strategy, `augmentation_kwargs` only
    with an augmentation (`tfdp.gin_bindings.declare_branches`); gin would pass such a
    value, the run would drop it, and operative_config.gin would list it. A value of the
    gin files that a --gin_param made unread by choosing another branch (gin cannot unbind
    it) is accepted, with a warning that names it.

    Raises:
      ConfigError: naming each binding, the branch that reads it, the run's branch, and
        the fix.
    """
    import gin  # pylint: disable=g-import-not-at-top

    from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

    refused, switched = gin_bindings.unread_arguments(gin.config_str(max_line_length=100_000),
                                                      files_config or None)
    gin_bindings.NOT_READ[:] = switched  # operative_config.gin says so, at its top
    for text in switched:
        logging.warning("%s. The run ignores it.", text)
    if refused:
        raise ConfigError(
            f"Gin binding(s) of an argument this run would not read: {'; '.join(refused)}. "
            "Gin would pass the value, the run would drop it, and operative_config.gin would "
            "still list it.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required: where the run's outputs go.")
    try:
        parse_config(FLAGS.gin_file, FLAGS.gin_param, refuse_repeats=True)
        from tfdp import experiment  # pylint: disable=g-import-not-at-top

        experiment.train_and_evaluate(workdir=FLAGS.workdir)
    except (ConfigError, ValueError, FileNotFoundError, FloatingPointError) as e:
        # A clear error, printed once, with no traceback from deep inside TF (a
        # FloatingPointError: tfdp.dp.noise.NonFiniteRelease, training stopped).
        from tfdp import gin_bindings  # pylint: disable=g-import-not-at-top

        print(f"tfdp: error: {gin_bindings.error_message(e)}", file=sys.stderr)
        sys.exit(2)
    exit_now(0)


def exit_now(status):
    """Ends a run whose work is done and written: flushes the logs, then `os._exit(status)`.

    What otherwise runs after "Done:" is Python's interpreter finalization:
    its cyclic garbage collector walks and frees the whole TensorFlow heap
    (the traced tf.function graphs, `TF_DeleteGraph` and their shape
    refiners; the tf.data iterators, whose destructors wait for their
    threads). On this project's 2-core machine that took from 1 s to 100 s,
    at full CPU, depending on the order in which the garbage was found
    (docs/design/workdir_protocol.md, "The exit"). Everything the run promises is on
    disk by then: checkpoints and the export are written synchronously,
    metrics.jsonl and the reports are closed, FINISHED is fsync'ed, the lock
    released, TensorBoard's writers closed. So the process ends here, every
    time within a moment of FINISHED.

    Under `multi_worker_mirrored` (TF_CONFIG set) the process exits normally
    instead: TensorFlow's coordination service may hold the workers at a
    shutdown barrier, which an immediate exit would skip.
    """
    if os.environ.get("TF_CONFIG"):
        return
    logging.flush()
    loggers = [std_logging.getLogger(), *std_logging.Logger.manager.loggerDict.values()]
    for handler in {h for logger in loggers for h in getattr(logger, "handlers", ())}:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)  # pylint: disable=protected-access


def run():
    app.run(main)


if __name__ == "__main__":
    run()
