"""The training-side context-extension recipes: the four `zoo-rope-*` members and how each is made.

Every recipe uses the zoo's corpus, model size and optimiser (AdamW, betas (0.9, 0.95), weight
decay 0.1 on matrices, gradients clipped at 1.0, `training.recipe`); what differs is where it
starts, the windows it trains on, the positions it gives their tokens and the RoPE scaling it
trains under. The step counts are sized to the 2-core CPU this zoo is trained on (docs/zoo.md).

- `pi-ft`, Position Interpolation (Chen et al. 2023, "Extending Context Window of Large Language
  Models via Positional Interpolation"): fine-tune `zoo-rope` with linear scaling, positions
  divided by the factor so that a longer window lands inside the trained range. The paper
  fine-tunes once at the target length; here, as the seeds' progressive schedule does, the
  context rises in stages, 256 -> 512 (x2) -> 1024 (x4), with the scaling raised at each stage.
- `yarn-ft`, YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
  Models"): the same schedule under YaRN scaling (NTK-by-parts interpolation with its attention
  temperature, the paper's default alpha = 1, beta = 32). The paper fine-tunes at the target
  length in one stage; the stages here keep PI and YaRN comparable step for step.
- `pose` (Zhu et al. 2023, `training.positions.pose_positions`): fine-tune `zoo-rope` on
  256-token windows whose position ids skip so that they cover 1024, under linear x4 (the paper
  pairs PoSE with an interpolation, linear, NTK or YaRN, and reports that each works).
- `randpos` (Ruoss et al. 2023, `training.positions.randomized_positions`): train from scratch
  like `zoo-rope` on 256-token windows whose positions are an ordered random subset of
  [0, 4096). It is served, like every zoo model, at positions 0..T-1 with no scaling. It trains
  300 steps, a fifth of the zoo's 1,500: what fitted the shared CPU (docs/zoo.md).

The fine-tunes use a constant learning rate after a short warm-up, as PI and YaRN do (both at
2e-5 for LLaMA, about 1/15 of its pre-training peak); 3e-4 here is 1/10 of the zoo's peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pe_runtime import RopeScaling
from training.recipe import TRAINED_CONTEXT, Hyperparameters

Method = Literal["pi-ft", "yarn-ft", "pose", "randpos"]
Positions = Literal["consecutive", "pose", "randomized"]
METHODS: tuple[Method, ...] = ("pi-ft", "yarn-ft", "pose", "randpos")

TARGET_CONTEXT = 1024
RANDOMIZED_RANGE = 4096
FINE_TUNE_LR = 3e-4
BASE_MODEL = "zoo-rope"


def hf_scaling(rope_type: str, factor: float) -> dict[str, Any]:
    """A scaling as `config.json` keeps it (Hugging Face's form), relative to the 256-token zoo."""
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    if rope_type == "yarn":
        scaling["original_max_position_embeddings"] = TRAINED_CONTEXT
    return scaling


def rope_scaling(scaling: Mapping[str, Any] | None) -> RopeScaling:
    return RopeScaling.from_hf(scaling, max_position_embeddings=TRAINED_CONTEXT)


@dataclass(frozen=True)
class Stage:
    """A run of `steps` optimizer steps on `batch_size` windows of `context` tokens under `scaling`."""

    context: int
    batch_size: int
    steps: int
    scaling: Mapping[str, Any] | None

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context


@dataclass(frozen=True)
class ExtensionRecipe:
    """One training-side member: its start, stages, positions and what it is scored on as it trains.

    `scaling` is the finished model's default `pe_scaling` (its `config.json` `rope_scaling`).
    `eval_context` and `eval_scaling` are the length and scaling its held-out loss is logged at
    every `eval_every` steps: the target length under the final scaling for the fine-tunes, so
    that PI and YaRN can be compared by the steps each needs to reach one loss.
    """

    method: Method
    name: str
    base: str | None
    stages: tuple[Stage, ...]
    scaling: Mapping[str, Any] | None
    positions: Positions
    position_range: int | None
    peak_lr: float
    final_lr: float
    warmup_steps: int
    eval_context: int
    eval_every: int
    eval_windows: int

    @property
    def steps(self) -> int:
        return sum(stage.steps for stage in self.stages)

    @property
    def tokens(self) -> int:
        return sum(stage.steps * stage.tokens_per_step for stage in self.stages)

    def training_block(self) -> dict[str, Any]:
        """`config.json`'s `"training"` (SPEC: training-side zoo members)."""
        return {
            "method": self.method,
            "scaling": dict(self.scaling) if self.scaling is not None else None,
            "steps": self.steps,
        }


def progressive(rope_type: str, steps: tuple[int, int]) -> tuple[Stage, ...]:
    """256 -> 512 (x2) -> 1024 (x4): the step from 256 is the zoo's own pre-training.

    Batches keep about the zoo's 2,048 tokens per step (4 x 512, then 2 x 1024).
    """
    return (
        Stage(2 * TRAINED_CONTEXT, 4, steps[0], hf_scaling(rope_type, 2.0)),
        Stage(TARGET_CONTEXT, 2, steps[1], hf_scaling(rope_type, 4.0)),
    )


def recipe(method: Method, *, scale: float = 1.0) -> ExtensionRecipe:
    """The recipe for `method`; `scale` multiplies every step count (a tiny run for tests)."""
    zoo = Hyperparameters()

    def steps(count: int) -> int:
        return max(1, round(count * scale))

    fine_tune: dict[str, Any] = {
        "base": BASE_MODEL,
        "peak_lr": FINE_TUNE_LR,
        "final_lr": FINE_TUNE_LR,
        "warmup_steps": min(10, steps(10)),
        "eval_context": TARGET_CONTEXT,
        "eval_every": steps(10),
        "eval_windows": 8,
    }
    if method in ("pi-ft", "yarn-ft"):
        rope_type = "linear" if method == "pi-ft" else "yarn"
        return ExtensionRecipe(
            method=method,
            name=f"zoo-rope-{'pi4' if method == 'pi-ft' else 'yarn4'}",
            stages=progressive(rope_type, (steps(40), steps(120))),
            scaling=hf_scaling(rope_type, 4.0),
            positions="consecutive",
            position_range=None,
            **fine_tune,
        )
    if method == "pose":
        return ExtensionRecipe(
            method=method,
            name="zoo-rope-pose",
            stages=(Stage(TRAINED_CONTEXT, zoo.batch_size, steps(160), hf_scaling("linear", 4.0)),),
            scaling=hf_scaling("linear", 4.0),
            positions="pose",
            position_range=TARGET_CONTEXT,
            **fine_tune,
        )
    return ExtensionRecipe(
        method=method,
        name="zoo-rope-randpos",
        base=None,
        stages=(Stage(TRAINED_CONTEXT, zoo.batch_size, steps(300), None),),
        scaling=None,
        positions="randomized",
        position_range=RANDOMIZED_RANGE,
        peak_lr=zoo.peak_lr,
        final_lr=zoo.final_lr,
        warmup_steps=min(zoo.warmup_steps, steps(zoo.warmup_steps)),
        eval_context=TRAINED_CONTEXT,
        eval_every=steps(zoo.eval_every),
        eval_windows=zoo.eval_windows,
    )
