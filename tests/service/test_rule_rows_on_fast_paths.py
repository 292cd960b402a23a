"""Rows under an attention rule on the fast paths.

- Streaming rows decode in the C pass (`service.model.streaming_rows`): the row's masked slots and
  its sinks read by a query turned back must give the authors' StreamingLLM (mit-han-lab/streaming-llm,
  ported in float64 in `tests/references/streaming.py`), and what the model's own layers give, while
  the row gives back the blocks that leave its window.
- Any rule's row runs as a plain one while its queries sit below the rule's `standard_below`
  (`PassRows.as_run`, `ChunkedScorer`): the bound is where the rule's own placement first differs
  from standard, and a text crossing it still gives the authors' numbers.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.runner import ModelRunner, PassRows
from service.engine.scoring import ChunkedScorer, cached_positions
from service.model.attention_rules import (
    AttentionRule,
    DCAAttention,
    LeakyReRoPEAttention,
    ReRoPEAttention,
    SelfExtendAttention,
    StandardAttention,
    StreamingAttention,
    standard_positions,
)
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.kernels import batch_pass
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from service.model.transformer import Transformer
from tests.references.dca import dca_attention
from tests.references.self_extend import self_extend_attention
from tests.references.streaming import streaming_attention
from tests.service.test_attention_model import BASE, PROMPT, assert_close, model, reference_logprobs, text
from tests.service.test_fast_decode import pool_for

pytestmark = pytest.mark.skipif(not batch_pass.available(), reason="the C batch pass is not built here")

RULES = [
    StreamingAttention(sink_tokens=4, window=16),
    StreamingAttention(sink_tokens=20, window=8),  # sinks over two blocks
    StreamingAttention(sink_tokens=0, window=12),
]


def _slid(pool: PagedKVCache, rows: list[PagedRow], rules: list[AttentionRule | None]) -> PagedRows:
    """The rows after the streaming ones gave back what left their window (as the engine does
    before each decode pass)."""
    for row, rule in zip(rows, rules, strict=True):
        if isinstance(rule, StreamingAttention):
            pool.slide(row, head=rule.sink_tokens, window=rule.window, room=1)
    return PagedRows(pool, rows)


def _generate(
    tiny: Transformer,
    texts: list[list[int]],
    rules: list[AttentionRule | None],
    *,
    in_c: bool,
    scaling: RopeScaling | None = None,
) -> list[torch.Tensor]:
    """Each text's log-probabilities [T − PROMPT + 1, V] after its prompt: the prompts in one eager
    pass, then one token per row per pass, in C (`FastDecoder.decode`) or on the model's layers."""
    pool = pool_for(tiny)
    rows = [pool.allocate(PROMPT + 1) for _ in texts]
    scalings = [scaling or RopeScaling()] * len(texts)
    decoder = FastDecoder(tiny, pool, Backend.C, max_window=128)
    outputs: list[list[torch.Tensor]] = [[] for _ in texts]
    with torch.inference_mode():
        prompts = torch.tensor([tokens[:PROMPT] for tokens in texts])
        logits = tiny(prompts, scaling=scalings, cache=PagedRows(pool, rows), attention=rules)[:, -1]
        for step in range(PROMPT, len(texts[0])):
            for row, row_logits in enumerate(logits):
                outputs[row].append(torch.log_softmax(row_logits.double(), dim=-1))
            view = _slid(pool, rows, rules)
            tokens = [tokens[step] for tokens in texts]
            if in_c:
                logits = decoder.decode(view, tokens, scalings, rules)
            else:
                logits = tiny(torch.tensor(tokens)[:, None], scaling=scalings, cache=view, attention=rules)[
                    :, -1
                ]
    return [torch.stack(row) for row in outputs]


@pytest.mark.parametrize(
    "rule", RULES, ids=[f"sinks{rule.sink_tokens}-window{rule.window}" for rule in RULES]
)
def test_a_streaming_row_in_c_equals_the_authors_and_the_models_own_layers(rule: StreamingAttention) -> None:
    tiny = model()
    tokens = text(3)
    reference = reference_logprobs(
        tiny,
        tokens,
        partial(streaming_attention, base=BASE, start_size=rule.sink_tokens, recent_size=rule.window),
    )[PROMPT - 1 : -1]
    (in_c,) = _generate(tiny, [tokens], [rule], in_c=True)
    (eager,) = _generate(tiny, [tokens], [rule], in_c=False)
    assert_close(in_c, reference, f"{rule} in C")
    assert (in_c - eager).abs().max().item() <= 1e-5
    plain = reference_logprobs(
        tiny, tokens, partial(streaming_attention, base=BASE, start_size=0, recent_size=10**6)
    )
    assert (in_c - plain[PROMPT - 1 : -1]).abs().max() > 1e-2, "the window must matter at this length"


def test_a_streaming_row_under_yarn_turns_its_sinks_with_the_rows_frequencies() -> None:
    """The sinks' turn uses the row's own inverse frequencies (YaRN's, here) and unit cos/sin (the
    table's attention factor is already in the query): in C as on the model's layers."""
    tiny = model()
    yarn = RopeScaling.from_hf(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        max_position_embeddings=tiny.config.native_context,
    )
    rule = RULES[0]
    tokens = text(5)
    (in_c,) = _generate(tiny, [tokens], [rule], in_c=True, scaling=yarn)
    (eager,) = _generate(tiny, [tokens], [rule], in_c=False, scaling=yarn)
    (plain_scaling,) = _generate(tiny, [tokens], [rule], in_c=True)
    assert (in_c - eager).abs().max().item() <= 1e-5
    assert (in_c - plain_scaling).abs().max().item() > 1e-3, "YaRN must change the outputs"


def test_streaming_and_plain_rows_in_one_c_pass_equal_each_alone() -> None:
    tiny = model()
    rules: list[AttentionRule | None] = [*RULES, None]
    texts = [text(seed) for seed in range(len(rules))]
    together = _generate(tiny, texts, rules, in_c=True)
    for row, (tokens, rule) in enumerate(zip(texts, rules, strict=True)):
        (alone,) = _generate(tiny, [tokens], [rule], in_c=True)
        assert (together[row] - alone).abs().max().item() <= 1e-5, f"{rule}: mixed vs alone"


def test_the_runner_decodes_streaming_rows_in_c_and_other_rules_on_the_layers() -> None:
    """A decode pass of a streaming row, a plain row and a Self-Extend row: the model's own forward
    runs once, for the Self-Extend row alone."""
    tiny = model()
    pool = pool_for(tiny)
    runner = ModelRunner(tiny, pool, FastDecoder(tiny, pool, Backend.C, max_window=128))
    rules: list[AttentionRule | None] = [RULES[0], None, SelfExtendAttention(group_size=3, window=10)]
    rows = [pool.allocate(PROMPT + 1) for _ in rules]
    texts = [text(seed) for seed in range(len(rules))]
    scalings = [RopeScaling()] * len(rules)
    with torch.inference_mode():
        prompts = torch.tensor([tokens[:PROMPT] for tokens in texts])
        tiny(prompts, scaling=scalings, cache=PagedRows(pool, rows), attention=rules)
    eager_rows: list[int] = []
    hook = tiny.register_forward_pre_hook(lambda _, args: eager_rows.append(args[0].shape[0]))
    try:
        chunks: list[tuple[int, ...]] = [(tokens[PROMPT],) for tokens in texts]
        passed = PassRows(rows, chunks, scalings, rules, [PROMPT + 1] * 3, [1] * 3)
        result = runner.run(passed, PagedRows(pool, rows), decode=True)
    finally:
        hook.remove()
    assert sorted(result.rows) == [0, 1, 2] and not result.failed
    assert eager_rows == [1], "only the Self-Extend row runs on the model's own layers"


BOUNDED: list[AttentionRule] = [
    StandardAttention(logn=16),
    SelfExtendAttention(group_size=3, window=10),
    SelfExtendAttention(group_size=4, window=8, logn=6),
    ReRoPEAttention(window=12),
    LeakyReRoPEAttention(window=10, leak=4),
    DCAAttention(chunk_size=24, local_window=8),
    StreamingAttention(sink_tokens=4, window=16),
    StreamingAttention(sink_tokens=0, window=5),
]


@pytest.mark.parametrize("rule", BOUNDED, ids=[str(rule.to_dict()) for rule in BOUNDED])
def test_standard_below_is_where_the_rules_own_placement_first_differs(rule: AttentionRule) -> None:
    """Below the bound every query sees the keys standard sees, at the same distances, unscaled;
    within a few queries past it one does not (Self-Extend's first grouped key may still land at
    its own distance, so the bound may be a little early, never late)."""
    bound = rule.standard_below
    index = torch.arange(bound + 4)
    placed, plain = rule.place(index, index), standard_positions(index, index)
    scale = rule.query_scale(index)

    def as_standard(query: int) -> bool:
        seen = plain.seen[query]
        distances = (placed.query_position - placed.key_position)[query][seen]
        plain_distances = (plain.query_position - plain.key_position)[query][seen]
        return (
            torch.equal(placed.seen[query], seen)
            and torch.equal(distances, plain_distances)
            and scale[query].item() == 1.0
        )

    assert all(as_standard(query) for query in range(bound))
    assert not all(as_standard(query) for query in range(bound, bound + 4))


def test_a_rule_row_runs_as_a_plain_one_until_its_text_reaches_the_bound() -> None:
    """Self-Extend with a window of 10 after a 6-token prompt: the prompt and the steps whose query
    sits below 10 run in C, the later ones on the model's layers; every token is the authors'."""
    rule = SelfExtendAttention(group_size=3, window=10)
    tiny = model()
    pool = pool_for(tiny)
    runner = ModelRunner(tiny, pool, FastDecoder(tiny, pool, Backend.C, max_window=128))
    tokens = text(6)[:24]
    prompt = 6
    row = pool.allocate(len(tokens))
    eager: list[int] = []
    hook = tiny.register_forward_pre_hook(lambda _, args: eager.append(args[0].shape[1]))
    outputs = []
    try:
        passes = [(0, prompt), *((step, step + 1) for step in range(prompt, len(tokens)))]
        for begin, end in passes:
            chunk = tuple(tokens[begin:end])
            passed = PassRows([row], [chunk], [RopeScaling()], [rule], [end], [end - begin])
            result = runner.run(passed, PagedRows(pool, [row]), decode=begin >= prompt)
            assert not result.failed
            outputs.append(torch.log_softmax(result.logits[0].double(), dim=-1))
    finally:
        hook.remove()
    eager_passes = len(tokens) - rule.window  # queries at 10 .. 23, one per pass
    assert eager == [1] * eager_passes
    reference = reference_logprobs(
        tiny, tokens, partial(self_extend_attention, base=BASE, group_size=3, window=10)
    )[prompt - 1 :]
    assert_close(torch.stack(outputs), reference, "across the bound")


def test_a_scored_text_runs_its_chunks_below_the_bound_in_c() -> None:
    rule = DCAAttention(chunk_size=24, local_window=8)  # plain below 25
    tiny = model()
    pool = pool_for(tiny)
    tokens = text(7)
    rows = PagedRows(pool, [pool.allocate(cached_positions(tokens))])
    decoder = FastDecoder(tiny, pool, Backend.C, max_window=128)
    scorer = ChunkedScorer(tiny, tokens, rows, fast=decoder, attention=rule)
    while scorer.remaining:
        scorer.advance(24)  # chunks of 22-23 tokens: the first ends below 25, the others past it
    assert scorer.positions_by_path == {"c": 23, "eager": cached_positions(tokens) - 23}
    reference = reference_logprobs(
        tiny, tokens, partial(dca_attention, base=BASE, chunk_size=24, local_window=8)
    )
    expected = reference[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    served = torch.tensor(scorer.result()[1:], dtype=torch.float64)
    assert (served - expected).abs().max().item() <= 2e-4
