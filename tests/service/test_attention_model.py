"""`pe_attention` rules in the model: a tiny random Llama under each rule against the same weights
run in float64 with the method's published attention (`tests/references/`) in every layer.

The model computes a rule from the positions the cache records (queries and keys turned from where
they were rotated to where each branch puts them); the reference rotates as each repository does.
Both the full pass and incremental decoding over the paged pool (a prompt, then one token at a
time) must give the reference's log-probabilities, and rows under different rules, mixed with plain
rows in one pass, must each give what they give alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from pe_runtime import RopeScaling
from service.model.attention_rules import (
    AttentionRule,
    DCAAttention,
    LeakyReRoPEAttention,
    ReRoPEAttention,
    SelfExtendAttention,
    StandardAttention,
    StreamingAttention,
)
from service.model.paged_cache import PagedRows, bytes_per_token
from service.model.transformer import Transformer, rms_norm
from tests.conftest import tiny_transformer
from tests.references.dca import dca_attention
from tests.references.logn import logn_attention
from tests.references.rerope import leaky_rerope_attention, rerope_attention
from tests.references.self_extend import self_extend_attention
from tests.references.streaming import streaming_attention
from tests.service.test_fast_decode import pool_for

TOLERANCE = 2e-4
LENGTH = 70
PROMPT = 30
NO_LOGN = 10**9
BASE = 100.0  # every channel turns within the text, so a misplaced key shows

ReferenceAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

CASES: list[tuple[AttentionRule, ReferenceAttention]] = [
    (StandardAttention(logn=16), partial(logn_attention, base=BASE, seq_length=16)),
    (
        SelfExtendAttention(group_size=3, window=10),
        partial(self_extend_attention, base=BASE, group_size=3, window=10),
    ),
    (
        SelfExtendAttention(group_size=4, window=8, logn=20),
        partial(self_extend_attention, base=BASE, group_size=4, window=8, scale_base=20),
    ),
    (ReRoPEAttention(window=12), partial(rerope_attention, base=BASE, window=12, training_length=NO_LOGN)),
    (
        ReRoPEAttention(window=12, logn=16),
        partial(rerope_attention, base=BASE, window=12, training_length=16),
    ),
    (
        LeakyReRoPEAttention(window=10, leak=4),
        partial(leaky_rerope_attention, base=BASE, window=10, scaling_factor=4, training_length=NO_LOGN),
    ),
    (
        DCAAttention(chunk_size=24, local_window=8),
        partial(dca_attention, base=BASE, chunk_size=24, local_window=8),
    ),
    (
        StreamingAttention(sink_tokens=4, window=16),
        partial(streaming_attention, base=BASE, start_size=4, recent_size=16),
    ),
]
IDS = [f"{rule.type}{'-logn' if rule.logn else ''}" for rule, _ in CASES]


def model() -> Transformer:
    return tiny_transformer(seed=5, rope_base=BASE, native_context=128)


def text(seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (LENGTH,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logprobs(model: Transformer, tokens: list[int], attention: ReferenceAttention) -> torch.Tensor:
    """[T, V] log-probabilities of the model's weights in float64 with `attention` in every layer
    (Llama's block: RMSNorm, grouped-query attention, SwiGLU)."""
    config = model.config
    weights = {name: value.detach().double() for name, value in model.state_dict().items()}
    hidden = weights["embed_tokens.weight"][torch.tensor(tokens)]  # [T, D]
    groups = config.n_heads // config.n_kv_heads

    def heads(x: torch.Tensor, count: int) -> torch.Tensor:
        return x.view(len(tokens), count, config.head_dim).transpose(0, 1)  # [h, T, hd]

    for index in range(config.n_layers):
        layer = f"layers.{index}."
        normed = rms_norm(hidden, weights[layer + "attn_norm.weight"], config.norm_eps)
        q = heads(normed @ weights[layer + "attn.q_proj.weight"].T, config.n_heads)
        k = heads(normed @ weights[layer + "attn.k_proj.weight"].T, config.n_kv_heads)
        v = heads(normed @ weights[layer + "attn.v_proj.weight"].T, config.n_kv_heads)
        attended = attention(q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0))
        hidden = (
            hidden
            + attended.transpose(0, 1).reshape(len(tokens), -1) @ weights[layer + "attn.o_proj.weight"].T
        )
        normed = rms_norm(hidden, weights[layer + "mlp_norm.weight"], config.norm_eps)
        gate = F.silu(normed @ weights[layer + "mlp.gate_proj.weight"].T)
        up = normed @ weights[layer + "mlp.up_proj.weight"].T
        hidden = hidden + (gate * up) @ weights[layer + "mlp.down_proj.weight"].T
    hidden = rms_norm(hidden, weights["norm.weight"], config.norm_eps)
    return torch.log_softmax(hidden @ weights["lm_head.weight"].T, dim=-1)


def incremental_logprobs(
    model: Transformer, tokens: list[int], rule: AttentionRule | None, *, scattered: bool = False
) -> torch.Tensor:
    """[T, V]: the prompt in one pass over a paged row, then one token per pass; `scattered`: the
    row's blocks in reverse order (not one run of the pool: its window is copied, not a view)."""
    pool = pool_for(model)
    row = pool.allocate(len(tokens))
    if scattered:
        row.blocks.reverse()
    return decode_over(model, tokens, rule, PagedRows(pool, [row]))


def decode_over(
    model: Transformer, tokens: list[int], rule: AttentionRule | None, rows: PagedRows
) -> torch.Tensor:
    """[T, V]: the prompt in one pass over `rows` (one row), then one token per pass."""
    outputs = []
    with torch.inference_mode():
        for begin, end in [(0, PROMPT), *((step, step + 1) for step in range(PROMPT, len(tokens)))]:
            logits = model(
                torch.tensor([tokens[begin:end]]), scaling=[RopeScaling()], cache=rows, attention=[rule]
            )
            outputs.append(torch.log_softmax(logits[0].double(), dim=-1))
    return torch.cat(outputs)


def assert_close(ours: torch.Tensor, reference: torch.Tensor, label: str) -> None:
    error = (ours.double() - reference).abs().max().item()
    assert error <= TOLERANCE, f"{label}: max |ours − reference| = {error:.3g}"


@pytest.mark.parametrize(("rule", "attention"), CASES, ids=IDS)
def test_a_full_pass_equals_the_authors_attention_in_float64(
    rule: AttentionRule, attention: ReferenceAttention
) -> None:
    tiny = model()
    tokens = text()
    reference = reference_logprobs(tiny, tokens, attention)
    with torch.inference_mode():
        ours = torch.log_softmax(tiny(torch.tensor([tokens]), attention=rule)[0].double(), dim=-1)
    assert_close(ours, reference, "full pass")
    plain = torch.log_softmax(tiny(torch.tensor([tokens]))[0].double(), dim=-1)
    assert (plain - reference).abs().max() > 1e-2, "the rule must move the outputs at this length"


@pytest.mark.parametrize(("rule", "attention"), CASES, ids=IDS)
def test_incremental_decoding_over_the_pool_equals_the_reference(
    rule: AttentionRule, attention: ReferenceAttention
) -> None:
    tiny = model()
    tokens = text(2)
    assert_close(
        incremental_logprobs(tiny, tokens, rule), reference_logprobs(tiny, tokens, attention), "decode"
    )


@pytest.mark.parametrize(("rule", "attention"), CASES, ids=IDS)
def test_a_row_on_scattered_blocks_decodes_as_on_a_run(
    rule: AttentionRule, attention: ReferenceAttention
) -> None:
    """A lone rule row whose blocks are not one run keeps its window as a copy it extends each pass
    (`paged_cache.WindowCopy`); it must read what a row on consecutive blocks reads."""
    tiny = model()
    tokens = text(4)
    assert_close(
        incremental_logprobs(tiny, tokens, rule, scattered=True),
        reference_logprobs(tiny, tokens, attention),
        "scattered decode",
    )


def test_rows_under_different_rules_in_one_pass_equal_each_alone() -> None:
    tiny = model()
    rules: list[AttentionRule | None] = [rule for rule, _ in CASES] + [None]
    texts = [text(seed) for seed in range(len(rules))]
    alone = [incremental_logprobs(tiny, tokens, rule) for tokens, rule in zip(texts, rules, strict=True)]
    pool = pool_for(model=tiny, tokens=8192)
    rows = PagedRows(pool, [pool.allocate(LENGTH) for _ in rules])
    together: list[list[torch.Tensor]] = [[] for _ in rules]
    with torch.inference_mode():
        for begin, end in [(0, PROMPT), *((step, step + 1) for step in range(PROMPT, LENGTH))]:
            batch = torch.tensor([tokens[begin:end] for tokens in texts])
            logits = tiny(batch, scaling=[RopeScaling()] * len(rules), cache=rows, attention=rules)
            for row, row_logits in enumerate(logits):
                together[row].append(torch.log_softmax(row_logits.double(), dim=-1))
    for row, rule in enumerate(rules):
        error = (torch.cat(together[row]) - alone[row]).abs().max().item()
        assert error <= 1e-5, f"{rule}: mixed vs alone {error:.3g}"


def test_rule_rows_of_different_lengths_in_one_pass_each_read_their_own_window() -> None:
    """When every row of a pass is under a rule, each attends over its own window (`PagedRows.write`):
    a view of its blocks where they are one run, else its copy. Rows of different lengths, every
    other one on scattered blocks, prefilled in one padded chunk and decoded together, each read
    what the authors' attention reads."""
    tiny = model()
    cases = [case for case in CASES if case[0].moves_pairs]
    texts = [text(seed) for seed in range(len(cases))]
    prompts = [PROMPT - 2 * index for index in range(len(cases))]
    pool = pool_for(model=tiny, tokens=8192)
    rows = [pool.allocate(LENGTH) for _ in cases]
    for row in rows[1::2]:
        row.blocks.reverse()
    view = PagedRows(pool, rows)
    rules: list[AttentionRule | None] = [rule for rule, _ in cases]
    scalings = [RopeScaling()] * len(cases)
    steps = LENGTH - PROMPT
    with torch.inference_mode():
        chunk = [
            tokens[:prompt] + [0] * (PROMPT - prompt) for tokens, prompt in zip(texts, prompts, strict=True)
        ]
        outputs = [tiny(torch.tensor(chunk), scaling=scalings, cache=view, attention=rules, counts=prompts)]
        for step in range(steps):
            batch = torch.tensor(
                [[tokens[prompt + step]] for tokens, prompt in zip(texts, prompts, strict=True)]
            )
            outputs.append(tiny(batch, scaling=scalings, cache=view, attention=rules))
    for index, ((rule, attention), tokens, prompt) in enumerate(zip(cases, texts, prompts, strict=True)):
        ours = torch.stack([torch.log_softmax(output[index, -1].double(), dim=-1) for output in outputs])
        reference = reference_logprobs(tiny, tokens, attention)[prompt - 1 : prompt + steps]
        assert_close(ours, reference, f"{rule} after a prompt of {prompt}")


def test_a_yarn_row_turns_with_its_own_frequencies() -> None:
    """A rule composes with a scaling: the branches turn by the scaling's frequencies, so a rule
    under YaRN equals the rule computed from YaRN's table directly (scored in one pass vs decoded)."""
    tiny = model()
    tokens = text(3)
    yarn = RopeScaling.from_hf(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        max_position_embeddings=32,
    )
    rule = SelfExtendAttention(group_size=3, window=10)
    with torch.inference_mode():
        whole = torch.log_softmax(tiny(torch.tensor([tokens]), scaling=yarn, attention=rule)[0].double(), -1)
        plain = torch.log_softmax(tiny(torch.tensor([tokens]), scaling=yarn)[0].double(), -1)
    pool = pool_for(tiny)
    rows = PagedRows(pool, [pool.allocate(LENGTH)])
    steps = []
    with torch.inference_mode():
        for begin, end in [(0, PROMPT), *((step, step + 1) for step in range(PROMPT, LENGTH))]:
            logits = tiny(torch.tensor([tokens[begin:end]]), scaling=[yarn], cache=rows, attention=[rule])
            steps.append(torch.log_softmax(logits[0].double(), dim=-1))
    assert (torch.cat(steps) - whole).abs().max() <= 1e-5
    assert (whole - plain).abs().max() > 1e-2
    assert math.isfinite(whole.sum().item())


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_the_fused_kernel_equals_the_score_matrix_path(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU in float32 each branch runs through the fused kernel over its own key span and the
    branches merge by log-sum-exp; elsewhere one score matrix takes each pair's branch. Both are
    one rule: the same log-probabilities for every type the scheme applies."""
    from service.model import rule_attention

    tiny = model() if scheme == "rope" else tiny_transformer(seed=5, pe="alibi", native_context=128)
    tokens = torch.tensor([text()])
    rules = [rule for rule, _ in CASES if scheme == "rope" or rule.type in ("standard", "streaming")]
    with torch.inference_mode():
        fused = [torch.log_softmax(tiny(tokens, attention=[rule])[0], dim=-1) for rule in rules]
        monkeypatch.setattr(rule_attention, "_fused_mask", lambda *args: None)
        matrix = [torch.log_softmax(tiny(tokens, attention=[rule])[0], dim=-1) for rule in rules]
    for rule, one, other in zip(rules, fused, matrix, strict=True):
        assert (one - other).abs().max().item() < 1e-5, rule


def test_a_rule_rows_copies_stay_within_its_reservation_and_leave_with_its_blocks() -> None:
    """A Self-Extend row on scattered blocks keeps its keys turned for the rule and its window
    copied, beside the pool; they grow by doubling as the row decodes, but never past the slots it
    reserved, the pool reports them (`pe_kv_side_bytes`), and they go when its blocks go back."""
    tiny = model()
    pool = pool_for(tiny)
    row = pool.allocate(LENGTH)
    row.blocks.reverse()
    decode_over(tiny, text(4), SelfExtendAttention(group_size=3, window=10), PagedRows(pool, [row]))
    reserved = len(row.blocks) * pool.block_size  # 80 slots for 70 tokens
    assert row.turned is not None and row.copy is not None
    # the window copy holds keys and values, the turned keys one placement's keys: 1.5x the entries
    entries = bytes_per_token(tiny.config, torch.float32) * reserved
    assert pool.side_bytes == row.side_bytes == entries * 3 // 2
    pool.release(row)
    assert pool.side_bytes == 0 and row.turned is None and row.copy is None
