"""Checkpoints: the one place that knows the on-disk formats (docs/design.md#checkpoint-format).

    common.py   names, the tracker, SavedConfig, RNG, the checks a load makes
    legacy.py   Megatron's legacy layout (`--ckpt-format torch`)
    stream.py   torch.save's zip format written one tensor at a time
    publish.py  staging folders and publishing (training's iterations, the conversion tools' outputs)
    guard.py    one job per --save (its lock file), the --finetune rule, the disk checks
"""
from .common import (CHECKPOINT_VERSION, DISTRIB_OPTIM_FILE, MODEL_FILE, SHAPE_FIELDS, TRACKER, CheckpointError,
                     SavedConfig, atomic_torch_save, check_compatible, check_load_dir, flatten_model_state,
                     flatten_model_states, get_rng_state, has_model_state, iter_dir, load_file, nest_model_state,
                     nest_model_states, read_saved_config, read_tracker, restore_scheduler, saved_layout_flags,
                     set_rng_state, shard_dir_name)
from .legacy import load_checkpoint, load_model_state, model_state_for_save, save_checkpoint
from .guard import SaveDirLock, check_finetune_dirs, check_save_space
from .publish import published_dir, publish_iteration, staged_iteration, staging_dir
