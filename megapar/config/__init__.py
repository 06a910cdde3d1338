"""The run's configuration: one mechanism from the command line to a typed, validated `Config`.

    arguments.py         the settings (dataclass fields: default, help, Megatron alias), the parser derived
                         from them, the merge of recipes, a DeepSpeed config and the command line (each
                         value's Origin kept), validation, and `flag_words` (a setting as command-line words)
    recipes.py           named, measured configurations (`--recipe NAME`; `python -m megapar.config.recipes`)
    deepspeed/           a DeepSpeed `ds_config.json` read as DeepSpeed reads it (one row per key: keys.py)
    command.py           a whole training command for the user to paste (`training_command`)
"""
