"""`pe` picks the model, `pe_scaling` applies per request, and the scheme decides what is allowed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from service.requests.scaling import SCALING_EXAMPLES
from tests.service.api.conftest import NATIVE_CONTEXT, ROTARY_FREQUENCIES, SCHEME_ORDER, model_name
from tests.service.api.helpers import assert_error_shape, metric_sum

# Past the native context, so every scaling has something to do.
LONG_TOKENS = list(b"x = 1\n" * 14)[: NATIVE_CONTEXT + 20]


def rope_example(scaling_type: str) -> dict[str, Any]:
    """The OpenAPI example, with factor lists sized for the tiny model's rotary dimension."""
    example = dict(SCALING_EXAMPLES[scaling_type])
    if scaling_type == "longrope":
        example |= {"short_factor": [1.0] * ROTARY_FREQUENCIES, "long_factor": [2.0] * ROTARY_FREQUENCIES}
        example["original_max_position_embeddings"] = NATIVE_CONTEXT
    elif "original_max_position_embeddings" in example:
        example["original_max_position_embeddings"] = NATIVE_CONTEXT
    return example


@pytest.mark.parametrize("scheme", SCHEME_ORDER)
def test_pe_selects_the_model_of_that_scheme(client: httpx.Client, scheme: str) -> None:
    body = client.post("/generate", json={"prompt": "a", "pe": scheme, "max_new_tokens": 2}).json()
    assert body["model"] == model_name(scheme)
    assert body["pe"]["scheme"] == scheme


def test_model_and_pe_must_agree(client: httpx.Client) -> None:
    agreeing = client.post(
        "/generate", json={"prompt": "a", "model": "tiny-alibi", "pe": "alibi", "max_new_tokens": 1}
    )
    assert agreeing.status_code == 200
    response = client.post("/generate", json={"prompt": "a", "model": "tiny-rope", "pe": "alibi"})
    assert_error_shape(response, 422)


@pytest.mark.parametrize("scaling_type", sorted(SCALING_EXAMPLES))
def test_each_scaling_type_runs_on_rope(client: httpx.Client, scaling_type: str) -> None:
    request = {
        "tokens": LONG_TOKENS,
        "pe": "rope",
        "pe_scaling": rope_example(scaling_type),
        "max_new_tokens": 4,
    }
    response = client.post("/generate", json=request)
    assert response.status_code == 200, response.text
    resolved = response.json()["pe"]["scaling"]
    assert resolved["type"] == scaling_type
    scored = client.post("/score", json={key: request[key] for key in ("tokens", "pe", "pe_scaling")})
    assert scored.status_code == 200, scored.text


@pytest.mark.parametrize("scaling_type", sorted(SCALING_EXAMPLES))
@pytest.mark.parametrize("scheme", [scheme for scheme in SCHEME_ORDER if scheme != "rope"])
def test_other_schemes_refuse_scalings_they_cannot_use(
    client: httpx.Client, scheme: str, scaling_type: str
) -> None:
    """Refusals are 422s naming the scalings the scheme does support; supported ones run."""
    supported = client.get("/models").json()["models"][SCHEME_ORDER.index(scheme)]["supported_scalings"]
    request = {"prompt": "a", "pe": scheme, "pe_scaling": rope_example(scaling_type), "max_new_tokens": 1}
    response = client.post("/generate", json=request)
    if scaling_type in supported:
        assert response.status_code == 200, response.text
    else:
        error = assert_error_shape(response, 422, "pe_scaling.type")
        assert all(name in error["message"] for name in supported)


def test_new_scalings_move_the_cache_counters(client: httpx.Client) -> None:
    misses_before = metric_sum(client, "pe_cache_misses_total")
    request = {"tokens": LONG_TOKENS, "pe_scaling": {"type": "linear", "factor": 3.25}, "max_new_tokens": 2}
    assert client.post("/generate", json=request).status_code == 200
    misses_after_first = metric_sum(client, "pe_cache_misses_total")
    assert misses_after_first > misses_before
    hits_before = metric_sum(client, "pe_cache_hits_total")
    assert client.post("/generate", json=request).status_code == 200
    assert metric_sum(client, "pe_cache_hits_total") > hits_before
    assert metric_sum(client, "pe_cache_bytes") > 0
