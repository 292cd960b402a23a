"""Train the training-side zoo members: `python -m training.extend --methods pi-ft yarn-ft pose randpos`.

Each method's recipe is in `training.extension`; this runs it and writes a zoo-layout directory,
`models/zoo-rope-<variant>/`: `config.json` (with the `"training"` block and, for a fine-tune, its
scaling as the default `rope_scaling`), bfloat16 `model.safetensors`, `training.json` and
`training_log.csv`, whose `eval_bits_per_byte` column is the held-out loss at the recipe's
`eval_context` (1024 under the final scaling for the fine-tunes) every `eval_every` steps, from
step 0. Like the zoo's, a run is a pure function of the seed, the thread count and the stdlib.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from service.model.checkpoint import load_checkpoint, save_checkpoint
from service.model.transformer import Transformer
from training.corpus import Corpus, consecutive_windows, load_corpus, random_windows
from training.evaluate import windows_bits_per_byte
from training.extension import METHODS, ExtensionRecipe, Method, Stage, recipe, rope_scaling
from training.positions import pose_positions, randomized_positions
from training.recipe import Hyperparameters, zoo_model_config
from training.schedule import warmup_cosine
from training.train import configure_torch, optimizer_step, weight_decay_groups, windows_fingerprint

CSV_FIELDS = ("step", "context", "tokens", "lr", "train_bits_per_byte", "eval_bits_per_byte", "seconds")


@dataclass(frozen=True)
class ExtensionRecord:
    """What `training.json` holds for a training-side member: its recipe, cost and final score."""

    method: str
    name: str
    base: str | None
    steps: int
    tokens: int
    stages: list[dict[str, Any]]
    positions: str
    position_range: int | None
    scaling: dict[str, Any] | None
    peak_lr: float
    final_lr: float
    warmup_steps: int
    parameters: int
    eval_context: int
    eval_windows: int
    eval_sha256: str
    initial_eval_bits_per_byte: float | None
    final_eval_bits_per_byte: float
    seconds: float
    threads: int
    seed: int
    torch_version: str
    python_version: str
    command: str


def starting_model(plan: ExtensionRecipe, models_dir: Path, seed: int) -> Transformer:
    """The base checkpoint in float32 for a fine-tune, else a fresh model seeded like the zoo's."""
    torch.manual_seed(seed)
    if plan.base is None:
        return Transformer(zoo_model_config("rope"))
    return load_checkpoint(models_dir / plan.base).train()


def batch_positions(plan: ExtensionRecipe, stage: Stage, generator: torch.Generator) -> torch.Tensor | None:
    """The position ids of one batch `[B, T]`; None for plain 0..T-1."""
    if plan.positions == "pose" and plan.position_range is not None:
        return pose_positions(stage.batch_size, stage.context, plan.position_range, generator)
    if plan.positions == "randomized" and plan.position_range is not None:
        return randomized_positions(stage.batch_size, stage.context, plan.position_range, generator)
    return None


def extend(
    plan: ExtensionRecipe, out_dir: Path, corpus: Corpus, *, models_dir: Path, seed: int, command: str
) -> ExtensionRecord:
    """Run `plan`, save the member in `out_dir` and score the saved file at `eval_context`."""
    model = starting_model(plan, models_dir, seed)
    eval_windows = consecutive_windows(corpus.held_out, plan.eval_context, plan.eval_windows)
    eval_scaling = rope_scaling(plan.scaling)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    initial = windows_bits_per_byte(model, eval_windows, eval_scaling) if plan.base is not None else None
    optimise(model, plan, corpus, eval_windows, out_dir / "training_log.csv", seed=seed, initial=initial)
    seconds = time.perf_counter() - started
    finished = Transformer(replace(model.config, rope_scaling=plan.scaling))
    finished.load_state_dict(model.state_dict())
    save_checkpoint(finished, out_dir, name=plan.name, dtype=torch.bfloat16, training=plan.training_block())
    record = ExtensionRecord(
        method=plan.method,
        name=plan.name,
        base=plan.base,
        steps=plan.steps,
        tokens=plan.tokens,
        stages=[asdict(stage) for stage in plan.stages],
        positions=plan.positions,
        position_range=plan.position_range,
        scaling=plan.training_block()["scaling"],
        peak_lr=plan.peak_lr,
        final_lr=plan.final_lr,
        warmup_steps=plan.warmup_steps,
        parameters=sum(p.numel() for p in model.parameters()),
        eval_context=plan.eval_context,
        eval_windows=eval_windows.shape[0],
        eval_sha256=windows_fingerprint(eval_windows),
        initial_eval_bits_per_byte=None if initial is None else round(initial, 4),
        # The saved bfloat16 file under its own default scaling: what a request without one gets.
        final_eval_bits_per_byte=round(windows_bits_per_byte(load_checkpoint(out_dir), eval_windows), 4),
        seconds=round(seconds, 1),
        threads=torch.get_num_threads(),
        seed=seed,
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        command=command,
    )
    (out_dir / "training.json").write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


def optimise(
    model: Transformer,
    plan: ExtensionRecipe,
    corpus: Corpus,
    eval_windows: torch.Tensor,
    log_path: Path,
    *,
    seed: int,
    initial: float | None,
) -> None:
    """Every stage in turn, one CSV row per step (and a step-0 row with the starting score)."""
    zoo = Hyperparameters()
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, zoo.weight_decay), lr=plan.peak_lr, betas=(zoo.beta1, zoo.beta2)
    )
    batches = torch.Generator().manual_seed(seed)
    eval_scaling = rope_scaling(plan.scaling)
    started = time.perf_counter()
    step, tokens = 0, 0
    with log_path.open("w", newline="", buffering=1) as log_file:
        log = csv.DictWriter(log_file, fieldnames=CSV_FIELDS)
        log.writeheader()
        if initial is not None:
            log.writerow(
                {"step": 0, "context": "", "tokens": 0, "lr": "", "train_bits_per_byte": ""}
                | {
                    "eval_bits_per_byte": f"{initial:.4f}",
                    "seconds": f"{time.perf_counter() - started:.1f}",
                }
            )
        for stage in plan.stages:
            scaling = rope_scaling(stage.scaling)
            for _ in range(stage.steps):
                step += 1
                tokens += stage.tokens_per_step
                lr = warmup_cosine(
                    step - 1,
                    peak=plan.peak_lr,
                    warmup_steps=plan.warmup_steps,
                    total_steps=plan.steps,
                    floor=plan.final_lr,
                )
                inputs, targets = random_windows(corpus.train, stage.batch_size, stage.context, batches)
                positions = batch_positions(plan, stage, batches)
                bits = optimizer_step(
                    model,
                    optimizer,
                    inputs,
                    targets,
                    lr=lr,
                    grad_clip=zoo.grad_clip,
                    scaling=scaling,
                    position_ids=positions,
                )
                due = step % plan.eval_every == 0 or step == plan.steps
                held_out = windows_bits_per_byte(model, eval_windows, eval_scaling) if due else None
                log.writerow(
                    {
                        "step": step,
                        "context": stage.context,
                        "tokens": tokens,
                        "lr": f"{lr:.6g}",
                        "train_bits_per_byte": f"{bits:.4f}",
                        "eval_bits_per_byte": "" if held_out is None else f"{held_out:.4f}",
                        "seconds": f"{time.perf_counter() - started:.1f}",
                    }
                )
                if held_out is not None:
                    print(f"{plan.name} step {step}/{plan.steps}: eval {held_out:.4f}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--models-dir", type=Path, default=Path("models"), help="where bases are read")
    parser.add_argument("--out-dir", type=Path, help="where members are written (default: --models-dir)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiplies every step count (below 1: a smoke run)"
    )
    parser.add_argument("--seed", type=int, default=Hyperparameters().seed)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    args = parser.parse_args(argv)
    configure_torch(args.threads)
    corpus = load_corpus()
    command = shlex.join(["python", "-m", "training.extend", *(argv if argv is not None else sys.argv[1:])])
    method: Method
    for method in args.methods:
        plan = recipe(method, scale=args.scale)
        out_dir = (args.out_dir or args.models_dir) / plan.name
        record = extend(plan, out_dir, corpus, models_dir=args.models_dir, seed=args.seed, command=command)
        print(json.dumps(asdict(record)), flush=True)


if __name__ == "__main__":
    main()
