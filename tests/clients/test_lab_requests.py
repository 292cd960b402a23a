"""What the lab sends, seen by an in-process fake server: passkey trials, attention rules passed
through as `pe_attention`, RULER through a chat template, and grids refused before any prompt."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from pe_client import AsyncPEClient
from pe_client.attention import DCAAttention, SelfExtendAttention
from pe_client.grid import GridError, configuration_label, configurations, parse_attention_specs
from pe_client.lab_output import passkey_table
from pe_client.passkey import ANSWER_TOKENS, NEEDLE, PasskeyResult, async_passkey, wilson_interval
from pe_client.ruler import RulerResult, async_ruler
from pe_client.scaling import NoScaling, YarnScaling

from tests.clients.fake_lab import FakeLabServer

T = TypeVar("T")


def run(server: FakeLabServer, work: Any) -> Any:
    """`work(client)` in a fresh event loop, over a client that the fake answers."""

    async def main() -> Any:
        async with server.client() as client:
            return await work(client)

    return asyncio.run(main())


def key_of(prompt: str) -> str:
    """The fake model reads the key: it always finds it."""
    match = re.search(r"The pass key is (\d+)\.", prompt)
    return match.group(1) if match else ""


def passkey_prompts(seed: int, trials: int = 3) -> tuple[PasskeyResult, list[str]]:
    server = FakeLabServer(answer=key_of)

    def work(client: AsyncPEClient) -> Coroutine[Any, Any, PasskeyResult]:
        return async_passkey(
            client, lengths=[900, 600], depths=[0.5], scalings=["none"], trials=trials, seed=seed
        )

    result = run(server, work)
    prompts = [bytes(t for t in body["tokens"] if t < 256).decode() for body in server.bodies("/generate")]
    return result, prompts


def test_passkey_trials_have_their_own_keys_and_fillers_drawn_from_the_seed() -> None:
    result, prompts = passkey_prompts(seed=5)
    assert len(prompts) == 6  # 2 lengths x 3 trials, one generation each
    by_length = sorted(prompts, key=len)  # a trial's prompts go longest filler first: cells by size
    for cell_prompts in (by_length[:3], by_length[3:]):
        keys = [key_of(prompt) for prompt in cell_prompts]
        assert len(set(keys)) == 3
        fillers = {
            prompt.replace(NEEDLE.format(key=key), "") for prompt, key in zip(cell_prompts, keys, strict=True)
        }
        assert len(fillers) == 3  # not just the key: the filler differs between trials too
    assert all(len(prompt.encode()) + 1 <= 600 - ANSWER_TOKENS for prompt in by_length[:3])
    # A trial's filler is the same in every cell: a short prompt's text before its key opens a long one.
    before_key = [prompt.split("The pass key is")[0] for prompt in by_length[:3]]
    assert all(sum(long.startswith(text) for long in by_length[3:]) == 1 for text in before_key)
    assert sorted(passkey_prompts(seed=5)[1]) == sorted(prompts)
    assert sorted(passkey_prompts(seed=6)[1]) != sorted(prompts)

    assert [cell.correct for cell in result.cells] == [3, 3]
    assert re.search(r"0\.5\s+3/3 \(44%-100%\)\s+3/3 \(44%-100%\)", passkey_table(result))
    printed = json.loads(result.model_dump_json())
    assert printed["cells"][0] == {
        "length": 600,
        "depth": 0.5,
        "scaling": {"type": "none"},
        "attention": None,
        "trials": 3,
        "correct": 3,
        "interval": list(wilson_interval(3, 3)),
    }


def test_wilson_interval() -> None:
    """Against the closed form's known values; exactly 0 and 1 at the ends."""
    none_found, all_found = wilson_interval(0, 3), wilson_interval(3, 3)
    assert none_found[0] == 0.0 and none_found[1] == pytest.approx(0.5615, abs=1e-4)
    assert all_found[0] == pytest.approx(0.4385, abs=1e-4) and all_found[1] == 1.0
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(40, 100)
    assert low < 0.4 < high and high - low < 0.2


def test_attention_rules_cross_scalings_and_go_out_only_when_given() -> None:
    server = FakeLabServer(answer=key_of)
    result: PasskeyResult = run(
        server,
        lambda client: async_passkey(
            client,
            lengths=[400],
            depths=[0.5],
            scalings=["none", "yarn:factor=2"],
            attentions=["self_extend:group_size=2|4,window=64"],
        ),
    )
    sent = [(body["pe_scaling"]["type"], body["pe_attention"]) for body in server.bodies("/generate")]
    assert sent == [
        ("none", {"type": "self_extend", "group_size": 2, "window": 64}),
        ("none", {"type": "self_extend", "group_size": 4, "window": 64}),
        ("yarn", {"type": "self_extend", "group_size": 2, "window": 64}),
        ("yarn", {"type": "self_extend", "group_size": 4, "window": 64}),
    ]
    assert [cell.attention for cell in result.cells] == [
        SelfExtendAttention(group_size=2, window=64),
        SelfExtendAttention(group_size=4, window=64),
    ] * 2

    plain = FakeLabServer(answer=key_of)
    run(plain, lambda client: async_passkey(client, lengths=[400], depths=[0.5], scalings=["none"]))
    assert all("pe_attention" not in body for body in plain.bodies("/generate"))


def test_attention_specs() -> None:
    assert parse_attention_specs(["dca:chunk_size=64,local_window=16|32", "standard", "standard"]) == [
        DCAAttention(chunk_size=64, local_window=16),
        DCAAttention(chunk_size=64, local_window=32),
        parse_attention_specs(["standard"])[0],
    ]
    grid = configurations(["none", "yarn:factor=4"], ["rerope:window=128"])
    assert [configuration_label(configuration) for configuration in grid] == [
        "none + rerope (window=128)",
        "yarn x4 + rerope (window=128)",
    ]
    assert configurations(["none"], None) == [(NoScaling(), None)]
    assert configurations([YarnScaling(factor=2)], []) == [(YarnScaling(factor=2), None)]
    for spec, message in [
        ("sliding:window=4", "unknown attention type 'sliding'"),
        ("dca:chunk_size=64,local_window=64", "local_window 64 must be below chunk_size 64"),
        ("self_extend:group_size=0,window=8", "group_size"),
        ("rerope:window=8,group_size=2", "group_size"),
        ("streaming:window=8", "sink_tokens"),
    ]:
        with pytest.raises(GridError, match=message):
            parse_attention_specs([spec])


def echo(prompt: str) -> str:
    """A model that repeats its prompt holds every answer, so every score is 1."""
    return prompt


def test_ruler_through_a_chat_template() -> None:
    server = FakeLabServer(chat=True, answer=echo)
    result: RulerResult = run(
        server,
        lambda client: async_ruler(
            client,
            tasks=["niah_multivalue", "vt"],
            lengths=[900, 1200],
            samples=2,
            attentions=["streaming:sink_tokens=4,window=256"],
        ),
    )
    assert result.chat
    assert all("messages" in body for body in server.bodies("/tokenize"))
    assert [(cell.task, cell.length, cell.samples, cell.score) for cell in result.cells] == [
        ("niah_multivalue", 900, 2, 1.0),
        ("niah_multivalue", 1200, 2, 1.0),
        ("vt", 900, 2, 1.0),
        ("vt", 1200, 2, 1.0),
    ]
    generated = server.bodies("/generate")
    assert all(
        body["pe_attention"] == {"type": "streaming", "sink_tokens": 4, "window": 256} for body in generated
    )
    # The dump's prompt is the user's message; the tokens are its rendering, sized to the length.
    sent = [bytes(t for t in body["tokens"] if t < 256).decode() for body in generated]
    assert sorted(sent) == sorted(f"<user>{sample.prompt}<assistant>" for sample in result.samples)
    for sample in result.samples:
        body = generated[sent.index(f"<user>{sample.prompt}<assistant>")]
        assert body["max_new_tokens"] == {"niah_multivalue": 96, "vt": 48}[sample.task]
        # A chat model is not handed an answer prefix: the question ends the message.
        assert sample.prompt.splitlines()[-1].startswith(("What are all", "Which variables"))
        assert 0.9 * sample.length <= sample.prompt_tokens == len(body["tokens"]) <= sample.length
    # A task's prompts of one length go in turn, the one with the most haystack before its first
    # item first (the prefix cache then holds what the next one opens with).
    for task, first_item in (("niah_multivalue", "One of the special"), ("vt", "VAR ")):
        for length in (900, 1200):
            chain = [s.prompt for s in result.samples if (s.task, s.length) == (task, length)]
            order = sorted(chain, key=lambda prompt: sent.index(f"<user>{prompt}<assistant>"))
            openings = [prompt.index(first_item) for prompt in order]
            assert openings == sorted(openings, reverse=True), (task, length, openings)


def test_ruler_refuses_a_grid_before_building_a_prompt() -> None:
    bad_task = FakeLabServer()
    with pytest.raises(GridError, match="unknown task 'qa'"):
        run(bad_task, lambda client: async_ruler(client, tasks=["vt", "qa"], lengths=[1024]))
    assert bad_task.sent == []

    # cwe's answer needs 128 tokens: at max_context its prompt could hold under 90% of the length.
    no_room = FakeLabServer(max_context=1024)
    with pytest.raises(GridError, match="cwe's answer takes up to 128 tokens"):
        run(no_room, lambda client: async_ruler(client, tasks=["cwe"], lengths=[1024]))
    assert [path for path, _ in no_room.sent] == ["/models"]

    too_short = FakeLabServer()
    with pytest.raises(GridError, match="fwe at length 300: its shortest prompt has"):
        run(too_short, lambda client: async_ruler(client, tasks=["fwe"], lengths=[300]))
    assert too_short.bodies("/generate") == []
