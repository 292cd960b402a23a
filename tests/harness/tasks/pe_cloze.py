"""The data of the `pe_cloze` lm-eval task: pe_cloze.jsonl beside this file, read without any hub.

lm-eval imports this file by its path (`custom_dataset: !function pe_cloze.load` in pe_cloze.yaml)
and calls `load` with the task's metadata as keyword arguments, which it ignores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_suffix(".jsonl")


def documents() -> list[dict[str, Any]]:
    """The task's items in file order: `context`, `choices` (a list of words), `label` (the index of
    the expected word)."""
    lines = DATA.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load(**_metadata: Any) -> dict[str, Any]:
    """The splits lm-eval asks for: one `test` split, a `datasets.Dataset` (lm-eval's dependency)."""
    import datasets

    return {"test": datasets.Dataset.from_list(documents())}
