"""What the default suite leaves to `-m slow` (`@pytest.mark.slow`), and what it must keep."""

import os

import pytest

# Each privacy, accounting or workdir rule's check keeps at least one case in the default
# suite (README's command 2, CI): other cases of these may be marked slow, never all.
KEPT = [
    "tests/training/distribute_test.py::test_summed_noise_has_std_sigma_c_over_b_for_every_replica_count",
    "tests/training/distribute_test.py::test_microbatched_sensitivity_is_2c_across_replicas",
    "tests/training/distribute_test.py::test_masked_padding_contributes_nothing",
    "tests/training/dp_model_test.py::test_noise_std_is_sigma_c_over_b_once_per_logical_batch",
    "tests/training/dp_model_test.py::test_per_example_sensitivity_is_c_for_any_chunking",
    "tests/training/dp_model_test.py::test_microbatched_sensitivity_is_2c_for_any_chunking",
    "tests/training/dp_model_test.py::test_update_divides_by_the_expected_batch_size_not_the_realized_one",
    "tests/training/ghost_fuzz_test.py::test_fuzz_every_contribution_is_at_most_c",
    "tests/training/ghost_fuzz_test.py::test_fuzz_every_contribution_is_at_most_c_at_emulated_device_precision",
    "tests/training/ghost_fuzz_test.py::test_fuzz_each_block_kind",
    "tests/training/ghost_fuzz_test.py::test_fuzz_each_pretrained_backbone_layer",
    "tests/training/dp_model_fuzz_test.py::test_fuzz_dp_model_step",
    "tests/training/dp_model_fuzz_test.py::test_fuzz_a_poisoned_example_moves_the_sum_by_at_most_its_own_contribution",
    "tests/training/device_arithmetic_test.py::test_every_rounded_matmul_fails_the_float32_plan_and_holds_the_device_plan",
    "tests/training/device_arithmetic_test.py::test_fuzz_rescaled_inputs_and_weights_contribute_at_most_c",
    "tests/training/device_arithmetic_test.py::test_grappler_mixed_precision_is_refused_before_any_step",
    "tests/training/dp_step_xla_test.py::test_the_compiled_dp_step_has_no_float64_and_no_host_callback",
    "tests/training/dp_step_xla_test.py::test_the_check_sees_a_float64_op_inside_the_step",
    "tests/training/ghost_backbones_test.py::test_grouped_conv2d_rule_equals_a_float64_loop",
    "tests/training/ghost_clipping_test.py::test_norms_and_clipped_sum_equal_the_vectorized_path",
    "tests/dp/ghost_norms_test.py::test_no_rule_adds_more_than_its_norm_at_emulated_device_precision",
    "tests/dp/ghost_norms_test.py::test_recomputed_chunks_of_several_examples_are_the_held_vectors",
    "tests/dp/ghost_norms_test.py::test_a_recompute_that_differs_adds_no_more_than_the_first_norm",
    "tests/dp/ghost_norms_test.py::test_grouped_route_adds_no_more_than_its_norms",
    "tests/experiment_test.py::test_sampling_and_noise_seeds_are_secret_by_default",
    "tests/experiment_test.py::test_resuming_under_another_mechanism_is_refused_naming_the_field",
    "tests/static_batch_test.py::test_a_checkpoint_from_another_privacy_plan_is_not_resumed",
    "tests/non_private_test.py::test_a_private_workdir_is_not_resumed_without_privacy",
    "tests/non_private_test.py::test_a_non_private_workdir_is_not_resumed_privately",
    "tests/accounting/mechanism_test.py::test_noise_is_calibrated_to_the_target",
    "tests/lease_test.py::test_a_run_that_ignores_sigint_stops_within_a_renewal_of_losing_its_lease",
    "tests/workdir_test.py::test_a_full_disk_during_export_leaves_an_unfinished_workdir_that_a_rerun_finishes",
    "tests/workdir_test.py::test_more_steps_extend_the_run",
    "tests/non_private_test.py::test_a_private_run_keeps_the_dp_model_and_its_report",
    "tests/training/onednn_guard_test.py::test_an_unknown_onednn_state_counts_as_on",
    "tests/training/onednn_guard_test.py::test_a_batch_of_unknown_size_keeps_attention_on_the_ghost_path",
    "tests/training/onednn_guard_test.py::test_the_buggy_vectorized_ops_run_one_example_at_a_time[vectorized-None]",
    "tests/training/ghost_clipping_test.py::test_a_frozen_batch_norm_trains_under_dp_model_and_keeps_its_statistics",
    "tests/training/dp_step_xla_test.py::test_the_wrn_step_with_views_has_no_float64_node_and_no_host_callback",
    "tests/training/dp_model_test.py::test_a_nan_padding_row_reaches_no_statistic_and_adds_nothing[None]",
    "tests/dp/compiler_checks_test.py::test_one_nan_example_never_makes_a_release_non_finite",
    "tests/dp/compiler_checks_test.py::test_xla_removed_after_it_read_its_flags_is_refused_by_what_it_compiles",
    "tests/dp/compiler_checks_test.py::test_onednn_mode_removed_after_the_start_is_still_planned_for",
    "tests/training/device_arithmetic_test.py::test_xla_fast_math_is_refused",
    "tests/accounting/ledger_test.py::test_concurrent_runs_lose_no_line",
    "tests/experiment_test.py::test_a_run_refused_before_its_first_step_leaves_no_study_line",
]
# Every case of these stays: each config's epsilon against its paper, the README example.
ALL_CASES_KEPT = ["tests/configs_test.py::test_config_epsilon_matches_the_paper",
                  "tests/readme_test.py::"]




@pytest.fixture
def conftest_module(request):
    """tests/conftest.py as pytest loaded it: its stash key."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
    for plugin in request.config.pluginmanager.get_plugins():
        if os.path.abspath(getattr(plugin, "__file__", "") or "") == path:
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


def _names(test, nodeid):
    """Whether `test` names the collected test `nodeid`.

    `file::test` names every case of that test (not `file::test_longer`), `file::test[id]`
    that case, and `file::` every test of the file.
    """
    if test.endswith("::"):
        return nodeid.startswith(test)
    if test.endswith("]"):
        return nodeid == test
    return nodeid == test or nodeid.startswith(test + "[")


def _cases(test, slow_by_nodeid):
    """The collected cases `test` names, each with whether it is marked slow."""
    return {nodeid: slow for nodeid, slow in slow_by_nodeid.items() if _names(test, nodeid)}


def _collected(request, conftest_module):
    """Every collected test's id and whether it is marked slow, and the files collected."""
    # A run of node ids or of --lf's failures collects parts of files: a kept check's
    # other cases may be left out.
    config = request.config
    if config.getoption("lf", False) or any("::" in arg for arg in config.args):
        pytest.skip("this run collected parts of files")
    slow_by_nodeid = config.stash[conftest_module.SLOW_BY_NODEID]
    files = {nodeid.split("::")[0] for nodeid in slow_by_nodeid}
    if not files & {test.split("::")[0] for test in KEPT + ALL_CASES_KEPT}:
        pytest.skip("this run collected none of the kept checks' files")
    return slow_by_nodeid, files


def test_the_default_suite_keeps_a_case_of_each_kept_check(request, conftest_module):
    # On the marks of the collected tests, whatever -m selected: among the tests this run
    # collected, each kept check of a collected file has a case not marked slow. A renamed
    # check, whose old name names nothing collected, fails too. A run of some files only
    # checks the checks of those files.
    slow_by_nodeid, files = _collected(request, conftest_module)
    for test in KEPT:
        if test.split("::")[0] in files:
            cases = _cases(test, slow_by_nodeid)
            assert cases, f"{test}: no such test was collected"
            assert not all(cases.values()), f"{test}: every case is marked slow"


def test_every_case_of_the_always_kept_checks_stays_in_the_default_suite(request,
                                                                         conftest_module):
    slow_by_nodeid, files = _collected(request, conftest_module)
    for test in ALL_CASES_KEPT:
        if test.split("::")[0] in files:
            cases = _cases(test, slow_by_nodeid)
            assert cases, f"{test}: no such test was collected"
            slow = [nodeid for nodeid, is_slow in cases.items() if is_slow]
            assert not slow, f"marked slow, and every case of {test} must stay: {slow}"


def test_a_kept_check_names_its_cases():
    marked = {"tests/a_test.py::test_x": False, "tests/a_test.py::test_x[1-2]": True,
              "tests/a_test.py::test_x_long": True, "tests/b_test.py::test_x": True,
              "tests/a_test.py::test_y[1]": True}
    assert _cases("tests/a_test.py::test_x", marked) == {
        "tests/a_test.py::test_x": False, "tests/a_test.py::test_x[1-2]": True}
    assert _cases("tests/a_test.py::test_x[1-2]", marked) == {
        "tests/a_test.py::test_x[1-2]": True}
    assert set(_cases("tests/a_test.py::", marked)) == {
        "tests/a_test.py::test_x", "tests/a_test.py::test_x[1-2]",
        "tests/a_test.py::test_x_long", "tests/a_test.py::test_y[1]"}
