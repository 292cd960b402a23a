"""Training-side zoo members as served: their method on every model card, their training scaling
as the default a request without `pe_scaling` gets, and `pe: "rope"` still meaning `zoo-rope`.

The members are tiny: a random `zoo-rope` and a one-step YaRN fine-tune of it (`training.extend`),
laid out as the bundled zoo is, and served by a real server over HTTP and gRPC.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch

from service.api.loading import bundled_zoo
from service.grpc_api import pe_serve_pb2 as pb
from service.model.checkpoint import save_checkpoint
from service.model.config import ModelConfig
from service.model.transformer import Transformer
from tests.live_server import LiveServer, live_server
from tests.service.api.conftest import SERVER_ENV
from tests.service.grpc.helpers import raw_call, request_bytes
from training.corpus import Corpus
from training.extend import extend
from training.extension import recipe

TINY_ROPE = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=64, pe="rope")
# Longer than the 256-token native context, where YaRN changes the rotation.
WINDOW = [index % 256 for index in range(300)]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`zoo-rope` and `zoo-rope-yarn4` (one step of the YaRN recipe) in the bundled zoo's layout."""
    directory = tmp_path_factory.mktemp("zoo")
    torch.manual_seed(0)
    save_checkpoint(Transformer(TINY_ROPE), directory / "zoo-rope", name="zoo-rope")
    generator = torch.Generator().manual_seed(0)
    corpus = Corpus(
        train=torch.randint(0, 256, (8192,), generator=generator),
        held_out=torch.randint(0, 256, (8 * 1024,), generator=generator),
        train_files=("train.py",),
        held_out_files=("held_out.py",),
    )
    plan = recipe("yarn-ft", scale=0.001)
    extend(plan, directory / plan.name, corpus, models_dir=directory, seed=0, command="test")
    return directory


@pytest.fixture(scope="module")
def server(zoo_dir: Path) -> Iterator[LiveServer]:
    with live_server(bundled_zoo(zoo_dir), options={"device": "cpu"}, env=SERVER_ENV) as running:
        yield running


def test_the_bundled_order_keeps_zoo_rope_first(zoo_dir: Path, server: LiveServer) -> None:
    assert [path.name for path in bundled_zoo(zoo_dir)] == ["zoo-rope", "zoo-rope-yarn4"]
    answer = httpx.post(server.url("/generate"), json={"prompt": "def ", "pe": "rope", "max_new_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "zoo-rope"


def test_cards_carry_the_training_method_over_http_and_grpc(server: LiveServer) -> None:
    cards = {card["name"]: card for card in httpx.get(server.url("/models")).json()["models"]}
    assert cards["zoo-rope-yarn4"]["training_method"] == "yarn-ft"
    assert cards["zoo-rope"]["training_method"] is None
    assert server.grpc_target is not None
    with grpc.insecure_channel(server.grpc_target) as channel:
        answer = raw_call(channel, "ListModels")(pb.ListModelsRequest().SerializeToString(), timeout=30)
    methods = {
        card.name: card.training_method if card.HasField("training_method") else None
        for card in answer.models
    }
    assert methods == {"zoo-rope": None, "zoo-rope-yarn4": "yarn-ft"}


def score(server: LiveServer, **fields: object) -> list[float]:
    body = {"model": "zoo-rope-yarn4", "tokens": WINDOW, **fields}
    answer = httpx.post(server.url("/score"), json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    logprobs: list[float] = answer.json()["token_logprobs"][1:]
    return logprobs


def test_a_request_without_a_scaling_runs_the_training_scaling(zoo_dir: Path, server: LiveServer) -> None:
    trained = json.loads((zoo_dir / "zoo-rope-yarn4" / "config.json").read_text())["training"]["scaling"]
    assert trained == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    default = score(server)
    assert default == score(server, pe_scaling={"type": "yarn", "factor": 4.0})
    assert default != score(server, pe_scaling={"type": "none"})  # and a request can override it

    body = {"model": "zoo-rope-yarn4", "prompt": "def ", "max_new_tokens": 2}
    pe = httpx.post(server.url("/generate"), json=body, timeout=60).json()["pe"]
    assert (pe["scaling"]["type"], pe["scaling"]["factor"]) == ("yarn", 4.0)


def test_every_api_selects_the_member_by_name(server: LiveServer) -> None:
    """gRPC and the OpenAI-compatible API reach the member, with its default scaling, by `model`."""
    assert server.grpc_target is not None
    with grpc.insecure_channel(server.grpc_target) as channel:
        body = request_bytes("Score", {"model": "zoo-rope-yarn4", "tokens": WINDOW})
        answer = raw_call(channel, "Score")(body, timeout=60)
    assert answer.model == "zoo-rope-yarn4"
    assert list(answer.token_logprobs) == pytest.approx(score(server), abs=1e-4)
    completion = httpx.post(
        server.url("/v1/completions"),
        json={"model": "zoo-rope-yarn4", "prompt": "def ", "max_tokens": 2},
        timeout=60,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == "zoo-rope-yarn4"
