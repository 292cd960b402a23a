"""The paged KV pool and the decode pass, against a full pass over the same tokens.

Rows of different lengths and scalings decode together, across the native context (16) and a
window bucket boundary (64), while others join and leave; every step's logits must equal each
row's own full forward pass. The pure step runs uncompiled for every scheme and scaling (the
reference path), and compiled for a mixed RoPE batch and inside the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pe_runtime import RopeScaling
from service.engine.core import DecodeSettings
from service.engine.engine import InferenceEngine, load_models
from service.engine.types import GenerationRequest, GenerationResult, SamplingParams
from service.model.backend import Backend
from service.model.fast_decode import FastDecoder
from service.model.kernels import batch_pass
from service.model.paged_cache import PagedKVCache, PagedRow, PagedRows
from service.model.refresh import recompute_row, stale_rows
from service.model.transformer import Transformer
from tests.conftest import TINY_CONFIG, TinyCheckpointFactory, rope_scalings, tiny_transformer
from tests.kernels import require_kernel, torch_threads

NATIVE = 16
TOLERANCE = 1e-4
SCALINGS = rope_scalings(NATIVE, rotary_dim=TINY_CONFIG["d_model"] // TINY_CONFIG["n_heads"])
WIDE_HEAD = 16  # the kernel's vector path takes heads a multiple of 16 wide
WIDE_SCALINGS = rope_scalings(NATIVE, rotary_dim=WIDE_HEAD)  # LongRoPE's factors follow the head
LINEAR = RopeScaling(type="linear", factor=4.0)
NONE = RopeScaling()
PROMPTS = (3, 20, 41, 58)  # the longest crosses position 64 (a second window bucket) in 8 steps
STEPS = 8

SCHEME_CASES: list[tuple[str, dict[str, Any], list[RopeScaling]]] = [
    ("rope", {"pe": "rope"}, list(SCALINGS.values())),
    ("rope-gptj-partial", {"pe": "rope", "rope_layout": "gptj", "rotary_fraction": 0.5}, [NONE, LINEAR]),
    ("learned", {"pe": "learned", "native_context": 128}, [NONE, RopeScaling(type="linear", factor=2.0)]),
    ("sinusoidal", {"pe": "sinusoidal"}, [NONE, LINEAR]),
    ("alibi", {"pe": "alibi"}, [NONE]),
    ("rope_alibi", {"pe": "rope_alibi"}, list(SCALINGS.values())),
    ("t5_bias", {"pe": "t5_bias", "t5_num_buckets": 8, "t5_max_distance": 20}, [NONE]),
    ("nope", {"pe": "nope"}, [NONE]),
]


def pool_for(model: Transformer, tokens: int = 4096) -> PagedKVCache:
    weight = model.embed_tokens.weight
    return PagedKVCache.within(model.config, 0, min_tokens=tokens, device=weight.device, dtype=weight.dtype)


def prefill(model: Transformer, pool: PagedKVCache, prompt: list[int], scaling: RopeScaling) -> PagedRow:
    row = pool.allocate(len(prompt) + STEPS + 1)
    with torch.inference_mode():
        model(
            torch.tensor([prompt], device=pool.keys[0].device),
            scaling=[scaling],
            cache=PagedRows(pool, [row]),
        )
    return row


def full_pass_logits(
    model: Transformer, rows: Sequence[PagedRow], feed: list[int], scalings: list[RopeScaling]
) -> torch.Tensor:
    device = model.embed_tokens.weight.device
    with torch.inference_mode():
        return torch.stack(
            [
                model(torch.tensor([[*row.tokens, token]], device=device), scaling=[scaling], last_n=1)[
                    0, -1
                ].float()
                for row, token, scaling in zip(rows, feed, scalings, strict=True)
            ]
        )


def decode_and_compare(
    model: Transformer,
    decoder: FastDecoder,
    scalings: list[RopeScaling],
    changes: dict[int, tuple[int, int]] | None = None,
) -> float:
    """Decode `STEPS` tokens for rows of `PROMPTS` lengths; the worst logit gap to the full pass.

    `changes` says, by step, how many rows leave (the second row, each time) and how many new
    ones join; by default one of each after half the steps, as in a running batch.
    """
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPTS]
    row_scalings = [scalings[i % len(scalings)] for i in range(len(prompts))]
    rows = [prefill(model, decoder.pool, p, s) for p, s in zip(prompts, row_scalings, strict=True)]
    feed = [prompt[-1] for prompt in prompts]
    worst = 0.0
    for step in range(STEPS):
        leaving, joining = (changes or {STEPS // 2: (1, 1)}).get(step, (0, 0))
        for _ in range(leaving):
            decoder.pool.release(rows.pop(1))
            feed.pop(1)
            row_scalings.pop(1)
        for _ in range(joining):
            newcomer = torch.randint(0, 256, (9,), generator=generator).tolist()
            rows.append(prefill(model, decoder.pool, newcomer, scalings[-1]))
            feed.append(newcomer[-1])
            row_scalings.append(scalings[-1])
        view = PagedRows(decoder.pool, rows)
        lengths = [row.length + 1 for row in rows]
        with torch.inference_mode():
            for stale in stale_rows(model, view, row_scalings, lengths):
                recompute_row(model, view, stale, row_scalings[stale], lengths[stale])
        expected = full_pass_logits(model, rows, feed, row_scalings)
        logits = decoder.decode(view, feed, row_scalings)
        worst = max(worst, float((logits - expected).abs().max()))
        feed = logits.argmax(dim=-1).tolist()
    return worst


@pytest.mark.parametrize("path", ["torch", "kernels", "kernels-2-threads"])
@pytest.mark.parametrize(
    ("overrides", "scalings"), [case[1:] for case in SCHEME_CASES], ids=[case[0] for case in SCHEME_CASES]
)
def test_reference_step_equals_the_full_pass(
    overrides: dict[str, Any], scalings: list[RopeScaling], path: str
) -> None:
    """Both paths of batches: torch's, and the C kernels (attention on its vector path: 16-wide
    heads), on one thread and sharing the pass among two."""
    overrides = dict(overrides)  # the case's own dict is shared by both paths
    kernel = path.startswith("kernels")
    if kernel:
        require_kernel(batch_pass.available, "batch step")
    heads = {"head_dim_override": WIDE_HEAD} if kernel else {}
    if kernel:
        wide = {id(narrow): WIDE_SCALINGS[name] for name, narrow in SCALINGS.items()}
        scalings = [wide.get(id(scaling), scaling) for scaling in scalings]
    model = tiny_transformer(native_context=overrides.pop("native_context", NATIVE), **overrides, **heads)
    backend = Backend.C if kernel else Backend.COMPILED
    decoder = FastDecoder(model, pool_for(model), backend, max_window=128, inductor=False)
    with torch_threads(2 if path == "kernels-2-threads" else 1):
        assert decode_and_compare(model, decoder, scalings) < TOLERANCE


def written_entries(pool: PagedKVCache, row: PagedRow) -> torch.Tensor:
    """Every layer's cached keys and values of the row's positions, [2 * layers, Hkv, L, hd]."""
    positions = torch.arange(row.length)
    blocks = torch.tensor(row.blocks)[positions // pool.block_size]
    offsets = positions % pool.block_size
    return torch.stack([pages[:, blocks, offsets] for pages in pool.keys + pool.values])


@pytest.mark.parametrize(
    ("overrides", "scalings"), [case[1:] for case in SCHEME_CASES], ids=[case[0] for case in SCHEME_CASES]
)
@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize("counts", [(12, 9, 12, 6), (1, 1, 1, 1)], ids=["chunks", "one-token-chunks"])
def test_prompt_chunks_in_c_equal_the_eager_pass(
    overrides: dict[str, Any], scalings: list[RopeScaling], threads: int, counts: tuple[int, ...]
) -> None:
    """A second prompt chunk, rows of different pasts and counts padded to one width, run as rows of
    the C step: the same logits, row state and cached entries as the eager pass writes, also with
    the pass shared among two threads (a chunk's rows attend in any order). One token per row runs
    as a decode step, read with each prompt's table rather than one for the row's length."""
    require_kernel(batch_pass.available, "batch step")
    overrides = dict(overrides)
    model = tiny_transformer(native_context=overrides.pop("native_context", NATIVE), **overrides)
    decoder = FastDecoder(model, pool_for(model), Backend.C, max_window=128)
    eager_pool = pool_for(model)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (30, 12, 50, 7)]
    firsts, width = (9, 3, 20, 1), max(counts)  # 12 wide: rows 2 and 4 padded
    row_scalings = [scalings[i % len(scalings)] for i in range(len(prompts))]
    table_lengths = [len(prompt) for prompt in prompts]
    views = []
    for pool in (eager_pool, decoder.pool):
        rows = [pool.allocate(len(prompt) + 1) for prompt in prompts]
        first = max(firsts)
        tokens = [prompt[:n] + [0] * (first - n) for prompt, n in zip(prompts, firsts, strict=True)]
        with torch.inference_mode():
            model(
                torch.tensor(tokens),
                scaling=row_scalings,
                cache=PagedRows(pool, rows),
                table_lengths=table_lengths,
                counts=list(firsts),
            )
        views.append(PagedRows(pool, rows))
    chunks = [
        tuple(prompt[n : n + count]) + (0,) * (width - count)
        for prompt, n, count in zip(prompts, firsts, counts, strict=True)
    ]
    assert decoder.prefills(views[1].lengths, counts)
    with torch.inference_mode():
        expected = model(
            torch.tensor(chunks),
            scaling=row_scalings,
            cache=views[0],
            table_lengths=table_lengths,
            counts=list(counts),
        )[:, -1].float()
    with torch_threads(threads):
        logits = decoder.prefill(views[1], chunks, counts, row_scalings, table_lengths)
    assert float((logits - expected).abs().max()) < TOLERANCE
    for eager_row, row in zip(views[0].rows, views[1].rows, strict=True):
        assert (row.length, row.tokens, row.table_key) == (
            eager_row.length,
            eager_row.tokens,
            eager_row.table_key,
        )
        gap = written_entries(decoder.pool, row) - written_entries(eager_pool, eager_row)
        assert float(gap.abs().max()) < TOLERANCE


@pytest.mark.parametrize("threads", [1, 2], ids=["1-thread", "2-threads"])
@pytest.mark.parametrize(
    "heads",
    [
        {"n_heads": 6, "n_kv_heads": 2, "head_dim_override": 32},  # groups of 3: tiles of whole tokens
        {"n_heads": 4, "n_kv_heads": 4, "head_dim_override": 16},
    ],
    ids=["gqa", "mha"],
)
def test_long_prompt_chunks_attend_in_tiles_as_the_eager_pass(heads: dict[str, int], threads: int) -> None:
    """Runs longer than a tile, starting mid-block after different pasts, with a one-token run
    among them: the tiled attention (`chunk_attention.h`) gives the eager pass's logits and
    cached entries."""
    require_kernel(batch_pass.available, "batch step")
    model = tiny_transformer(native_context=NATIVE, pe="rope", **heads)
    decoder = FastDecoder(model, pool_for(model), Backend.C, max_window=256)
    assert decoder.c_pass is not None and decoder.c_pass.tiles_chunks
    eager_pool = pool_for(model)
    generator = torch.Generator().manual_seed(7)
    pasts, counts = (5, 37, 90), (101, 64, 1)
    prompts = [
        torch.randint(0, 256, (past + count,), generator=generator).tolist()
        for past, count in zip(pasts, counts, strict=True)
    ]
    scalings = [NONE, LINEAR, WIDE_SCALINGS["yarn"]]
    views = []
    for pool in (eager_pool, decoder.pool):
        rows = [pool.allocate(len(prompt) + 1) for prompt in prompts]
        view = PagedRows(pool, rows)
        tokens = [
            prompt[:past] + [0] * (max(pasts) - past) for prompt, past in zip(prompts, pasts, strict=True)
        ]
        with torch.inference_mode():
            model(
                torch.tensor(tokens),
                scaling=scalings,
                cache=view,
                table_lengths=[len(p) for p in prompts],
                counts=list(pasts),
            )
        views.append(view)
    chunks = [
        tuple(prompt[past:]) + (0,) * (max(counts) - count)
        for prompt, past, count in zip(prompts, pasts, counts, strict=True)
    ]
    table_lengths = [len(prompt) for prompt in prompts]
    heads_of = (model.config.n_heads, model.config.n_kv_heads)
    assert decoder.prefills(views[1].lengths, counts)
    assert [batch_pass.run_tiled(count, *heads_of) for count in counts] == [True, True, False]
    with torch.inference_mode():
        expected = model(
            torch.tensor(chunks),
            scaling=scalings,
            cache=views[0],
            table_lengths=table_lengths,
            counts=list(counts),
        )[:, -1].float()  # each row at its last real token
    with torch_threads(threads):
        logits = decoder.prefill(views[1], chunks, counts, scalings, table_lengths)
    assert float((logits - expected).abs().max()) < TOLERANCE
    for eager_row, row in zip(views[0].rows, views[1].rows, strict=True):
        gap = written_entries(decoder.pool, row) - written_entries(eager_pool, eager_row)
        assert float(gap.abs().max()) < TOLERANCE


def test_a_run_of_a_few_tokens_attends_row_by_row() -> None:
    """A tile costs all its lanes however few tokens fill it: a run of 2 tokens (a cached
    prompt's last ones) took twice a decode step in tiles, so it attends row by row; a run that
    fills half a tile or more attends in tiles (the chunk tests above check both against the
    eager pass, side by side in one pass)."""
    require_kernel(batch_pass.available, "batch step")
    for heads, kv_heads in ((9, 3), (6, 2), (4, 4)):
        tiled = [rows for rows in range(1, 200) if batch_pass.run_tiled(rows, heads, kv_heads)]
        smallest = tiled[0]
        assert tiled == list(range(smallest, 200))  # from half a tile up
        assert 2 < smallest <= 24 and not batch_pass.run_tiled(2, heads, kv_heads)


def test_prompt_chunks_past_the_window_or_off_the_c_backend_run_eager() -> None:
    model = tiny_transformer(native_context=NATIVE, pe="rope")
    compiled = FastDecoder(model, pool_for(model), Backend.COMPILED, inductor=False)
    assert compiled.c_pass is None and not compiled.prefills([0], [8])
    require_kernel(batch_pass.available, "batch step")
    decoder = FastDecoder(model, pool_for(model), Backend.C, max_window=64)
    assert decoder.prefills([40, 0], [24, 5]) and not decoder.prefills([40, 0], [25, 5])


def test_compiled_step_equals_the_full_pass_for_a_mixed_batch() -> None:
    """The compiled torch step (GPUs, other dtypes, more threads), for lone rows and batches."""
    model = tiny_transformer(native_context=NATIVE, pe="rope")
    decoder = FastDecoder(model, pool_for(model), Backend.COMPILED, max_window=128)
    assert decode_and_compare(model, decoder, list(SCALINGS.values())) < TOLERANCE


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_step_on_cuda_equals_the_full_pass() -> None:
    model = tiny_transformer(native_context=NATIVE, pe="rope").cuda()
    decoder = FastDecoder(model, pool_for(model), Backend.COMPILED, max_window=128)
    assert decode_and_compare(model, decoder, list(SCALINGS.values())) < TOLERANCE


# Batches of 4, 3, 5 and 4 rows, the last two steps in the next window: graphs of 4 and 8 rows
# with padding rows, and a smaller batch after a larger one, whose padding rows must not write into
# the blocks the larger batch's rows had there.
GRAPH_CHANGES = {2: (1, 0), 4: (0, 2), 6: (1, 0)}


def uncaptured_graphs(model: Transformer, max_batch: int) -> FastDecoder:
    """The CUDA graphs' buffers and padding over the uncompiled torch step, without a capture."""
    return FastDecoder(
        model, pool_for(model), Backend.CUDA_GRAPHS, max_window=128, max_batch=max_batch, inductor=False
    )


@pytest.mark.parametrize(
    ("overrides", "scalings"), [case[1:] for case in SCHEME_CASES], ids=[case[0] for case in SCHEME_CASES]
)
def test_graph_buffers_and_padding_equal_the_full_pass(
    overrides: dict[str, Any], scalings: list[RopeScaling]
) -> None:
    """The CUDA graphs' static buffers and padded buckets, uncaptured on a CPU."""
    overrides = dict(overrides)
    model = tiny_transformer(native_context=overrides.pop("native_context", NATIVE), **overrides)
    decoder = uncaptured_graphs(model, max_batch=8)
    assert decoder.graphs is not None and not decoder.graphs.capture
    assert decode_and_compare(model, decoder, scalings, GRAPH_CHANGES) < TOLERANCE
    assert decoder.graphs.captured() == [(4, 4), (4, 8), (8, 4)]


def test_warm_up_makes_a_graph_for_every_window_and_batch_bucket() -> None:
    decoder = uncaptured_graphs(tiny_transformer(native_context=NATIVE, pe="rope"), max_batch=6)
    assert decoder.graphs is not None and decoder.graphs.buckets == [1, 2, 4, 6]
    decoder.warm_up()
    assert decoder.graphs.captured() == [(blocks, batch) for blocks in (4, 8) for batch in (1, 2, 4, 6)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile", [False, True], ids=["eager-step", "compiled-step"])
def test_cuda_graphs_equal_the_full_pass(compile: bool) -> None:
    model = tiny_transformer(native_context=NATIVE, pe="rope").cuda()
    decoder = FastDecoder(
        model, pool_for(model), Backend.CUDA_GRAPHS, max_window=128, max_batch=8, inductor=compile
    )
    assert decoder.graphs is not None and decoder.graphs.capture
    decoder.warm_up()
    assert decode_and_compare(model, decoder, list(SCALINGS.values()), GRAPH_CHANGES) < TOLERANCE


def test_windows_past_the_compiled_range_are_left_to_the_eager_path() -> None:
    model = tiny_transformer(native_context=NATIVE)
    decoder = FastDecoder(model, pool_for(model), Backend.COMPILED, max_window=64, inductor=False)
    assert decoder.covers([63]) and not decoder.covers([64])  # a row at length 63 needs 64 keys
    assert decoder.windows() == [64]


def test_pool_reserves_whole_requests_and_gets_every_block_back() -> None:
    model = tiny_transformer(native_context=NATIVE)
    pool = PagedKVCache.within(
        model.config, 0, min_tokens=100, device=torch.device("cpu"), dtype=torch.float32
    )
    assert pool.total_blocks == 7  # ceil(100 / 16); the scratch block is not counted
    first = pool.allocate(40)
    assert len(first.blocks) == 3 and 0 not in first.blocks
    assert not pool.fits(100) and pool.fits(64)
    assert pool.usage == pytest.approx(3 / 7)
    pool.release(first)
    assert pool.usage == 0.0 and pool.fits(100)
    budget = PagedKVCache.within(
        model.config, 1 << 20, min_tokens=1, device=torch.device("cpu"), dtype=torch.float32
    )
    assert budget.nbytes <= (1 << 20) + budget.nbytes // (budget.total_blocks + 1)
    capped = PagedKVCache.within(
        model.config, 1 << 30, min_tokens=10, max_tokens=64, device=torch.device("cpu"), dtype=torch.float32
    )
    assert capped.total_blocks == 4  # what the batch can hold, whatever the budget


@pytest.fixture(scope="module")
def rope_dir(make_tiny_checkpoint: TinyCheckpointFactory) -> Path:
    return make_tiny_checkpoint("rope", name="tiny-rope-fast", native_context=NATIVE)


def generate_all(
    rope_dir: Path, decode: DecodeSettings, prompts: list[list[int]], max_context: int = 4096
) -> list[GenerationResult]:
    engine = InferenceEngine(
        load_models([rope_dir], max_context=max_context), max_batch_size=8, decode=decode
    )
    engine.start()
    try:
        handles = [
            engine.submit(
                GenerationRequest(
                    f"r{index}",
                    "tiny-rope-fast",
                    tuple(prompt),
                    # even rows greedy, odd rows sampled with a seed of their own
                    SamplingParams(
                        max_new_tokens=12 + index,
                        temperature=0.0 if index % 2 == 0 else 0.9,
                        top_p=0.95,
                        seed=index,
                        logprobs=True,
                    ),
                    list(SCALINGS.values())[index % len(SCALINGS)],
                )
            )
            for index, prompt in enumerate(prompts)
        ]
        results = [list(handle)[-1] for handle in handles]
    finally:
        engine.shutdown()
    assert all(isinstance(result, GenerationResult) for result in results)
    return [result for result in results if isinstance(result, GenerationResult)]


def test_compiled_engine_generates_what_the_eager_engine_does(rope_dir: Path) -> None:
    """Same tokens, greedy or seeded, and the same log-probabilities: the eager engine's HF parity
    (tests/service/test_hf_parity.py) carries over to the compiled step."""
    prompts = [[256, *range(1, n)] for n in (2, 9, 30, 45, 5, 17)]
    eager = generate_all(rope_dir, DecodeSettings(), prompts)
    compiled = generate_all(rope_dir, DecodeSettings(compile=True, compile_max_window=64), prompts)
    for ours, theirs in zip(compiled, eager, strict=True):
        assert ours.tokens == theirs.tokens
        assert ours.logprobs is not None and theirs.logprobs is not None
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)) < TOLERANCE


def test_requests_wait_for_blocks_when_the_pool_is_full(rope_dir: Path) -> None:
    """A pool with room for about one request at a time still serves six, in order, with no error."""
    prompts = [[256, *range(1, 30)] for _ in range(6)]
    tight = DecodeSettings(kv_cache_bytes=1)  # the floor: one request of max_context (64)
    waited = generate_all(rope_dir, tight, prompts, max_context=64)
    assert [r.tokens for r in waited] == [r.tokens for r in generate_all(rope_dir, DecodeSettings(), prompts)]
    assert max(r.timing.queue_ms for r in waited) > 0.0


def test_requests_waiting_for_blocks_count_in_the_queue_depth(rope_dir: Path) -> None:
    """Batch slots are free but the pool holds one request: the other two are queued, and say so
    (the frontend alone counts only requests beyond the batch size)."""
    engine = InferenceEngine(
        load_models([rope_dir], max_context=64), max_batch_size=8, decode=DecodeSettings(kv_cache_bytes=1)
    )
    handles = [
        engine.submit(
            GenerationRequest(f"w{i}", "tiny-rope-fast", (256, 1, 2, 3), SamplingParams(max_new_tokens=56))
        )
        for i in range(3)
    ]
    engine.start()
    try:
        first = iter(handles[0])
        next(first)  # a token of the first request: the step that produced it left two waiting
        assert engine.stats().queue_depth == 2
        assert isinstance(list(first)[-1], GenerationResult)
        assert all(isinstance(list(handle)[-1], GenerationResult) for handle in handles[1:])
        assert engine.stats().queue_depth == 0
    finally:
        engine.shutdown()


def test_the_c_step_refuses_a_block_id_past_its_pool_before_running() -> None:
    require_kernel(batch_pass.available, "batch step")
    model = tiny_transformer(native_context=NATIVE, pe="rope")
    decoder = FastDecoder(model, pool_for(model), Backend.C, max_window=64)
    assert decoder.c_pass is not None
    blocks = torch.full((1, 4), decoder.pool.keys[0].shape[1])  # one past the pool's last block
    hidden = torch.zeros(1, model.config.d_model)
    with pytest.raises(ValueError, match="block id"):
        decoder.c_pass(hidden, None, None, blocks, torch.tensor([0]))
    two_rows = torch.zeros(2, model.config.d_model)  # for one row of blocks
    with pytest.raises(ValueError, match="hidden"):
        decoder.c_pass(two_rows, None, None, blocks.clamp(max=1), torch.tensor([0]))
