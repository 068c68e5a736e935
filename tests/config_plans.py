"""The plan (`DPMechanism` or `NonPrivatePlan`) that the trainer builds for each shipped config.

`plans()` runs `tfdp.experiment.train_and_evaluate` on each shipped gin
config, from gin's parse to the end of its planning stage, and stops it
there (nothing is read or written): the value compared is what the trainer
itself plans, not a re-derivation. `tests/configs_equality_test.py` compares
today's plans with `tests/golden/plans_before_config_objects.json`, which this
script wrote from the code before the settings moved into config objects:

    git worktree add /tmp/before 75f03e8 --detach
    cp tests/config_plans.py /tmp/before/tests/
    (cd /tmp/before && PYTHONPATH=/tmp/before python tests/config_plans.py) \
        > tests/golden/plans_before_config_objects.json

It works on both layouts: the planning functions it stops at are
`tfdp.planning.plan_private` / `plan_non_private` (today) or
`tfdp.experiment._plan` / `_plan_non_private` (before).
"""

import dataclasses
import json
import sys

import gin

REQUIRED_MACROS = {"PRETRAINED_BACKBONE": '"unused"'}  # a path only the user knows


class _Planned(Exception):
    def __init__(self, plan):
        super().__init__("planned")
        self.plan = plan


def main_module():
    """`tfdp.main` (imported late: this file also runs against an older tree)."""
    from tfdp import main  # pylint: disable=g-import-not-at-top

    return main


def _as_dict(plan):
    fields = dataclasses.asdict(plan)
    return json.loads(json.dumps({"kind": type(plan).__name__, **fields}, default=repr,
                                 sort_keys=True))


# Variants of every config, as --gin_param bindings of the setting's home in each layout.
VARIANTS = {"": (), "static_auto": ("static_batch_size", "'auto'"),
            "not_private": ("privacy", "None")}
_HOMES = {"static_batch_size": "tfdp.RuntimeConfig", "privacy": "tfdp.train_and_evaluate"}


def plans(only=None, extra_params=()):
    """{config name [+ " " + variant]: its plan as a JSON-safe dict}, for every shipped config.

    A setting the trainer refuses at planning is recorded as {"refused": the
    error's type}.

    Each config as shipped, then with static batches ("auto") and without
    privacy, so that truncation and the non-private plan are compared too.
    `only` restricts the configs; `extra_params` are --gin_param bindings
    added to every run.
    """
    from tfdp import experiment  # pylint: disable=g-import-not-at-top
    from tfdp import main  # pylint: disable=g-import-not-at-top

    if hasattr(experiment, "_plan"):  # before the config objects
        home, names = experiment, ("_plan", "_plan_non_private")
    else:
        from tfdp import planning as home  # pylint: disable=g-import-not-at-top
        names = ("plan_private", "plan_non_private")
    originals = {name: getattr(home, name) for name in names}

    def stopping(original):
        def planned(*args, **kwargs):
            raise _Planned(original(*args, **kwargs))
        return planned

    found = {}
    configs = sorted(name for name in main.shipped_gin_configs()
                     if not name.startswith("_") and name != "smoke.gin"
                     and (only is None or name in only))
    try:
        for name, original in originals.items():
            setattr(home, name, stopping(original))
        for config in configs:
            for variant, binding in VARIANTS.items():
                params = [f"{k} = {v}" for k, v in REQUIRED_MACROS.items()
                          if "finetune" in config] + list(extra_params)
                if binding:
                    where = ("tfdp.train_and_evaluate" if hasattr(experiment, "_plan")
                             else _HOMES[binding[0]])
                    params.append(f"{where}.{binding[0]} = {binding[1]}")
                gin.clear_config()
                main.parse_config([config], params)
                try:
                    experiment.train_and_evaluate(workdir="/nonexistent/never-written")
                except _Planned as planned:
                    found[f"{config} {variant}".strip()] = _as_dict(planned.plan)
                except ValueError as refused:  # both must refuse (the wording may differ)
                    found[f"{config} {variant}".strip()] = {"refused": type(refused).__name__}
                else:
                    raise AssertionError(f"{config} {variant}: the trainer did not plan")
    finally:
        for name, original in originals.items():
            setattr(home, name, original)
        gin.clear_config()
    return found


if __name__ == "__main__":
    json.dump(plans(), sys.stdout, indent=1, sort_keys=True)
    print()
