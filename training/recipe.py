"""The one recipe every zoo model is trained with: architecture, optimiser and data sizes.

Only `pe` differs between schemes (plus the embedding scale that a unit-scale sinusoidal table
needs). Keeping all of it in one place is what makes the zoo a controlled experiment: a change
here retrains every scheme the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.model.config import ModelConfig, Scheme

# The bundled members: every scheme, each trained with the one recipe below.
ZOO_SCHEMES: tuple[Scheme, ...] = (
    "rope",
    "alibi",
    "sinusoidal",
    "learned",
    "t5_bias",
    "nope",
    "rope_alibi",
    "shaw",
    "transformer_xl",
    "cope",
)
TRAINED_CONTEXT = 256
D_MODEL = 192


def zoo_model_config(scheme: Scheme) -> ModelConfig:
    """About 1.8M parameters: small enough to train in minutes on two CPU cores."""
    return ModelConfig(
        vocab_size=258,
        d_model=D_MODEL,
        n_layers=4,
        n_heads=6,
        n_kv_heads=6,
        ffn_hidden=512,
        tie_embeddings=True,
        pe=scheme,
        native_context=TRAINED_CONTEXT,
        embedding_scale=D_MODEL**0.5 if scheme == "sinusoidal" else 1.0,
    )


@dataclass(frozen=True)
class Hyperparameters:
    """Optimisation settings shared by every scheme.

    `steps` is sized for at most 15 minutes per scheme on this 2-core CPU with two torch threads
    (about 0.55 s per step, 3,700-3,800 tokens/s, nothing else running); the run is defined by
    steps, not time, to stay reproducible. A peak learning rate of 1e-2 did worse than 3e-3 (NoPE,
    300 steps: 3.97 vs 3.79 held-out bits per byte).
    """

    steps: int = 1500
    batch_size: int = 8
    context: int = TRAINED_CONTEXT
    peak_lr: float = 3e-3
    final_lr: float = 3e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    seed: int = 1234

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context
