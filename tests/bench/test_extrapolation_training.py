"""The training-side members' extrapolation bench: settings, and cells stored per member then
rendered together, on tiny checkpoints through a real engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bench.extrapolation import Setting, run
from bench.extrapolation_training import SETTINGS, load_stored, member_settings, render, save_cells
from service.engine.engine import InferenceEngine

NATIVE = 64


def test_every_member_runs_unscaled_and_at_the_fine_tunes_fixed_factor() -> None:
    labels = [setting.label for setting in SETTINGS]
    assert labels[:3] == ["zoo-rope / none", "zoo-rope / linear x4", "zoo-rope / yarn x4"]
    assert {"zoo-rope-pi4 / linear x4", "zoo-rope-yarn4 / yarn x4", "zoo-rope-randpos / none"} <= set(labels)
    yarn = Setting("rope", "yarn", model="zoo-rope-yarn4", fixed_factor=4.0)
    assert yarn.rope_scaling(2 * NATIVE, NATIVE).factor == yarn.rope_scaling(8 * NATIVE, NATIVE).factor == 4.0
    assert yarn.rope_scaling(8 * NATIVE, NATIVE).original_max_position_embeddings == NATIVE


def test_members_scored_apart_are_rendered_together(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Two members scored by separate runs land in one table, in the suite's order."""
    for name in ("zoo-rope-pi4", "zoo-rope"):
        copy = shutil.copytree(tiny_checkpoints["rope"], tmp_path / "models" / name)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(config | {"name": name}))
    engine = InferenceEngine.from_model_dirs(
        [tmp_path / "models" / "zoo-rope-pi4", tmp_path / "models" / "zoo-rope"],
        device="cpu",
        max_context=2 * NATIVE,
    )
    engine.start()
    stream = torch.randint(0, 256, (2 * NATIVE,), generator=torch.Generator().manual_seed(0))
    try:
        for member in ("zoo-rope-pi4", "zoo-rope"):
            results = run(engine, stream, (NATIVE, 2 * NATIVE), member_settings(member))
            save_cells(
                tmp_path / "cells" / f"{member}.json", results, {"command": "x", "seconds": 1, "tokens": 128}
            )
    finally:
        engine.shutdown()

    stored, runs = load_stored(tmp_path / "cells")
    assert [setting.label for setting in stored][:4] == [
        "zoo-rope / none",
        "zoo-rope / linear x4",
        "zoo-rope / yarn x4",
        "zoo-rope-pi4 / none",
    ]
    assert [details["member"] for details in runs] == ["zoo-rope", "zoo-rope-pi4"]
    render(tmp_path / "cells", tmp_path / "out")
    table = (tmp_path / "out" / "extrapolation_training.md").read_text()
    assert "| zoo-rope-pi4 / linear x4 |" in table and "| zoo-rope-pi4 | `x` | 1 |" in table
    assert (tmp_path / "out" / "extrapolation_training.png").stat().st_size > 10_000
