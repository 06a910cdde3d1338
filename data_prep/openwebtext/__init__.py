"""OpenWebText data-prep pipeline: Reddit dumps -> clean, deduplicated JSON lines.

One module per step, each a small CLI (``python -m data_prep.openwebtext.<step> --help``):

    extract_urls -> dedup_urls -> blacklist_urls -> download -> merge -> cleanup [-> cleanup_fix_dataset]
    -> find_duplicates -> group_duplicates -> remove_duplicates [-> filter_ngrams] -> shuffle

(the bracketed steps are optional: the driver's --fix-tasks and --decontaminate-with).

``scripts/prepare_openwebtext.sh`` runs them in order and ends with ``tools/preprocess_data.py``.
Each step's docstring states its behaviour and every upstream-quirk decision
(spec: ../shared/OPENWEBTEXT.md).
"""
