"""What this process was told about float arithmetic, whenever it was told.

XLA and oneDNN read their settings from the environment once, when they
first need them, and keep them for the life of the process: removing a
variable from `os.environ` afterwards hides it from a reader of `os.environ`
but not from them. So tfdp reads every setting that can change what the
device computes from three places, and treats a value seen in any of them as
in force:

| where           | what it holds                                                  |
|-----------------|----------------------------------------------------------------|
| `exec`          | the environment the process started with (`/proc/self/environ`) |
| `import`        | `os.environ` when tfdp was imported (`SNAPSHOT`)                |
| `now`           | `os.environ` now (a oneDNN value read once is kept: `earlier`)  |

A value set and removed again between the process's start and tfdp's import,
or between two of tfdp's reads, is in none of them; `tfdp.dp.compiler_checks` asks XLA itself (a probe of
its behaviour), and oneDNN's mode is planned for from what is seen here
(docs/guarantee.md, "What is checked and what cannot be").

XLA reads `XLA_FLAGS` as XLA does (`xla/parse_flags_from_env.cc`): a value
whose first non-blank character is not `-` names a file of flags; flags are
`--name`, `--name=value` or `--name="quoted value"`, read until the first
word that does not start with `-`; a boolean flag is true when bare or
`=true`/`=1` (any case), false at `=false`/`=0`, and the last one given wins.

This module does not import TensorFlow (`import tfdp` imports it first, to
take `SNAPSHOT` before anything else runs).
"""

import functools
import os
import re
from typing import Dict, List, Optional, Tuple

# The variables whose values tfdp keeps from import time on.
XLA_VARIABLES = ("XLA_FLAGS", "TF_XLA_FLAGS")
# oneDNN's default fpmath mode: its own name, its legacy name, and TensorFlow's.
ONEDNN_FPMATH_VARIABLES = ("ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
                           "TF_SET_ONEDNN_FPMATH_MODE")
WATCHED = XLA_VARIABLES + ONEDNN_FPMATH_VARIABLES

SNAPSHOT: Dict[str, str] = {name: os.environ[name] for name in WATCHED if name in os.environ}

# XLA flags that let the compiler drop IEEE semantics (reassociation, NaN and inf
# handling, NaN-swallowing min/max), with the boolean value that does it.
UNSAFE_XLA_FLAGS = {
    "xla_cpu_enable_fast_math": True,
    "xla_gpu_enable_fast_math": True,
    "xla_cpu_fast_math_honor_nans": False,
    "xla_cpu_fast_math_honor_infs": False,
    "xla_cpu_fast_math_honor_division": False,
    "xla_cpu_fast_math_honor_functions": False,
    "xla_cpu_enable_fast_min_max": True,
    "xla_gpu_enable_fast_min_max": True,
}

_WHITESPACE = " \t\r\n"
_FLAG_CHARS = re.compile(r"[-_A-Za-z0-9]*")


class UnknowableSetting(ValueError):
    """A setting the process may act on cannot be read (a flag file that is not readable)."""


def exec_environment(path: str = "/proc/self/environ") -> Optional[Dict[str, str]]:
    """The environment the process started with, or None where it cannot be read.

    Linux keeps the environment given to `execve` in the process's memory,
    unchanged by later `os.environ` edits (`proc(5)`, "/proc/pid/environ").
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    environment = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            environment[name.decode(errors="replace")] = value.decode(errors="replace")
    return environment


@functools.lru_cache(maxsize=1)
def _started_with() -> Dict[str, str]:
    """`exec_environment()`, read once: it does not change while the process runs."""
    return exec_environment() or {}


_seen_since_import: Dict[str, List[str]] = {}  # name -> values read "now" at any earlier call


def values_seen(name: str) -> List[Tuple[str, str]]:
    """`[(where, value), ...]`: each distinct non-empty value of `name`, with where it was seen.

    `where` is "exec", "import", "now" (module docstring) or, for oneDNN's
    variables, "earlier" (read "now" by an earlier call, since removed:
    oneDNN may have read it meanwhile and kept it), first place first.
    """
    started = _started_with()
    now = os.environ.get(name)
    earlier = _seen_since_import.setdefault(name, [])
    if now and now not in earlier and name in ONEDNN_FPMATH_VARIABLES:
        earlier.append(now)  # XLA's own behaviour is asked instead (`compiler_checks`)
    seen = []
    candidates = [("exec", started.get(name)), ("import", SNAPSHOT.get(name)), ("now", now)]
    candidates += [("earlier", value) for value in earlier]
    for where, value in candidates:
        if value and value not in [v for _, v in seen]:
            seen.append((where, value))
    return seen


def xla_flag_text(value: str) -> str:
    """The flags an `XLA_FLAGS` value gives XLA: the value, or the file it names.

    Raises:
      UnknowableSetting: the value names a file that cannot be read (XLA
        itself stops the process there, if it reads the variable).
    """
    if not value or value.lstrip(_WHITESPACE).startswith("-"):
        return value
    try:
        with open(value, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as error:
        raise UnknowableSetting(
            f"XLA_FLAGS={value!r} does not start with '--', so XLA reads it as the name of a "
            f"file of flags, and that file cannot be read ({error.strerror}): whether it "
            "turns on fast math cannot be checked. Point XLA_FLAGS at a readable file, or "
            "give the flags themselves.") from None


def split_xla_flags(text: str) -> List[str]:
    """The flags XLA reads from `text`, as `--name[=value]` strings, quotes removed.

    A flag ends at a NUL byte, as XLA's copy of it (`strdup`) does.
    """
    return [flag.split("\0", 1)[0] for flag in _split(text)]


def _split(text: str) -> List[str]:
    flags, i = [], len(text) - len(text.lstrip(_WHITESPACE))
    while i < len(text) and text[i] == "-":
        end = _FLAG_CHARS.match(text, i).end()
        if end + 1 < len(text) and text[end] == "=" and text[end + 1] in "'\"":
            quote, j, value = text[end + 1], end + 2, []
            while j < len(text) and text[j] != quote:
                if quote == '"' and text[j] == "\\" and j + 1 < len(text):
                    j += 1
                value.append(text[j])
                j += 1
            flags.append(text[i:end + 1] + "".join(value))
            end = j + 1
        else:
            while end < len(text) and text[end] not in _WHITESPACE:
                end += 1
            flags.append(text[i:end])
        i = end
        while i < len(text) and text[i] in _WHITESPACE:
            i += 1
    return flags


def _bool_value(flag: str, name: str) -> Optional[bool]:
    """The boolean `flag` sets `name` to (XLA's parse), or None if it is not that flag."""
    if not flag.startswith("--" + name):
        return None
    rest = flag[len(name) + 2:]
    if not rest:
        return True
    if not rest.startswith("="):
        return None  # another flag whose name starts with this one
    rest = rest[1:]
    if rest.lower() == "true" or rest == "1":
        return True
    if rest.lower() == "false" or rest == "0":
        return False
    return None  # XLA refuses the value


def unsafe_xla_flags(text: str) -> List[str]:
    """The flags of `text` that leave a float setting of `UNSAFE_XLA_FLAGS` unsafe.

    The last flag given for a name decides, as in XLA.
    """
    final = {}
    for flag in split_xla_flags(text):
        for name in UNSAFE_XLA_FLAGS:
            value = _bool_value(flag, name)
            if value is not None:
                final[name] = (value, flag)
    return [flag for name, (value, flag) in final.items() if value == UNSAFE_XLA_FLAGS[name]]


def unsafe_xla_settings() -> List[str]:
    """`["XLA_FLAGS (exec, file /x): --xla_cpu_enable_fast_math", ...]`, over every value seen.

    Raises:
      UnknowableSetting: a value names a flag file that cannot be read.
    """
    found = []
    for variable in XLA_VARIABLES:
        for where, value in values_seen(variable):
            text = xla_flag_text(value)
            named_file = not value.lstrip(_WHITESPACE).startswith("-")
            source = f"{variable} ({where}" + (f", file {value}" if named_file else "") + ")"
            found += [f"{source}: {flag}" for flag in unsafe_xla_flags(text)]
    return found


# oneDNN fpmath modes whose down-conversion keeps float32's exponent range (bf16, tf32):
# planned for as bf16. F16 and ANY may convert to float16, whose range is not float32's.
ONEDNN_FPMATH_PLANNED = ("BF16", "TF32")


def onednn_fpmath_modes() -> List[Tuple[str, str, str]]:
    """`[(variable, where, value), ...]` for every oneDNN fpmath mode other than STRICT seen."""
    return [(variable, where, value)
            for variable in ONEDNN_FPMATH_VARIABLES
            for where, value in values_seen(variable)
            if value.strip().upper() not in ("", "STRICT")]
