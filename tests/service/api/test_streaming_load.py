"""Endless streams in bounded memory, briefly: `make streaming-load` (bench/streaming_load.py) runs
six streams of 5000 tokens on zoo-rope; this runs its load for a few hundred tokens on a tiny model.

Four `streaming` generations of over three times `max_context` at once, plain requests beside
them, on a pool too small for even one of them to keep its whole text (the pool holds
`max_batch_size` requests of `max_context`: 1024 tokens, against 4 x 440). All finish, the pool's
usage on `/metrics` stays at what the rows hold (their sinks, windows and slack, and the plain
requests), and the processes' resident memory at the end is within 10% of a quarter of the way in.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.streaming_load import LoadConfig, run_load
from tests.conftest import TinyCheckpointFactory
from tests.live_server import OptionValue, live_server
from tests.service.api.conftest import SERVER_ENV

MAX_CONTEXT = 128
MAX_BATCH_SIZE = 8
BLOCK = 16


@pytest.mark.slow
def test_streams_of_three_contexts_finish_with_the_pool_and_memory_flat(
    make_tiny_checkpoint: TinyCheckpointFactory,
) -> None:
    model = make_tiny_checkpoint("rope", name="tiny-endless", seed=3, native_context=64)
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "max_batch_size": MAX_BATCH_SIZE,
        "max_stream_tokens": 400,
        "torch_threads": 1,
    }
    config = LoadConfig(
        model=model.name,
        streams=4,
        tokens=400,
        sinks=4,
        window=24,
        plain_clients=1,
        prompt_chars=40,
        plain_chars=100,
        sample_s=0.05,  # a fast machine finishes in about a second: enough samples still
    )
    with live_server([model], options=options, env=SERVER_ENV) as server:
        result = asyncio.run(run_load(server.base_url, config, idle_wait_s=0.5))

    assert result.capacity_tokens == MAX_BATCH_SIZE * MAX_CONTEXT
    assert result.streams_ok, result.streams
    assert result.plain_ok and sum(result.plain.values()) > 0, result.plain
    assert len(result.running_samples) >= 4
    held = config.streams * (1 + 2 + 2) * BLOCK  # each: the sinks' block, the window's two, two of slack
    plain = 7 * BLOCK  # the largest plain request: 100 characters and BOS, or 64, BOS and 32 tokens
    assert result.peak_usage * result.capacity_tokens <= held + plain, result.samples
    assert result.peak_usage <= 0.6
    assert result.rss_growth <= 1.10, result.samples
