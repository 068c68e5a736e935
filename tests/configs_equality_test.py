"""Moving the settings into config objects changed no run: every shipped config plans the same.

For every shipped config, as shipped, with static batches ("auto") and
without privacy, the plan the trainer builds today (its `DPMechanism`, or
its `NonPrivatePlan`) equals the one the trainer built before the settings
moved from `tfdp.train_and_evaluate`'s arguments into `tfdp.configs`
(recorded by `tests/config_plans.py` from commit 75f03e8, the last of the
old layout; its docstring has the command). Both are the trainer's own
plans, stopped at the end of planning.
"""

import importlib.util
import json
import os

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "config_plans", os.path.join(os.path.dirname(__file__), "config_plans.py"))
config_plans = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(config_plans)

BEFORE = os.path.join(os.path.dirname(__file__), "golden", "plans_before_config_objects.json")


def _before():
    with open(BEFORE) as f:
        return json.load(f)


CONFIGS = sorted({name.split(" ")[0] for name in _before()})
# Written in the new layout after the migration, so there is no plan of the old code to
# compare with; tests/configs_test.py checks their epsilon and runs them.
ADDED_SINCE = {"fashion_mnist_best.gin"}


def test_every_shipped_config_is_compared():
    before = _before()
    # 46 configs x 3 variants when recorded; a config added since is named in ADDED_SINCE.
    assert len(before) == 138 and len(CONFIGS) == 46
    shipped = {name for name in config_plans.main_module().shipped_gin_configs()
               if not name.startswith("_") and name != "smoke.gin"}
    assert shipped == set(CONFIGS) | ADDED_SINCE and not ADDED_SINCE & set(CONFIGS)


def _plan_param(config):
    # One config of each family plans in the default suite (its eps = 8 file); the family's
    # other epsilons plan under -m slow.
    if "_eps" in config and not config.endswith("_eps8.gin"):
        return pytest.param(config, marks=pytest.mark.slow)
    return config


@pytest.mark.parametrize("config", [_plan_param(c) for c in CONFIGS])
def test_every_config_plans_the_same_mechanism_as_before(config):
    before = {name: plan for name, plan in _before().items() if name.split(" ")[0] == config}
    now = config_plans.plans(only=[config])
    assert set(now) == set(before) and len(now) == 3
    differ = {name: (before[name], now[name]) for name in before if before[name] != now[name]}
    assert not differ, json.dumps(differ, indent=1)[:4000]


def test_the_comparison_sees_a_changed_setting():
    """The comparison is not vacuous: a changed setting of any group changes the plan."""
    before = _before()
    for param, field, value in [("TARGET_DELTA = 2e-5", "delta", 2e-5),
                                ("tfdp.OptimizationConfig.sampling = 'shuffle'", "sampling",
                                 "shuffle"),
                                ("tfdp.PrivacyConfig.normalize_update = True", "normalize_update",
                                 True)]:
        changed = config_plans.plans(only=["fashion_mnist.gin"], extra_params=[param])
        assert changed["fashion_mnist.gin"][field] == value, param
        assert changed["fashion_mnist.gin"] != before["fashion_mnist.gin"], param

