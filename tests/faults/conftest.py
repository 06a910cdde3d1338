"""Fault-injection tests (tests/faults/harness.py): the full CPU suite runs all of them; the quick
tier (`run_tests.sh --quick`, which leaves out `slow`) keeps one cheap case of each fault class
below and the harness's own tests. tests/conftest.py prints the fault table at the end of the session."""
import os

import pytest

QUICK = {
    "test_faults_smoke.py": None,                                          # the harness itself: all
    "test_faults_checkpoints.py": {"test_save_dir_containing_the_source_is_refused"},        # data loss
    "test_faults_save.py": {"test_finetune_into_its_own_load_dir_is_refused",                 # --save safety,
                            "test_lock_on_another_host_says_how_to_clear_it"},               # the lock
    "test_faults_data.py": {"test_wrong_format_merge_file_in_preprocess",                   # tokenizer files,
                            "test_bad_evaluation_file[malformed JSON line]"},               # OpenWebText steps
    "test_faults_zero.py": {"test_bad_zero_flags_through_the_launcher[param offload below stage 3]"},
    "test_faults_deepspeed.py": {"test_bad_deepspeed_config_through_the_launcher[nvme offload]",  # ds_config.json
                                 "test_bad_estimator_option[--gpu-memory 80XB]"},                 # estimator sizes
    "test_faults_launch.py": {"test_every_range_check_in_process",                          # flags, and
                              "test_bad_number_through_the_launcher[--train-iters -5]",     # the launcher,
                              "test_bad_rendezvous_flags[--nnodes 2 --node-rank 1]",        # several nodes,
                              "test_bad_logger_flags_in_process",                           # W&B flags
                              "test_logger_package_missing_is_refused_before_any_work[--wandb-project-wandb]"},
    "test_faults_resume.py": {"test_train_longer_command_rewrites_the_flags",
                              "test_a_run_stopped_early_is_told_how_to_resume",
                              "test_the_next_commands_keep_the_processes_of_the_run"},
    "test_faults_hf_import.py": {"test_truncated_safetensors_is_refused"},                 # HF import
    "test_faults_server.py": {"test_random_seed_of_2_63_or_more_is_refused_before_any_rank"},
    "test_faults_interleaved.py": {"test_virtual_stages_need_a_pipeline"},
    "test_faults_plan_layout.py": {"test_bad_plan_input[--gpus 0]"},                      # layout planner
    "test_faults_fp8.py": {"test_bad_fp8_flags_through_the_launcher[on a CPU-only run]"},      # fp8 GEMMs
    "test_faults_machine.py": {"test_host_out_of_memory_is_one_line"},                    # a failing machine
    "test_faults_divergence.py": {"test_fp16_overflowing_at_the_minimum_loss_scale_stops"},    # fp16 divergence
}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    by_file: dict[str, list] = {}
    for item in items:  # the hook sees the whole session's items: mark only those of this folder
        if os.path.dirname(str(item.fspath)) == here:
            by_file.setdefault(os.path.basename(str(item.fspath)), []).append(item)
    for name, file_items in by_file.items():
        quick = QUICK.get(name, set())
        for item in file_items:
            if quick is not None and item.name not in quick and item.originalname not in quick:
                item.add_marker(pytest.mark.slow)
        _check_quick_names(name, quick, file_items)


def _check_quick_names(name: str, quick, file_items: list) -> None:
    """A renamed test must not leave the quick tier silently: when the whole file was collected,
    every name QUICK gives it must be one of its tests."""
    module = file_items[0].module
    defined = {n for n in dir(module) if n.startswith("test_") and callable(getattr(module, n))}
    if quick is None or {i.originalname for i in file_items} != defined:
        return
    missing = sorted(q for q in quick if not any(q in (i.name, i.originalname) for i in file_items))
    if missing:
        raise pytest.UsageError(f"tests/faults/conftest.py: QUICK names {missing} in {name}, which has no such "
                                f"test: rename them there too")
