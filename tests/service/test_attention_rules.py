"""The attention rules (`service.model.attention_rules`) against the authors' own attention code.

For every type, attention computed from the rule alone (q rotated at its query position and k at
its key position for each (i, j) pair, keys masked by `seen`, q scaled by log-n, a softmax) must
equal, within 1e-10 in float64, the float64 port of the method's published forward in
`tests/references/`, including its decode path where it has one (so generation equals scoring).
The lengths cross each boundary of the SPEC's table: the window (d = W − 1, W), multiples of the
group size, chunk edges, the sink count and the first evicted key. Then the parsers and the
validation, whose errors must name the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from pe_runtime import PEConfigError, apply_rope
from service.model.attention_rules import (
    ATTENTION_TYPES,
    AttentionRule,
    DCAAttention,
    LeakyReRoPEAttention,
    ReRoPEAttention,
    SelfExtendAttention,
    StandardAttention,
    StreamingAttention,
    logn_scale,
    parse_attention,
    parse_attention_spec,
)
from tests.references.dca import dca_attention
from tests.references.logn import logn_attention
from tests.references.rerope import leaky_rerope_attention, rerope_attention
from tests.references.self_extend import self_extend_attention
from tests.references.streaming import streaming_attention

TOLERANCE = 1e-10
HEADS = 2
HEAD_DIM = 16
# A small base so that even the slowest channel turns noticeably over a few dozen positions.
BASE = 100.0
# A training length no test text reaches: the authors' always-on log-n scale then scales nothing.
NO_LOGN = 10**9


def qkv(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, HEADS, length, HEAD_DIM, generator=generator, dtype=torch.float64)
    return q, k, v


def rule_attention(rule: AttentionRule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention from the rule alone: every (i, j) pair rotated at its own two positions."""
    index = torch.arange(q.shape[1])
    placement = rule.place(index, index)
    inv_freq = 1.0 / BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)

    def tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None] * inv_freq  # [Tq, Tk, d/2]
        return torch.cat((angles.cos(),) * 2, dim=-1), torch.cat((angles.sin(),) * 2, dim=-1)

    scaled = q * rule.query_scale(index)[None, :, None]
    queries = apply_rope(scaled[:, :, None, :], *tables(placement.query_position))  # [H, Tq, Tk, d]
    keys = apply_rope(k[:, None, :, :], *tables(placement.key_position))
    scores = (queries * keys).sum(dim=-1) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(~placement.seen, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def assert_matches(
    rule: AttentionRule, reference: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    ours = rule_attention(rule, q, k, v)
    assert ours.shape == reference.shape
    error = (ours - reference).abs().max().item()
    assert error <= TOLERANCE, f"{rule}: max |ours − reference| = {error:.3g}"


@pytest.mark.parametrize(
    ("length", "logn", "prefill"),
    [(40, None, None), (40, 8, None), (40, 8, 1), (40, 8, 20), (9, 8, None)],
)
def test_standard_matches_qwen(length: int, logn: int | None, prefill: int | None) -> None:
    q, k, v = qkv(length, seed=length)
    reference = logn_attention(q, k, v, base=BASE, seq_length=logn or NO_LOGN, prefill=prefill)
    assert_matches(StandardAttention(logn=logn), reference, q, k, v)


@pytest.mark.parametrize(
    ("group_size", "window", "length", "logn", "prefill"),
    [
        (4, 8, 40, None, None),
        (4, 8, 40, None, 1),  # almost all of it through their decode path
        (4, 8, 40, None, 9),  # the prefill just crosses the window
        (3, 7, 41, None, None),  # G does not divide W: the floor in W − ⌊W/G⌋
        (3, 7, 41, None, 7),
        (1, 5, 20, None, None),
        (2, 1, 20, None, None),  # only the diagonal is a neighbour
        (5, 16, 16, None, None),  # never grouped (d ≤ W − 1)
        (5, 16, 17, None, 3),  # one grouped pair, d = W
        (4, 8, 40, 12, None),
        (4, 8, 40, 12, 20),
    ],
)
def test_self_extend_matches_longlm(
    group_size: int, window: int, length: int, logn: int | None, prefill: int | None
) -> None:
    q, k, v = qkv(length, seed=group_size * 100 + window)
    reference = self_extend_attention(
        q, k, v, base=BASE, group_size=group_size, window=window, scale_base=logn or -1, prefill=prefill
    )
    assert_matches(SelfExtendAttention(group_size=group_size, window=window, logn=logn), reference, q, k, v)


@pytest.mark.parametrize(
    ("window", "length", "logn", "prefill"),
    [
        (8, 40, None, None),
        (8, 40, None, 1),
        (8, 40, None, 8),
        (1, 20, None, None),
        (16, 16, None, None),
        (16, 17, None, None),
        (8, 40, 12, None),
        (8, 40, 12, 15),
    ],
)
def test_rerope_matches_bojone(window: int, length: int, logn: int | None, prefill: int | None) -> None:
    q, k, v = qkv(length, seed=window * 100 + length)
    reference = rerope_attention(
        q, k, v, base=BASE, window=window, training_length=logn or NO_LOGN, prefill=prefill
    )
    assert_matches(ReRoPEAttention(window=window, logn=logn), reference, q, k, v)


@pytest.mark.parametrize(
    ("window", "leak", "length", "logn", "prefill"),
    [
        (8, 4, 40, None, None),
        (8, 4, 40, None, 1),
        (4, 1.5, 30, None, None),  # fractional leak: their table rows t / 1.5
        (4, 1.5, 30, None, 5),
        (1, 2, 20, None, None),
        (5, 1, 20, None, None),  # leak 1 is the standard rule
        (8, 16, 40, 10, None),
        (8, 16, 40, 10, 3),
    ],
)
def test_leaky_rerope_matches_bojone(
    window: int, leak: float, length: int, logn: int | None, prefill: int | None
) -> None:
    q, k, v = qkv(length, seed=window * 100 + length + int(leak * 10))
    reference = leaky_rerope_attention(
        q,
        k,
        v,
        base=BASE,
        window=window,
        scaling_factor=leak,
        training_length=logn or NO_LOGN,
        prefill=prefill,
    )
    assert_matches(LeakyReRoPEAttention(window=window, leak=leak, logn=logn), reference, q, k, v)


@pytest.mark.parametrize(
    ("chunk_size", "local_window", "length", "logn", "prefill"),
    [
        (12, 4, 50, None, None),  # c = 8: a partial last chunk
        (12, 4, 48, None, None),  # whole chunks only
        (12, 4, 50, None, 1),  # their decode path from the second token
        (12, 4, 50, None, 9),
        (12, 4, 50, None, 17),
        (8, 0, 33, None, None),  # no local window: c = s, the successive clamp never bites
        (10, 7, 40, None, None),  # c = 3 < l: the inter position 2c − 1 is below s
        (10, 7, 40, None, 4),
        (6, 2, 3, None, None),  # shorter than one chunk
        (5, 4, 12, None, 2),  # c = 1: every key its own chunk
        (12, 4, 50, 10, None),
        (12, 4, 50, 10, 20),
    ],
)
def test_dca_matches_chunkllama(
    chunk_size: int, local_window: int, length: int, logn: int | None, prefill: int | None
) -> None:
    q, k, v = qkv(length, seed=chunk_size * 100 + local_window)
    reference = dca_attention(
        q, k, v, base=BASE, chunk_size=chunk_size, local_window=local_window, logn=logn, prefill=prefill
    )
    assert_matches(
        DCAAttention(chunk_size=chunk_size, local_window=local_window, logn=logn), reference, q, k, v
    )


def test_dca_rule_leaves_out_chunkllamas_mscale() -> None:
    """ChunkLlama multiplies cos and sin by 0.05·ln(T / max_position_embeddings) + 1 once a text is
    longer than the model's max_position_embeddings; the SPEC's rule has no such factor, so the two
    agree up to that length and differ past it (a known disagreement, not a bug in either)."""
    q, k, v = qkv(30, seed=7)
    rule = DCAAttention(chunk_size=12, local_window=4)
    within = dca_attention(q, k, v, base=BASE, chunk_size=12, local_window=4, max_position_embeddings=30)
    assert_matches(rule, within, q, k, v)
    beyond = dca_attention(q, k, v, base=BASE, chunk_size=12, local_window=4, max_position_embeddings=10)
    assert (rule_attention(rule, q, k, v) - beyond).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("sink_tokens", "window", "length", "logn"),
    [
        (4, 8, 40, None),
        (0, 5, 30, None),  # no sinks: a sliding window over cache slots
        (2, 1, 20, None),
        (3, 16, 19, None),  # never trimmed
        (3, 16, 21, None),  # the first evicted key (query S + W + 1)
        (3, 16, 22, None),
        (0, 1, 10, None),
        (4, 8, 40, 6),
    ],
)
def test_streaming_matches_streaming_llm(
    sink_tokens: int, window: int, length: int, logn: int | None
) -> None:
    q, k, v = qkv(length, seed=sink_tokens * 100 + window)
    reference = streaming_attention(q, k, v, base=BASE, start_size=sink_tokens, recent_size=window, logn=logn)
    assert_matches(StreamingAttention(sink_tokens=sink_tokens, window=window, logn=logn), reference, q, k, v)


@pytest.mark.parametrize(
    "rule",
    [
        SelfExtendAttention(group_size=4, window=8),
        ReRoPEAttention(window=8),
        LeakyReRoPEAttention(window=8, leak=4),
        DCAAttention(chunk_size=12, local_window=4),
        StreamingAttention(sink_tokens=4, window=8),
        StandardAttention(logn=8),
    ],
    ids=lambda rule: rule.type,
)
def test_each_rule_changes_attention_past_its_boundary(rule: AttentionRule) -> None:
    """The parity tests are not vacuous: past the window every rule moves the outputs."""
    q, k, v = qkv(40, seed=3)
    difference = (rule_attention(rule, q, k, v) - rule_attention(StandardAttention(), q, k, v)).abs().max()
    assert difference > 1e-3


def pair(rule: AttentionRule, i: int, j: int) -> tuple[float, float, bool]:
    placement = rule.place(torch.tensor([i]), torch.tensor([j]))
    return placement.query_position.item(), placement.key_position.item(), bool(placement.seen.item())


def test_self_extend_boundary_and_floor_shift() -> None:
    rule = SelfExtendAttention(group_size=4, window=8)
    assert pair(rule, 20, 13) == (20, 13, True)  # d = W − 1: neighbour
    assert pair(rule, 20, 12) == (20 // 4 + 8 - 2, 3, True)  # d = W: grouped
    uneven = SelfExtendAttention(group_size=3, window=7)
    assert pair(uneven, 20, 13) == (20 // 3 + 7 - 7 // 3, 13 // 3, True)  # 11, not 6 + 7 − 7/3
    assert pair(rule, 5, 6)[2] is False


def test_rerope_and_leaky_boundaries() -> None:
    assert pair(ReRoPEAttention(window=5), 10, 6) == (10, 6, True)
    assert pair(ReRoPEAttention(window=5), 10, 5) == (5, 0, True)
    leaky = LeakyReRoPEAttention(window=4, leak=2)
    assert pair(leaky, 10, 7) == (10, 7, True)
    assert pair(leaky, 10, 6) == (7.0, 3.0, True)  # continuous: distance still 4 at d = w
    assert pair(leaky, 10, 5) == (7.0, 2.5, True)  # then half a position per token


def test_dca_chunk_relations_and_clamps() -> None:
    rule = DCAAttention(chunk_size=12, local_window=4)  # c = 8
    assert pair(rule, 17, 16) == (1, 0, True)  # same chunk
    assert pair(rule, 17, 15) == (9, 7, True)  # next chunk: i mod c + c
    assert pair(rule, 21, 15) == (12, 7, True)  # ... clamped at s
    assert pair(rule, 17, 7) == (12, 7, True)  # farther: min(2c − 1, s)
    assert pair(DCAAttention(chunk_size=10, local_window=7), 9, 2) == (5, 2, True)  # 2c − 1 < s


def test_streaming_window_counts_the_keys_before_the_query() -> None:
    rule = StreamingAttention(sink_tokens=2, window=3)
    placement = rule.place(torch.tensor([10]), torch.arange(12))
    assert placement.seen[0].nonzero().flatten().tolist() == [0, 1, 7, 8, 9, 10]  # S + W + 1 keys
    seen = placement.seen[0]
    assert placement.key_position[0][seen].tolist() == [0, 1, 2, 3, 4, 5]
    assert set(placement.query_position[0][seen].tolist()) == {5.0}
    assert pair(rule, 4, 1) == (4, 1, True)  # before the cache fills: positions are indices


def test_logn_scale() -> None:
    scale = logn_scale(torch.arange(10), 8)
    assert scale[:8].tolist() == [1.0] * 8
    assert scale[8].item() == pytest.approx(math.log(9) / math.log(8))
    assert logn_scale(torch.arange(3), None).tolist() == [1.0, 1.0, 1.0]


def test_positions_need_integer_indices() -> None:
    with pytest.raises(ValueError, match="query_index"):
        StandardAttention().place(torch.arange(3.0), torch.arange(3))


EXAMPLES: list[tuple[str, dict[str, Any]]] = [
    ("standard", {"type": "standard"}),
    ("standard:logn=4096", {"type": "standard", "logn": 4096}),
    ("self_extend:group_size=4,window=1024", {"type": "self_extend", "group_size": 4, "window": 1024}),
    ("rerope:window=512,logn=4096", {"type": "rerope", "window": 512, "logn": 4096}),
    ("leaky_rerope:window=512,leak=16", {"type": "leaky_rerope", "window": 512, "leak": 16.0}),
    ("leaky_rerope:window=4,leak=1.5", {"type": "leaky_rerope", "window": 4, "leak": 1.5}),
    ("dca:chunk_size=6144,local_window=0", {"type": "dca", "chunk_size": 6144, "local_window": 0}),
    ("streaming: sink_tokens=4, window=1020", {"type": "streaming", "sink_tokens": 4, "window": 1020}),
]


@pytest.mark.parametrize(("spec", "resolved"), EXAMPLES)
def test_spec_and_dict_forms_agree_and_echo(spec: str, resolved: dict[str, Any]) -> None:
    rule = parse_attention_spec(spec)
    assert rule.to_dict() == resolved
    assert list(rule.to_dict()) == list(resolved)  # type first, logn last
    assert parse_attention(resolved) == rule
    assert hash(parse_attention(rule.to_dict())) == hash(rule)


def test_every_type_parses() -> None:
    assert {parse_attention_spec(spec).type for spec, _ in EXAMPLES} == set(ATTENTION_TYPES)


def test_parsing_canonicalises() -> None:
    assert parse_attention({}) == StandardAttention()
    assert parse_attention({"type": "rerope", "window": 8.0, "logn": None}) == ReRoPEAttention(window=8)
    assert isinstance(parse_attention({"type": "rerope", "window": 8.0}).to_dict()["window"], int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ReRoPEAttention(window=8).window = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"type": "yarn"}, "type"),
        ({"type": 3}, "type"),
        ({"type": "self_extend", "window": 8}, "group_size"),
        ({"type": "self_extend", "group_size": 0, "window": 8}, "group_size"),
        ({"type": "self_extend", "group_size": 4, "window": 0}, "window"),
        ({"type": "self_extend", "group_size": 4, "window": 2.5}, "window"),
        ({"type": "self_extend", "group_size": 4, "window": True}, "window"),
        ({"type": "self_extend", "group_size": 4, "window": "8"}, "window"),
        ({"type": "self_extend", "group_size": 4, "window": 10**9}, "window"),
        ({"type": "self_extend", "group_size": 4, "window": 8, "group": 2}, "group"),
        ({"type": "rerope", "window": 8, "group_size": 2}, "group_size"),
        ({"type": "rerope", "window": 8, "logn": 1}, "logn"),
        ({"type": "rerope", "window": 8, "logn": float("nan")}, "logn"),
        ({"type": "leaky_rerope", "window": 8, "leak": 0.5}, "leak"),
        ({"type": "leaky_rerope", "window": 8, "leak": float("inf")}, "leak"),
        ({"type": "leaky_rerope", "window": 8}, "leak"),
        ({"type": "dca", "chunk_size": 8, "local_window": 8}, "local_window"),
        ({"type": "dca", "chunk_size": 8, "local_window": -1}, "local_window"),
        ({"type": "dca", "chunk_size": 0, "local_window": 0}, "chunk_size"),
        ({"type": "streaming", "sink_tokens": -1, "window": 8}, "sink_tokens"),
        ({"type": "streaming", "sink_tokens": 4, "window": 0}, "window"),
        ({"type": "standard", "window": 8}, "window"),
    ],
)
def test_bad_dicts_name_the_field(value: dict[str, Any], field: str) -> None:
    with pytest.raises(PEConfigError) as raised:
        parse_attention(value)
    assert raised.value.field == field
    assert field in raised.value.message


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ("bogus:window=3", "type"),
        ("self_extend:group_size=4,window=x", "window"),
        ("self_extend:group_size=4,group_size=8,window=8", "group_size"),
        ("self_extend:group_size,window=8", "group_size"),
        ("self_extend:group_size=,window=8", "group_size"),
        ("self_extend:group_size=4,window=nan", "window"),
        ("streaming:sink_tokens=4,window=8,type=dca", "type"),
    ],
)
def test_bad_specs_name_the_field(spec: str, field: str) -> None:
    with pytest.raises(PEConfigError) as raised:
        parse_attention_spec(spec)
    assert raised.value.field == field


def test_constructors_validate_too() -> None:
    with pytest.raises(PEConfigError) as raised:
        SelfExtendAttention(group_size=0, window=4)
    assert raised.value.field == "group_size"
    with pytest.raises(PEConfigError) as raised:
        StreamingAttention(sink_tokens=0, window=4, logn=0)
    assert raised.value.field == "logn"


@pytest.mark.parametrize(
    "rule",
    [
        StandardAttention(),
        SelfExtendAttention(group_size=3, window=7),
        SelfExtendAttention(group_size=4, window=8),
        ReRoPEAttention(window=5),
        LeakyReRoPEAttention(window=6, leak=2.5),
        DCAAttention(chunk_size=12, local_window=4),
        DCAAttention(chunk_size=7, local_window=0),
        StreamingAttention(sink_tokens=4, window=8),
        StreamingAttention(sink_tokens=0, window=3),
    ],
    ids=lambda rule: f"{rule.type}-{'-'.join(str(value) for value in rule.to_dict().values())}",
)
def test_branches_partition_the_seen_pairs_at_the_placements_distances(rule: AttentionRule) -> None:
    """What the backends compute (`branches`) is the rule (`place`): every seen pair is selected by
    exactly one branch, no unseen pair by any, and each pair's query − key position difference (all
    that RoPE and ALiBi read) is the placement's. Queries start mid-text, as in a decode step."""
    queries, keys = torch.arange(17, 45), torch.arange(45)
    placement = rule.place(queries, keys)
    branches = rule.branches(queries, keys)
    selections = torch.stack([branch.selected for branch in branches])
    assert torch.equal(selections.sum(0), placement.seen.long())
    expected = placement.query_position - placement.key_position
    for branch in branches:
        distance = branch.query_position[:, None] - branch.key_position[None, :]
        assert torch.allclose(distance[branch.selected], expected[branch.selected], atol=1e-12)
