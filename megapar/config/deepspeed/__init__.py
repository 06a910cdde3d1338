"""A DeepSpeed `ds_config.json` read as DeepSpeed reads it, onto megapar's settings.

    keys.py   one `Key` row per DeepSpeed key: what megapar does with it, and why
    read.py   the reader (`apply`, `resolve_batch`) and docs/guide.md's key table (`key_table`)
"""
