"""A bounded schemathesis pass over every route of the live test server (`make fuzz` is the long
run): no 5xx, no response or stream event outside its schema, no undocumented status. The pass
includes `pe_attention` rules of every type and model names with SPECs (`bench/fuzz_hooks.py`)."""

from __future__ import annotations

import pytest

from bench.fuzz import run_fuzz
from tests.live_server import LiveServer

# Per operation and phase; about a minute on the test server's tiny models on two busy cores.
CI_EXAMPLES = 25
CI_SEED = 20261201


@pytest.mark.slow
def test_a_bounded_fuzz_run_finds_nothing(server: LiveServer) -> None:
    result = run_fuzz(server.base_url, max_examples=CI_EXAMPLES, seed=CI_SEED)
    assert result.failures == [] and result.errors == []
    assert result.server_errors == 0, result.statuses
    assert result.requests >= 300
    generate_statuses = {status for endpoint, status in result.statuses if endpoint == "/generate"}
    assert 200 in generate_statuses and 422 in generate_statuses
    sent = {key.partition("|")[0] for key in result.surface}
    rule_types = {
        label.split()[1].removesuffix("+logn") for label in sent if label.startswith("pe_attention")
    }
    assert {"standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"} <= rule_types, sent
    assert "model NAME@SPEC" in sent, sent
