"""The CPU host a run is on, and TensorFlow's oneDNN kernels (on by default with tfdp).

TensorFlow reads `TF_ENABLE_ONEDNN_OPTS` only at its import, and unset it leaves oneDNN off on
AVX2-only CPUs, where tfdp's DP step then runs at half speed: so `import tfdp` sets it to 1 first.
`enable_onednn()` does that, unless the user set the variable; `python -m tfdp.main` and the
tools and benchmarks that train call it too. The rule, TensorFlow's source and the measurements:
docs/design/dp_step.md ("oneDNN on, on every host").

`describe_host()` is the one-line host description that the run log and the
benchmarks' headers print: the CPU's vector flags and whether oneDNN is on,
and why. Every absolute time tfdp quotes names it.

This module does not import TensorFlow (it must run before TensorFlow's import).
"""

import logging
import os
import sys

ENV_VAR = "TF_ENABLE_ONEDNN_OPTS"
# Set next to ENV_VAR when tfdp sets it, so that a child process (which inherits
# both) still says that tfdp, not the user, chose. A script that sets ENV_VAR for
# a child itself removes it.
SET_BY_TFDP_VAR = "TFDP_SET_TF_ENABLE_ONEDNN_OPTS"
# CPU flags (as /proc/cpuinfo spells them) for which TensorFlow's Linux default is on:
# AVX512_VNNI, AVX512_BF16, AVX_VNNI, AMX_TILE, AMX_INT8, AMX_BF16 in DefaultOneDnnPolicy.
TF_DEFAULT_ON_FLAGS = ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
                       "amx_bf16")
_SHOWN_FLAGS = ("avx2", "fma", "avx512f", *TF_DEFAULT_ON_FLAGS)

_decision = None  # (on: bool | None, why: str), set once by enable_onednn()
_logger = logging.getLogger(__name__)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags, as Linux's /proc/cpuinfo (and `lscpu`) spell them.

    Returns:
      A frozenset of lower-case flag names (e.g. {"avx2", "fma", "avx512f", ...});
      empty where `cpuinfo` cannot be read (not Linux).
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_class(flags) -> str:
    """'AVX-512', 'AVX2', 'no AVX2', or 'CPU flags unknown' (when `flags` is empty)."""
    if not flags:
        return "CPU flags unknown"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "no AVX2"


def tf_default_onednn(flags):
    """TensorFlow 2.21's oneDNN default on Linux x86 for a CPU with `flags`.

    Returns:
      True or False; None when `flags` is empty or the platform is not Linux
      (TensorFlow's rule differs there).
    """
    if not flags or not sys.platform.startswith("linux"):
        return None
    return any(flag in flags for flag in TF_DEFAULT_ON_FLAGS)


def _parse_env(value):
    """TensorFlow's reading of the variable (ReadBoolFromEnvVar): True, False or None (invalid)."""
    value = value.lower()
    if value in ("0", "false"):
        return False
    if value in ("1", "true"):
        return True
    return None


def _predicted_onednn(flags):
    """Whether a TensorFlow imported now, with this environment, turns oneDNN on (or None)."""
    value = os.environ.get(ENV_VAR)
    parsed = None if value is None else _parse_env(value)
    return tf_default_onednn(flags) if parsed is None else parsed


def _on_off(on):
    return {True: "on", False: "off", None: "unknown"}[on]


def enable_onednn() -> str:
    """Turns TensorFlow's oneDNN kernels on, if it is not too late and the user did not choose.

    - `TF_ENABLE_ONEDNN_OPTS` set by the user (any value, `0` included): left
      as it is.
    - Unset, and TensorFlow not yet imported: set to `1` (TensorFlow reads it at
      import).
    - TensorFlow already imported: nothing can change now; if oneDNN is off
      and the user did not ask for that, logs a warning that says how to turn
      it on.

    Idempotent: the first call decides; later calls return the same text.

    Returns:
      One line: oneDNN on or off, and why, e.g. "oneDNN on (tfdp set
      TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow's import; TensorFlow's own
      default on this CPU: off)".
    """
    global _decision
    if _decision is not None:
        return _describe_decision()
    flags = cpu_flags()
    default = _on_off(tf_default_onednn(flags))
    value = os.environ.get(ENV_VAR)
    set_by_tfdp = value is not None and os.environ.get(SET_BY_TFDP_VAR) == value
    if "tensorflow" in sys.modules:
        on = onednn_enabled()
        if value is None or set_by_tfdp:
            why = ("TensorFlow was imported before tfdp, with its own default on this CPU: "
                   f"{default}")
        else:
            why = f"TensorFlow was imported before tfdp, with {ENV_VAR}={value} set by the user"
        if on is False and (value is None or set_by_tfdp):
            _logger.warning(
                "TensorFlow's oneDNN kernels are off: TensorFlow was imported before tfdp, on a "
                "%s CPU where its default is off. tfdp's training step runs up to 2x faster with "
                "them on: set the environment variable %s=1 before TensorFlow is imported (or "
                "import tfdp first).", cpu_class(flags), ENV_VAR)
    elif value is None:
        os.environ[ENV_VAR] = os.environ[SET_BY_TFDP_VAR] = "1"
        on = True
        why = (f"tfdp set {ENV_VAR}=1 before TensorFlow's import; TensorFlow's own default on "
               f"this CPU: {default}")
    elif set_by_tfdp:
        on = _parse_env(value)
        why = f"{ENV_VAR}={value} set by tfdp in a parent process"
    else:
        parsed = _parse_env(value)
        on = _predicted_onednn(flags)
        why = f"{ENV_VAR}={value} set by the user"
        if parsed is None:
            why += (" (not 0, 1, true or false: TensorFlow ignores it and uses its default on "
                    f"this CPU, {default})")
    _decision = (on, why)
    return _describe_decision()


def _describe_decision():
    on, why = _decision
    if "tensorflow" in sys.modules:
        on = onednn_enabled()  # TensorFlow's own answer, once it is imported
    return f"oneDNN {_on_off(on)} ({why})"


def onednn_enabled():
    """Whether TensorFlow's oneDNN kernels are on in this process.

    Once TensorFlow is imported, TensorFlow's own answer (`IsMklEnabled`, through
    `tensorflow.python.util._pywrap_util_port`, a private module: where it is
    missing, the prediction below). Before, a prediction from the environment
    and the CPU flags, by TensorFlow's rule (module docstring). Never imports
    TensorFlow.

    Returns:
      True, False, or None when it cannot be told (not Linux, flags unknown).
    """
    if "tensorflow" in sys.modules:
        try:
            # pylint: disable-next=g-import-not-at-top
            from tensorflow.python.util import _pywrap_util_port

            return bool(_pywrap_util_port.IsMklEnabled())
        except (ImportError, AttributeError):
            pass
    return _predicted_onednn(cpu_flags())


def describe_host() -> str:
    """One line naming the CPU's vector flags, its cores, and oneDNN on or off and why.

    E.g. "host: AVX-512 CPU (AMD EPYC; avx2 fma avx512f avx512_vnni avx512_bf16
    avx_vnni, no amx), 2 cores; oneDNN on (tfdp set TF_ENABLE_ONEDNN_OPTS=1 ...)".
    Calls `enable_onednn()` if nothing has (so it may set the variable).
    """
    flags = cpu_flags()
    shown = " ".join(flag for flag in _SHOWN_FLAGS if flag in flags)
    if flags and not any(flag.startswith("amx") for flag in flags):
        shown += ", no amx"
    details = "; ".join(part for part in (_cpu_model(), shown) if part)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count()
    return (f"host: {cpu_class(flags)} CPU" + (f" ({details})" if details else "")
            + f", {cores} cores; {enable_onednn()}")


def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return ""
