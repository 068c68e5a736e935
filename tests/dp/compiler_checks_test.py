"""What the process was told before tfdp looked, and a release that is never non-finite.

- XLA's fast math through a flag file (`XLA_FLAGS=/path`), and through a
  variable removed from `os.environ` after XLA read it: refused before any
  step, by the settings and by XLA's observed behaviour;
- oneDNN's bf16 fpmath mode through its legacy spelling, and kept after the
  variable is removed: planned for (bf16, kappa 1e-2 on the privacy card);
- with the refusal bypassed and XLA told to drop NaN handling, one example
  with a NaN feature: the update is not released (the model's state stays
  finite and training stops), on the ghost and the vectorized path;
- the bit-level finiteness test that no float setting can fold, fuzzed.
"""

import os
import subprocess
import sys
import textwrap

import hypothesis
import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import strategies as st

from tfdp import accounting
from tfdp import process_settings
from tfdp.dp import compiler_checks
from tfdp.dp import noise
from tfdp.dp import device_arithmetic
from tfdp.dp import precision
from tfdp.training.dp_model import DPModel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST_MATH_WITHOUT_NANS = ("--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false "
                          "--xla_cpu_fast_math_honor_infs=false\n")


def _python(code, **env_vars):
    """Runs `code` in a fresh interpreter with `env_vars` in its starting environment."""
    env = {k: v for k, v in os.environ.items() if k not in process_settings.WATCHED}
    env.update(env_vars)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, env=env, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


# -- What XLA reads, read as XLA reads it -------------------------------------------------


def test_xla_flags_are_split_as_xla_splits_them():
    text = ' --a=1\t--b="two words" --c=\'x\\y\' --d\nstop --e'
    assert process_settings.split_xla_flags(text) == ["--a=1", "--b=two words", "--c=x\\y", "--d"]
    assert process_settings.split_xla_flags("file.txt --a") == []


@pytest.mark.parametrize("text, unsafe", [
    ("--xla_cpu_enable_fast_math", ["--xla_cpu_enable_fast_math"]),
    ("--xla_cpu_enable_fast_math=True", ["--xla_cpu_enable_fast_math=True"]),
    ("--xla_cpu_enable_fast_math=1 --xla_cpu_enable_fast_math=false", []),  # the last wins
    ("--xla_cpu_enable_fast_math=0 --xla_cpu_enable_fast_math", ["--xla_cpu_enable_fast_math"]),
    ("--xla_cpu_enable_fast_math=maybe", []),  # XLA refuses the value
    ("--xla_cpu_fast_math_honor_infs=0", ["--xla_cpu_fast_math_honor_infs=0"]),
    ("--xla_gpu_enable_fast_min_max", ["--xla_gpu_enable_fast_min_max"]),
    ("--xla_cpu_fast_math_honor_nans", []),  # honouring NaNs is safe
])
def test_unsafe_flags_follow_xla_s_boolean_parse(text, unsafe):
    assert process_settings.unsafe_xla_flags(text) == unsafe


def test_an_unreadable_flag_file_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", str(tmp_path / "missing.flags"))
    with pytest.raises(compiler_checks.FastMath, match="file of flags.*cannot be read"):
        compiler_checks.refuse_fast_math()


def test_a_flag_file_is_read_and_named(monkeypatch, tmp_path):
    path = tmp_path / "xla.flags"
    path.write_text(FAST_MATH_WITHOUT_NANS)
    monkeypatch.setenv("XLA_FLAGS", str(path))
    with pytest.raises(compiler_checks.FastMath) as err:
        compiler_checks.refuse_fast_math()
    assert f"file {path}" in str(err.value) and "honor_nans=false" in str(err.value)


def test_the_environment_the_process_started_with_is_read(tmp_path):
    environ = tmp_path / "environ"
    environ.write_bytes(b"A=1\0XLA_FLAGS=--xla_cpu_enable_fast_math\0EMPTY=\0")
    assert process_settings.exec_environment(str(environ)) == {
        "A": "1", "XLA_FLAGS": "--xla_cpu_enable_fast_math", "EMPTY": ""}
    assert process_settings.exec_environment(str(tmp_path / "none")) is None


def test_xla_removed_after_it_read_its_flags_is_refused_by_what_it_compiles():
    # Set and removed inside the process, after XLA's first compile and before tfdp's
    # import: in no environment tfdp can read, but XLA keeps the flags.
    out = _python("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=true"
        import tensorflow as tf
        tf.function(lambda x: x + 1, jit_compile=True)(tf.constant(1.0))
        del os.environ["XLA_FLAGS"]
        from tfdp.dp import compiler_checks
        try:
            compiler_checks.refuse_fast_math()
            print("accepted")
        except compiler_checks.FastMath as error:
            print(str(error)[:60])
        """)
    assert out == ["XLA's compiled code on CPU does not keep IEEE float semantic"]


def test_xla_without_fast_math_keeps_ieee_semantics():
    assert compiler_checks.observe_xla("CPU") == []  # the probe itself, on this process


# -- oneDNN's fpmath mode, under every spelling and after removal -------------------------


@pytest.mark.parametrize("variable", process_settings.ONEDNN_FPMATH_VARIABLES)
def test_onednn_bf16_fpmath_plans_bf16(monkeypatch, variable):
    monkeypatch.setenv(variable, "BF16")
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    card = precision.clip_margin_record(1.0)
    assert card["device_matmul_inputs"] == "bf16" and card["kappa"] == 1e-2
    monkeypatch.setenv(variable, "strict")  # oneDNN may have read BF16 already: kept
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    process_settings._seen_since_import.pop(variable)  # as in a new process
    assert device_arithmetic.device_inputs() == device_arithmetic.FLOAT32


def test_onednn_mode_set_after_import_and_removed_is_still_planned_for(monkeypatch):
    # oneDNN keeps a mode it read; tfdp, reading os.environ only, forgot it once removed
    # and traced the step again for float32.
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    monkeypatch.delenv("ONEDNN_DEFAULT_FPMATH_MODE")
    assert device_arithmetic.device_inputs() == device_arithmetic.BF16
    assert ("ONEDNN_DEFAULT_FPMATH_MODE", "earlier", "BF16") in (
        process_settings.onednn_fpmath_modes())


@pytest.mark.parametrize("mode", ["F16", "any"])
def test_onednn_float16_modes_are_refused(monkeypatch, mode):
    monkeypatch.setenv("DNNL_DEFAULT_FPMATH_MODE", mode)
    with pytest.raises(device_arithmetic.PrecisionRewrite,
                       match=f"float16.*DNNL_DEFAULT_FPMATH_MODE={mode}"):
        device_arithmetic.refuse_precision_rewrites()


def test_a_cpu_matmul_seen_to_round_plans_for_its_precision(monkeypatch):
    assert compiler_checks.observe_cpu_matmul_bits() == 24  # this process: full float32
    for bits, device in ((8, device_arithmetic.BF16), (11, device_arithmetic.TF32)):
        monkeypatch.setattr(compiler_checks, "_matmul_bits", bits)
        assert device_arithmetic.device_inputs() == device


def test_a_flag_ends_at_a_nul_byte_as_in_xla():
    assert process_settings.unsafe_xla_flags("--xla_cpu_enable_fast_math\0=false") == [
        "--xla_cpu_enable_fast_math"]


def test_onednn_mode_removed_after_the_start_is_still_planned_for():
    out = _python("""
        import os
        del os.environ["ONEDNN_DEFAULT_FPMATH_MODE"]
        from tfdp.dp import device_arithmetic
        from tfdp.dp import precision
        print(device_arithmetic.device_inputs().name, precision.clip_margin_record(1.0)["kappa"])
        """, ONEDNN_DEFAULT_FPMATH_MODE="BF16")
    assert out[-1] == "bf16 0.01"


# -- A release that is never non-finite ---------------------------------------------------


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=16))
def test_bit_level_finiteness_is_ieee_s(patterns):
    x = tf.bitcast(tf.constant(np.array(patterns, np.uint32).view(np.int32)), tf.float32)
    np.testing.assert_array_equal(compiler_checks.is_finite(x).numpy(),
                                  np.isfinite(x.numpy()))
    wide = tf.cast(x, tf.float64)
    np.testing.assert_array_equal(compiler_checks.is_finite(wide).numpy(),
                                  np.isfinite(wide.numpy()))


def test_a_non_finite_update_is_withheld_and_stays_withheld():
    withheld = tf.Variable(0, dtype=tf.int32)
    finite = [tf.ones([2]), tf.fill([3], 2.0)]
    out = noise.finite_release(finite, withheld)
    np.testing.assert_array_equal(out[1].numpy(), [2.0, 2.0, 2.0])
    assert int(withheld.numpy()) == 0
    out = noise.finite_release([tf.ones([2]), tf.constant([1.0, np.nan, np.inf])], withheld)
    assert all(np.all(t.numpy() == 0) for t in out) and int(withheld.numpy()) == 1
    out = noise.finite_release(finite, withheld)  # later updates are withheld too
    assert all(np.all(t.numpy() == 0) for t in out) and int(withheld.numpy()) == 2


def guard_outcomes(clippings=("ghost", "vectorized")):
    """Per clipping path: the outcome of two XLA-compiled steps on a batch with one NaN
    feature ("released" or "stopped"), and whether the model's state stayed finite."""
    lines = []
    for clipping in clippings:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(5, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        mechanism = accounting.DPMechanism(num_examples=1000, batch_size=4, num_steps=10,
                                           noise_multiplier=1e-9, l2_clip_norm=1.0,
                                           delta=1e-5)
        dp = DPModel(model, mechanism, clipping=clipping)
        dp.compile(optimizer=keras.optimizers.SGD(1.0), jit_compile=True)
        x, y = np.ones((4, 4), np.float32), np.array([0, 1, 2, 0])
        x[1, 2] = np.nan  # one example with a missing feature
        outcome = []
        for _ in range(2):
            try:
                dp.train_on_batch(x, y)
                outcome.append("released")
            except noise.NonFiniteRelease:
                outcome.append("stopped")
        state = [v.numpy() for v in dp.trainable_variables]
        lines.append(" ".join([clipping, *outcome,
                               str(all(np.isfinite(s).all() for s in state))]))
    return lines


GUARD_RUN = """
    from tfdp.dp import compiler_checks
    compiler_checks.refuse_fast_math = lambda: None  # the refusal bypassed: the guard alone
    from tests.dp.compiler_checks_test import guard_outcomes
    print(*guard_outcomes(), sep="\\n")
"""


def test_one_nan_example_never_makes_a_release_non_finite(tmp_path):
    # XLA told to drop NaN handling: is_finite(nan) compiles to true, so the example's
    # drop inside the step fails and its NaN reaches the sum (the whole update was NaN).
    path = tmp_path / "xla.flags"
    path.write_text(FAST_MATH_WITHOUT_NANS)
    out = _python(GUARD_RUN, XLA_FLAGS=str(path))
    assert out[-2:] == ["ghost stopped stopped True", "vectorized stopped stopped True"]
    # IEEE semantics (this process, whose XLA keeps them:
    # test_xla_without_fast_math_keeps_ieee_semantics): the NaN example is dropped in the
    # step, and training goes on: the ghost path, the default (the fast-math run above
    # compiles both paths).
    assert guard_outcomes(("ghost",)) == ["ghost released released True"]


def test_a_dtype_policy_changed_after_compile_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    mechanism = accounting.DPMechanism(num_examples=1000, batch_size=2, num_steps=10,
                                       noise_multiplier=1e-9, l2_clip_norm=1.0, delta=1e-5)
    dp = DPModel(model, mechanism)
    dp.compile(optimizer=keras.optimizers.SGD(1.0))
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    dp.train_on_batch(x, y)
    before = [v.numpy() for v in dp.trainable_variables]
    model.layers[-1].dtype_policy = "mixed_bfloat16"
    with pytest.raises(ValueError, match="mixed precision"):
        dp.train_on_batch(x, y)
    for v, b in zip(dp.trainable_variables, before):
        np.testing.assert_array_equal(v.numpy(), b)
