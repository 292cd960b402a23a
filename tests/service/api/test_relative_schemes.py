"""Shaw, Transformer-XL, CoPE and RoPE + ALiBi over the live server: /generate, /score, /models.

Generation decodes incrementally through the engine's KV cache and batches, scoring runs one full
pass, so greedy log-probabilities agreeing between the two (past the native context) is the
incremental-equals-full check end to end; concurrent prompts of different lengths share batches.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from service.model.config import Scheme
from service.model.positional import SUPPORTED_SCALINGS
from tests.service.api.conftest import NATIVE_CONTEXT, SCHEME_ORDER, model_name
from tests.service.api.helpers import metric_sum

NEW_SCHEMES: tuple[Scheme, ...] = ("shaw", "transformer_xl", "cope", "rope_alibi")
CASES: list[tuple[str, dict[str, Any] | None]] = [
    *((scheme, None) for scheme in NEW_SCHEMES),
    ("transformer_xl", {"type": "linear", "factor": 2.0}),
    ("rope_alibi", {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": NATIVE_CONTEXT}),
]
PROMPT = list(b"def f(x):\n    return x * 2\n" * 3)[: NATIVE_CONTEXT - 4]  # generation crosses the context


def generate(client: httpx.Client, tokens: list[int], scheme: str, scaling: dict[str, Any] | None) -> Any:
    body: dict[str, Any] = {
        "tokens": tokens,
        "pe": scheme,
        "max_new_tokens": 12,
        "temperature": 0,
        "logprobs": True,
    }
    if scaling is not None:
        body["pe_scaling"] = scaling
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(
    ("scheme", "scaling"), CASES, ids=[f"{s}-{(c or {}).get('type', 'none')}" for s, c in CASES]
)
def test_generated_logprobs_match_a_full_score_past_the_native_context(
    client: httpx.Client, scheme: str, scaling: dict[str, Any] | None
) -> None:
    generated = generate(client, PROMPT, scheme, scaling)
    assert generated["model"] == model_name(scheme)
    body: dict[str, Any] = {"tokens": PROMPT + generated["tokens"], "pe": scheme}
    if scaling is not None:
        body["pe_scaling"] = scaling
    scored = client.post("/score", json=body)
    assert scored.status_code == 200, scored.text
    assert scored.json()["token_logprobs"][len(PROMPT) :] == pytest.approx(generated["logprobs"], abs=1e-3)


@pytest.mark.parametrize("scheme", NEW_SCHEMES)
def test_concurrent_prompts_of_different_lengths_decode_as_they_do_alone(
    client: httpx.Client, scheme: str
) -> None:
    prompts = [PROMPT[:length] for length in (3, 17, 40, len(PROMPT))]
    alone = [generate(client, prompt, scheme, None)["tokens"] for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda prompt: generate(client, prompt, scheme, None)["tokens"], prompts))
    assert together == alone


def test_models_report_each_new_scheme_and_its_scalings(client: httpx.Client) -> None:
    models = client.get("/models").json()["models"]
    for scheme in NEW_SCHEMES:
        listed = models[SCHEME_ORDER.index(scheme)]
        assert listed["name"] == model_name(scheme)
        assert listed["supported_scalings"] == list(SUPPORTED_SCALINGS[scheme])


@pytest.mark.parametrize(("scheme", "kind"), [("shaw", "shaw_index"), ("transformer_xl", "xl_relative")])
def test_the_relative_tables_are_cached_under_their_own_kinds(
    client: httpx.Client, scheme: str, kind: str
) -> None:
    generate(client, PROMPT, scheme, None)
    hits = metric_sum(client, "pe_cache_hits_total", f'kind="{kind}"')
    generate(client, PROMPT, scheme, None)
    assert metric_sum(client, "pe_cache_misses_total", f'kind="{kind}"') >= 1
    assert metric_sum(client, "pe_cache_hits_total", f'kind="{kind}"') > hits
