"""`make serve`: with no --model-dir the server serves the bundled zoo under models/."""

from __future__ import annotations

import json

import httpx
import pytest

from service.api.loading import bundled_zoo
from tests.live_server import live_server

ZOO = bundled_zoo()


@pytest.mark.skipif(not ZOO, reason="no bundled zoo checkpoints under models/ yet")
def test_default_server_serves_every_bundled_checkpoint() -> None:
    expected = [json.loads((path / "config.json").read_text()).get("name", path.name) for path in ZOO]
    with (
        live_server(options={"device": "cpu"}) as server,
        httpx.Client(base_url=server.base_url, timeout=60.0) as client,
    ):
        cards = client.get("/models").json()["models"]
        assert [card["name"] for card in cards] == expected
        for card in cards:
            request = {"prompt": "def ", "model": card["name"], "max_new_tokens": 4, "seed": 0}
            response = client.post("/generate", json=request)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == card["name"]
        # `pe` alone picks each scheme's zoo model, never a training-side member (`zoo-rope-*`).
        for card in cards:
            if card.get("training_method") is None:
                request = {"prompt": "def ", "pe": card["scheme"], "max_new_tokens": 4, "seed": 0}
                assert client.post("/generate", json=request).json()["model"] == card["name"]
