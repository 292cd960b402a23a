"""Streaming rows decoded in the C pass (`service.model.streaming_rows`): the row's masked slots and
its sinks read by a query turned back must give the authors' StreamingLLM (mit-han-lab/streaming-llm,
ported in float64 in `tests/references/streaming.py`), and what the model's own layers give, while
the row gives back the blocks that leave its window."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.runner import ModelRunner, PassRows
from service.model.attention_rules import AttentionRule, SelfExtendAttention, StreamingAttention
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.kernels import batch_pass
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from service.model.transformer import Transformer
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
    tiny: Transformer, texts: list[list[int]], rules: list[AttentionRule | None], *, in_c: bool
) -> list[torch.Tensor]:
    """Each text's log-probabilities [T − PROMPT + 1, V] after its prompt: the prompts in one eager
    pass, then one token per row per pass, in C (`FastDecoder.decode`) or on the model's layers."""
    pool = pool_for(tiny)
    rows = [pool.allocate(PROMPT + 1) for _ in texts]
    scalings = [RopeScaling()] * len(texts)
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
