"""`pe-client generate | compare | models` against the live server, output read from the terminal streams."""

from __future__ import annotations

import pytest
from pe_client import PEClient, YarnScaling
from pe_client.cli import main

from tests.clients.conftest import API_KEY
from tests.live_server import LiveServer

PROMPT = "0123456789" * 8  # past the tiny models' native context, where scalings differ


@pytest.fixture(autouse=True)
def server_from_environment(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads the URL and key from the environment, as a user's shell would set them."""
    monkeypatch.setenv("PE_SERVE_URL", server.base_url)
    monkeypatch.setenv("PE_SERVE_API_KEY", API_KEY)


def test_generate_streams_the_text_to_stdout(client: PEClient, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--pe", "rope", "--scaling", "yarn", "--factor", "4", "--max-new-tokens", "8", PROMPT]
    assert main(args) == 0
    out, err = capsys.readouterr()
    expected = client.generate(
        prompt=PROMPT, pe="rope", pe_scaling=YarnScaling(factor=4), max_new_tokens=8, temperature=0
    )
    assert out == expected.text
    assert "[length: 8 tokens" in err


def test_generate_passes_the_sampling_controls(client: PEClient, capsys: pytest.CaptureFixture[str]) -> None:
    controls = ["--repetition-penalty", "3", "--min-tokens", "4", "--ignore-eos", "--stop-token-id", "10"]
    assert main(["generate", "--max-new-tokens", "6", *controls, "ab"]) == 0
    out, _ = capsys.readouterr()
    expected = client.generate(
        prompt="ab",
        max_new_tokens=6,
        temperature=0,
        repetition_penalty=3.0,
        min_tokens=4,
        ignore_eos=True,
        stop_token_ids=[10],
    )
    assert out == expected.text


def test_compare_prints_one_column_per_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["compare", "--pe", "rope", "--factor", "4", "--max-new-tokens", "8", "--width", "120", PROMPT]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [label.strip() for label in lines[0].split(" | ")] == ["none", "linear x4", "ntk x4", "yarn x4"]
    assert all(len(line) <= 120 for line in lines)
    perplexities = next(line for line in lines if "prompt ppl" in line)
    assert perplexities.count("prompt ppl") == 4


def test_compare_waits_out_a_full_queue(capsys: pytest.CaptureFixture[str]) -> None:
    """Eight generations at once against one batch slot and a one-place queue: six get 429 at
    first, and the CLI retries each (as Retry-After says) until it runs, instead of failing."""
    scalings = ",".join(["none", "linear", "ntk", "yarn"] * 2)
    args = ["compare", "--pe", "rope", "--factor", "4", "--max-new-tokens", "4", "--scalings", scalings]
    assert main([*args, PROMPT]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.splitlines()[0].count("yarn x4") == 2


def test_models_lists_one_line_per_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["tiny-rope", "rope"], ["tiny-alibi", "alibi"]]


def test_server_errors_are_reported_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-such-model", "hello"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pe-client: 404") and "Traceback" not in err


def test_every_command_runs_over_grpc(
    server: LiveServer, client: PEClient, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server.grpc_target is not None
    args = ["--grpc", server.grpc_target, "generate", "--pe", "rope", "--max-new-tokens", "8", PROMPT]
    assert main(args) == 0
    expected = client.generate(prompt=PROMPT, pe="rope", max_new_tokens=8, temperature=0)
    assert capsys.readouterr().out == expected.text
    assert main(["--grpc", server.grpc_target, "models"]) == 0
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()] == [
        ["tiny-rope", "rope"],
        ["tiny-alibi", "alibi"],
    ]
    compare = ["--grpc", server.grpc_target, "compare", "--factor", "4", "--max-new-tokens", "4", PROMPT]
    assert main(compare) == 0
    assert "prompt ppl" in capsys.readouterr().out
