"""Train one zoo model: `python -m training.train --scheme rope --out models/zoo-rope`.

The run is a pure function of the recipe, the seed and the stdlib on the machine (a fixed
number of steps, seeded initialisation and batch sampling, deterministic kernels), so a zoo
checkpoint can be regenerated and checked rather than trusted.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from pe_runtime import RopeScaling
from service.model.checkpoint import load_checkpoint, save_checkpoint
from service.model.config import SCHEMES, Scheme
from service.model.transformer import Transformer
from training.corpus import Corpus, consecutive_windows, load_corpus, random_windows
from training.evaluate import mean_nll_bits, windows_bits_per_byte
from training.recipe import Hyperparameters, zoo_model_config
from training.schedule import warmup_cosine

CSV_FIELDS = ("step", "tokens", "lr", "train_bits_per_byte", "held_out_bits_per_byte", "seconds")
# The "final" train loss is averaged over this many last steps: one batch alone is too noisy.
TRAIN_LOSS_TAIL = 20


@dataclass(frozen=True)
class TrainingRecord:
    """What `training.json` holds: enough to judge a checkpoint and to rerun its training."""

    scheme: str
    steps: int
    tokens: int
    parameters: int
    final_train_bits_per_byte: float
    final_held_out_bits_per_byte: float
    held_out_windows: int
    held_out_context: int
    held_out_sha256: str
    seconds: float
    threads: int
    torch_version: str
    python_version: str
    hyperparameters: dict[str, Any]


def held_out_eval_windows(corpus: Corpus, hp: Hyperparameters) -> torch.Tensor:
    """The fixed held-out sample scored during and after training (and by the zoo test)."""
    return consecutive_windows(corpus.held_out, hp.context, hp.eval_windows)


def windows_fingerprint(windows: torch.Tensor) -> str:
    """Identifies the held-out sample: another Python's stdlib gives other bytes and other scores."""
    return hashlib.sha256(windows.numpy().tobytes()).hexdigest()


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only: shrinking norm gains and biases towards zero only hurts."""
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


def configure_torch(threads: int) -> None:
    """Process-wide settings for a reproducible run (CPU results depend on the thread count)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def train(scheme: Scheme, out_dir: Path, hp: Hyperparameters, corpus: Corpus) -> TrainingRecord:
    """Train, save a bfloat16 checkpoint in `out_dir`, and score the saved weights on held-out."""
    torch.manual_seed(hp.seed)
    model = Transformer(zoo_model_config(scheme))
    eval_windows = held_out_eval_windows(corpus, hp)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train_bits = optimise(model, corpus, hp, eval_windows, out_dir / "training_log.csv")
    seconds = time.perf_counter() - started
    save_checkpoint(model, out_dir, name=f"zoo-{scheme}", dtype=torch.bfloat16)
    tail = train_bits[-TRAIN_LOSS_TAIL:]
    record = TrainingRecord(
        scheme=scheme,
        steps=hp.steps,
        tokens=hp.steps * hp.tokens_per_step,
        parameters=sum(p.numel() for p in model.parameters()),
        final_train_bits_per_byte=round(sum(tail) / len(tail), 4),
        # Scored from the saved bfloat16 file, so the zoo test can reproduce it exactly.
        final_held_out_bits_per_byte=round(windows_bits_per_byte(load_checkpoint(out_dir), eval_windows), 4),
        held_out_windows=eval_windows.shape[0],
        held_out_context=hp.context,
        held_out_sha256=windows_fingerprint(eval_windows),
        seconds=round(seconds, 1),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        hyperparameters=asdict(hp),
    )
    (out_dir / "training.json").write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


def optimise(
    model: nn.Module, corpus: Corpus, hp: Hyperparameters, eval_windows: torch.Tensor, log_path: Path
) -> list[float]:
    """The training loop, logging every step to CSV; returns each step's train bits per byte."""
    optimizer = torch.optim.AdamW(
        weight_decay_groups(model, hp.weight_decay), lr=hp.peak_lr, betas=(hp.beta1, hp.beta2)
    )
    batches = torch.Generator().manual_seed(hp.seed)
    train_bits: list[float] = []
    started = time.perf_counter()
    with log_path.open("w", newline="", buffering=1) as log_file:
        log = csv.DictWriter(log_file, fieldnames=CSV_FIELDS)
        log.writeheader()
        progress = tqdm(range(1, hp.steps + 1), desc=log_path.parent.name, mininterval=5.0, file=sys.stderr)
        for step in progress:
            lr = warmup_cosine(
                step - 1,
                peak=hp.peak_lr,
                warmup_steps=hp.warmup_steps,
                total_steps=hp.steps,
                floor=hp.final_lr,
            )
            inputs, targets = random_windows(corpus.train, hp.batch_size, hp.context, batches)
            train_bits.append(
                optimizer_step(model, optimizer, inputs, targets, lr=lr, grad_clip=hp.grad_clip)
            )
            eval_due = step % hp.eval_every == 0 or step == hp.steps
            held_out = windows_bits_per_byte(model, eval_windows) if eval_due else None
            elapsed = time.perf_counter() - started
            log.writerow(
                {
                    "step": step,
                    "tokens": step * hp.tokens_per_step,
                    "lr": f"{lr:.6g}",
                    "train_bits_per_byte": f"{train_bits[-1]:.4f}",
                    "held_out_bits_per_byte": "" if held_out is None else f"{held_out:.4f}",
                    "seconds": f"{elapsed:.1f}",
                }
            )
            tokens_per_s = step * hp.tokens_per_step / elapsed
            progress.set_postfix(bpb=f"{train_bits[-1]:.3f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
    return train_bits


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    lr: float,
    grad_clip: float,
    scaling: RopeScaling | None = None,
    position_ids: torch.Tensor | None = None,
) -> float:
    """One AdamW step on a batch (`inputs`, `targets` `[B, T]`); returns its loss in bits per byte.

    `scaling` and `position_ids` (`[B, T]`) are the extension recipes' (`training.extend`).
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(inputs, scaling=scaling, position_ids=position_ids)  # [B, T, V]
    loss = mean_nll_bits(logits, targets)
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(loss)
    nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return float(loss.item())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", required=True, choices=SCHEMES)
    parser.add_argument("--out", type=Path, help="checkpoint directory (default models/zoo-<scheme>)")
    add_recipe_overrides(parser)
    return parser.parse_args(argv)


def add_recipe_overrides(parser: argparse.ArgumentParser) -> None:
    """Options shared with `training.train_zoo`; defaults are the recipe's."""
    defaults = Hyperparameters()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch CPU threads (results depend on it; the zoo was trained with 2, one scheme at a time)",
    )


def hyperparameters_from(args: argparse.Namespace) -> Hyperparameters:
    return replace(Hyperparameters(), steps=args.steps, batch_size=args.batch_size, seed=args.seed)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out_dir = args.out if args.out is not None else Path("models") / f"zoo-{args.scheme}"
    configure_torch(args.threads)
    record = train(args.scheme, out_dir, hyperparameters_from(args), load_corpus())
    print(json.dumps(asdict(record), indent=2))


if __name__ == "__main__":
    main()
