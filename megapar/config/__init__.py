"""The run's configuration: one mechanism from the command line to a typed, validated `Config`.

    settings.py          the settings (dataclass fields: default, help, Megatron alias) in sections, `Config`,
                         `ConfigError`, the parser derived from the fields, `flag_words` (a setting as words)
    overlays.py          where values come from: recipes, a DeepSpeed config, the command line and the embedded
                         default as `Overlay`s, merged with each value's `Origin` (`parse_flags`, `explain`)
    build.py             overlays -> a resolved, validated `Config` (`parse_config`, `build_config`)
    checks.py            the validation of a Config (`validate`), before any process group
    megatron.py          Megatron's alias flags and the switches megapar decides itself
    recipes.py           named, measured configurations (`--recipe NAME`; `python -m megapar.config.recipes`)
    deepspeed/           a DeepSpeed `ds_config.json` read as DeepSpeed reads it (one row per key: keys.py)
    command.py           a whole training command for the user to paste (`training_command`)
"""
