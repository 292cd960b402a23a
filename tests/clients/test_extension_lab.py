"""The context-extension lab (`pe_client.sweep`, `pe_client.passkey`, `pe_client.ruler`,
`pe-client sweep|passkey|ruler`) against a real server on the zoo's RoPE and ALiBi members (native
context 256).

What the server saw is read from its own `/metrics`: which requests arrived, and which were cut
off by the client (status 499, the request cancelled in the engine). A sweep scores each
configuration (scaling, attention rule) once at its longest length and reads the shorter cells from
that pass's prefix, except dynamic NTK and LongRoPE (one pass per length): every cell must still
equal `/score` of its first L tokens. The server has an `--alias` (`ALIAS`), which the lab takes as
a model name, like `NAME@SPEC`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pe_client import AsyncPEClient, PEClient, async_sweep, passkey, ruler, sweep
from pe_client.attention import SelfExtendAttention
from pe_client.cli import main
from pe_client.grid import GridError
from pe_client.lab_output import plot_passkey, plot_ruler, sweep_table
from pe_client.passkey import PasskeyCell, PasskeyResult, wilson_interval
from pe_client.ruler import RulerCell, RulerResult
from pe_client.ruler_tasks import TASKS, string_match_all
from pe_client.scaling import LongRopeScaling, NoScaling, YarnScaling
from pe_client.sweep import SweepCell, SweepResult
from pe_client.types import ScoreRequest

from tests.live_server import LiveServer, OptionValue, live_server
from tests.service.api.helpers import metric_sum

ZOO = Path(__file__).resolve().parents[2] / "models"
MAX_CONTEXT = 2048
NATIVE = 256
TEXT = Path(__file__).resolve().parents[2].joinpath("README.md").read_text(encoding="utf-8")
TOLERANCE_BITS = 1e-4
# A cell read from a longer pass's prefix against `/score` of its own tokens: the two passes are
# chunked and batched differently, so float32 sums differ (by ~1e-5 bits); the SPEC allows 1e-3.
PREFIX_TOLERANCE_BITS = 1e-3
HEAD_DIM = 32  # zoo-rope: d_model 192 over 6 heads; a LongRoPE list has one factor per pair
LONGROPE = LongRopeScaling(short_factor=[1.0] * (HEAD_DIM // 2), long_factor=[4.0] * (HEAD_DIM // 2))
ALIAS = "zoo-long"
ALIAS_TARGET = "zoo-rope@yarn:factor=4,original_max_position_embeddings=256"
ALIAS_SCALING = YarnScaling(factor=4, original_max_position_embeddings=256)
RULES = ["self_extend:group_size=4,window=64", "dca:chunk_size=128,local_window=32"]


@pytest.fixture(scope="module")
def zoo_server() -> Iterator[LiveServer]:
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "grpc_port": 0,
        "alias": [f"{ALIAS}={ALIAS_TARGET}"],
    }
    with live_server(
        [ZOO / "zoo-rope", ZOO / "zoo-alibi"], options=options, env={"OMP_NUM_THREADS": "1"}
    ) as running:
        yield running


@pytest.fixture
def zoo(zoo_server: LiveServer) -> Iterator[PEClient]:
    with PEClient(zoo_server.base_url, timeout=120.0) as client:
        yield client


def requests_seen(server: LiveServer) -> dict[tuple[str, str], float]:
    """`pe_serve_requests_total` by (endpoint, status), as the server counts them."""
    text = httpx.get(server.url("/metrics"), timeout=10.0).text
    pattern = re.compile(r"^pe_serve_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.MULTILINE)
    seen: dict[tuple[str, str], float] = {}
    for match in pattern.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        seen[labels["endpoint"], labels["status"]] = float(match["value"])
    return seen


def count(seen: dict[tuple[str, str], float], endpoint: str, status: str | None = None) -> float:
    return sum(value for (path, code), value in seen.items() if path == endpoint and status in (None, code))


def bits_alone(client: PEClient, tokens: list[int], cell: SweepCell) -> tuple[float, float | None]:
    """The cell's two figures from one `/score` of the same tokens, scaling and attention rule (the
    resident model's own name, the fields in the body), sent by itself."""
    request = ScoreRequest(
        tokens=tokens[: cell.length], model="zoo-rope", pe_scaling=cell.scaling, pe_attention=cell.attention
    )
    response = client.score(request)
    logprobs = list(response.token_logprobs[1:])
    assert all(lp is not None for lp in logprobs)
    values = [float(lp) for lp in logprobs if lp is not None]
    whole = -math.fsum(values) / len(values) / math.log(2)
    past = values[NATIVE - 1 :]
    return whole, (-math.fsum(past) / len(past) / math.log(2) if cell.length > NATIVE else None)


def scores_sent(server: LiveServer, before: dict[tuple[str, str], float]) -> float:
    """The `/score` requests the server answered since `before`."""
    return count(requests_seen(server), "/score", "200") - count(before, "/score", "200")


def assert_cells_equal_score_alone(client: PEClient, result: SweepResult) -> None:
    """Every cell equals one `/score` of the text's first L tokens under its configuration, sent alone."""
    tokens = client.tokenize(TEXT[:4000])
    for cell in result.cells:
        whole, past = bits_alone(client, tokens, cell)
        assert cell.tokens == cell.length
        assert abs(cell.bits_per_token - whole) < PREFIX_TOLERANCE_BITS, cell
        if past is None:
            assert cell.tail_bits_per_token is None
        else:
            assert cell.tail_bits_per_token is not None
            assert abs(cell.tail_bits_per_token - past) < PREFIX_TOLERANCE_BITS, cell


def test_sweep_cells_equal_score_sent_alone(zoo: PEClient, zoo_server: LiveServer) -> None:
    before = requests_seen(zoo_server)
    result = sweep(
        zoo, text=TEXT, lengths=[400, 128, 300], scalings=["none", "yarn:factor=2|4", "linear:factor=2"]
    )
    # One pass per scaling, at 400 tokens; the 128- and 300-token cells are its prefixes.
    assert scores_sent(zoo_server, before) == 4
    assert result.model == "zoo-rope"
    assert [
        (cell.length, cell.scaling.type, getattr(cell.scaling, "factor", None)) for cell in result.cells
    ] == [
        (length, scaling, factor)
        for scaling, factor in [("none", None), ("yarn", 2.0), ("yarn", 4.0), ("linear", 2.0)]
        for length in (128, 300, 400)
    ]
    assert_cells_equal_score_alone(zoo, result)
    # Past the native context the scalings part ways; within it linear x2 already differs from none.
    by_key = {(cell.length, cell.scaling.model_dump_json()): cell.bits_per_token for cell in result.cells}
    assert len(set(by_key.values())) == len(by_key)


def test_length_dependent_scalings_keep_one_pass_per_length(zoo: PEClient, zoo_server: LiveServer) -> None:
    """Dynamic NTK's base follows the total length and LongRoPE's table switches past the original
    context, so a long pass's prefix is not a short pass: those cells are each their own `/score`,
    beside a fixed scaling's single pass."""
    lengths = [128, 300, 400]
    before = requests_seen(zoo_server)
    result = sweep(zoo, text=TEXT, lengths=lengths, scalings=["ntk:factor=2", "dynamic:factor=8", LONGROPE])
    assert scores_sent(zoo_server, before) == 1 + 2 * len(lengths)
    assert [(cell.scaling.type, cell.length) for cell in result.cells] == [
        (kind, length) for kind in ("ntk", "dynamic", "longrope") for length in lengths
    ]
    assert_cells_equal_score_alone(zoo, result)
    # Why: a 400-token pass's prefix is not a shorter pass (dynamic: another bucket of the base;
    # LongRoPE: the long factors where 128 tokens take the short ones).
    tokens = zoo.tokenize(TEXT[:4000])
    differing = [("dynamic", 128), ("dynamic", 300), ("longrope", 128)]
    for cell in [cell for cell in result.cells if (cell.scaling.type, cell.length) in differing]:
        prefix = zoo.score(tokens=tokens[:400], pe_scaling=cell.scaling).token_logprobs[1 : cell.length]
        from_long_pass = -math.fsum(float(lp) for lp in prefix if lp is not None) / len(prefix) / math.log(2)
        assert abs(from_long_pass - cell.bits_per_token) > PREFIX_TOLERANCE_BITS, cell


def test_async_sweep_one_at_a_time_equals_all_at_once(zoo: PEClient, zoo_server: LiveServer) -> None:
    together = sweep(zoo, text=TEXT, lengths=[300], scalings=["ntk:factor=2", "dynamic:factor=2"])

    async def one_by_one() -> list[SweepCell]:
        async with AsyncPEClient(zoo_server.base_url, timeout=120.0) as client:
            result = await async_sweep(
                client, text=TEXT, lengths=[300], scalings=["ntk:factor=2", "dynamic:factor=2"], concurrency=1
            )
        return result.cells

    for alone, batched in zip(asyncio.run(one_by_one()), together.cells, strict=True):
        assert alone.scaling == batched.scaling
        assert abs(alone.bits_per_token - batched.bits_per_token) < TOLERANCE_BITS


def test_sweep_crosses_attention_rules_with_scalings_one_pass_each(
    zoo: PEClient, zoo_server: LiveServer
) -> None:
    """Two rules x two scalings: four configurations, each one `/score` at the longest length (a
    rule places a pair by its two indices alone, so a prefix of the long pass is the short pass),
    every cell equal to `/score` of its own tokens with the same `pe_scaling` and `pe_attention`."""
    lengths = [128, 300, 400]
    before = requests_seen(zoo_server)
    result = sweep(zoo, text=TEXT, lengths=lengths, scalings=["none", "yarn:factor=2"], attentions=RULES)
    assert scores_sent(zoo_server, before) == 4
    assert [
        (cell.scaling.type, cell.attention and cell.attention.type, cell.length) for cell in result.cells
    ] == [
        (scaling, rule, length)
        for scaling in ("none", "yarn")
        for rule in ("self_extend", "dca")
        for length in lengths
    ]
    assert_cells_equal_score_alone(zoo, result)
    # The rule is applied: at 400 tokens (past the native 256) the four configurations part ways.
    assert len({cell.bits_per_token for cell in result.cells if cell.length == 400}) == 4
    assert json.loads(result.model_dump_json())["cells"][0]["attention"] == {
        "type": "self_extend",
        "group_size": 4,
        "window": 64,
    }


def test_a_model_name_with_specs_or_an_alias_is_the_grid_s_configuration(
    zoo: PEClient, zoo_server: LiveServer
) -> None:
    """`--alias zoo-long=zoo-rope@yarn:...` (listed by /v1/models) and `zoo-rope@yarn:...` both set
    the scaling; the grid's rules cross it. The requests carry the name as given, the cells the
    configuration the name stands for, and each equals `/score` of the resident model with the
    same fields in the body."""
    before = requests_seen(zoo_server)
    by_alias = sweep(zoo, text=TEXT, lengths=[128, 400], model=ALIAS, attentions=[RULES[0]])
    by_name = sweep(zoo, text=TEXT, lengths=[128, 400], model=f"{ALIAS_TARGET}@{RULES[0]}")
    assert scores_sent(zoo_server, before) == 2  # one pass each
    assert by_alias.model == ALIAS and by_name.model == f"{ALIAS_TARGET}@{RULES[0]}"
    for result in (by_alias, by_name):
        assert [(cell.scaling, cell.attention, cell.length) for cell in result.cells] == [
            (ALIAS_SCALING, SelfExtendAttention(group_size=4, window=64), length) for length in (128, 400)
        ]
        assert_cells_equal_score_alone(zoo, result)
    for alias_cell, name_cell in zip(by_alias.cells, by_name.cells, strict=True):
        assert abs(alias_cell.bits_per_token - name_cell.bits_per_token) < TOLERANCE_BITS


def test_cli_passkey_and_ruler_take_an_alias_and_a_name_with_a_rule(
    zoo_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    before = requests_seen(zoo_server)
    common = ["--url", zoo_server.base_url]
    passkey_args = ["passkey", "--model", ALIAS, "--lengths", "384", "--depths", "0.5", "--json"]
    assert main([*common, *passkey_args, "--attention", "rerope:window=64"]) == 0
    (cell,) = json.loads(capsys.readouterr().out)["cells"]
    assert cell["scaling"] == ALIAS_SCALING.model_dump(mode="json", exclude_none=True)
    assert cell["attention"] == {"type": "rerope", "window": 64}
    ruler_args = ["ruler", "--model", f"zoo-rope@{RULES[0]}", "--tasks", "vt", "--lengths", "600"]
    assert main([*common, *ruler_args, "--samples", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"] == f"zoo-rope@{RULES[0]}"
    assert [(cell["scaling"], cell["attention"]) for cell in printed["cells"]] == [
        ({"type": "none"}, {"type": "self_extend", "group_size": 4, "window": 64})
    ]
    generated = count(requests_seen(zoo_server), "/generate", "200") - count(before, "/generate", "200")
    assert generated == 2


@pytest.mark.parametrize(
    ("command", "grid", "message"),
    [
        ("sweep", ["--model", "zoo-rope@yarn:factor=2", "--scaling", "none"], "sets the scaling (yarn x2)"),
        ("passkey", ["--model", "zoo-rope@ntk:factor=2", "--scaling", "none"], "sets the scaling (ntk x2)"),
        ("ruler", ["--model", "zoo-rope@none", "--scaling", "linear:factor=2"], "sets the scaling (none)"),
        ("sweep", ["--model", ALIAS, "--scaling", "none"], "sets the scaling (yarn x4 (orig=256))"),
        ("ruler", ["--model", ALIAS, "--scaling", "none"], f"the model name {ALIAS!r} sets the scaling"),
        (
            "sweep",
            ["--model", f"zoo-rope@{RULES[1]}", "--scaling", "none", "--attention", RULES[0]],
            "sets the attention rule (dca (chunk_size=128,local_window=32))",
        ),
        ("passkey", ["--model", f"{ALIAS}@{RULES[0]}", "--attention", RULES[1]], "sets the attention rule"),
        ("sweep", ["--model", f"{ALIAS}@yarn:factor=2"], "two scaling SPECs"),
        ("sweep", ["--model", "zoo-rope@yarn:factor=2|4"], "a model name takes one"),
        ("sweep", ["--model", "zoo-rope@sliding:window=8"], "is no SPEC"),
        ("sweep", ["--model", "zoo-nope@none"], "no model 'zoo-nope@none'"),
        ("sweep", ["--model", "zoo-rope"], "no scaling given"),
        ("sweep", ["--scaling", "none", "--attention", "self_extend:group_size=4"], "window"),
        ("sweep", ["--scaling", "none", "--attention", "dca:chunk_size=64,local_window=64"], "local_window"),
        ("sweep", ["--scaling", "none", "--attention", "sliding:window=8"], "unknown attention type"),
        (
            "sweep",
            ["--model", "zoo-alibi", "--scaling", "none", "--attention", RULES[0]],
            "does not apply self_extend attention",
        ),
    ],
)
def test_conflicting_or_bad_configurations_fail_before_any_request(
    zoo_server: LiveServer, command: str, grid: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model name that sets the scaling (or rule) beside --scaling (or --attention), a bad name
    or a bad rule: exit 1 with the reason, and nothing tokenized, scored or generated."""
    before = requests_seen(zoo_server)
    text = ["--corpus", "pydoc-topics"] if command == "sweep" else []
    assert main(["--url", zoo_server.base_url, command, *text, "--lengths", "300", *grid]) == 1
    _, err = capsys.readouterr()
    assert message in err, err
    after = requests_seen(zoo_server)
    for endpoint in ("/score", "/tokenize", "/generate", "/tokenizer_info"):
        assert count(after, endpoint) == count(before, endpoint), endpoint


def test_cli_sweep_prints_json_table_and_plots(
    zoo_server: LiveServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT[:3000], encoding="utf-8")
    common = ["--url", zoo_server.base_url, "sweep", "--text-file", str(text_file), "--lengths", "100,300"]
    grid = ["--scaling", "none", "--scaling", "yarn:factor=2|4,original_max_position_embeddings=256"]
    before = requests_seen(zoo_server)
    assert main([*common, *grid, "--json", "--plot", str(tmp_path / "sweep.svg"), "--progress"]) == 0
    assert scores_sent(zoo_server, before) == 3  # one pass per scaling
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert set(printed) == {"model", "cells", "wall_s"}
    assert len(printed["cells"]) == 6
    assert all(
        set(cell) == {"length", "scaling", "attention", "tokens", "bits_per_token", "tail_bits_per_token"}
        and cell["attention"] is None  # no --attention: no pe_attention sent
        for cell in printed["cells"]
    )
    assert printed["cells"][2]["scaling"] == {
        "type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 256,
    }
    assert [cell["tail_bits_per_token"] is None for cell in printed["cells"]] == [True, False] * 3
    assert "6/6 cells" in err  # the progress bar, on stderr
    assert svg_panels(tmp_path / "sweep.svg") == 2  # the whole prefix, and past native

    monkeypatch.setattr("sys.stdin", text_file.open(encoding="utf-8"))
    plot = tmp_path / "sweep.png"
    stdin_args = ["--url", zoo_server.base_url, "sweep", "--text-file", "-", "--lengths", "100,300"]
    assert main([*stdin_args, *grid, "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "yarn x2 (orig=256)" in table and "past 256" in table
    assert plot.read_bytes().startswith(b"\x89PNG")

    before = requests_seen(zoo_server)
    crossed = [*common, "--scaling", "none", "--scaling", "linear:factor=2", "--attention", RULES[0]]
    assert main([*crossed, "--attention", "rerope:window=64", "--json"]) == 0
    assert scores_sent(zoo_server, before) == 4  # one pass per (scaling, rule)
    printed = json.loads(capsys.readouterr().out)
    assert [(cell["scaling"]["type"], cell["attention"]) for cell in printed["cells"][::2]] == [
        (scaling, rule)
        for scaling in ("none", "linear")
        for rule in ({"type": "self_extend", "group_size": 4, "window": 64}, {"type": "rerope", "window": 64})
    ]
    assert main([*crossed, "--plot", str(tmp_path / "crossed.svg")]) == 0
    table = capsys.readouterr().out
    for name in ("none + self_extend (group_size=4,window=64)", "linear x2 + self_extend"):
        assert name in table and name in (tmp_path / "crossed.svg").read_text()


def svg_panels(path: Path) -> int:
    """The axes matplotlib drew in an SVG plot (each is a `<g id="axes_N">`)."""
    text = path.read_text()
    assert "<svg" in text
    return len(re.findall(r'<g id="axes_\d+">', text))


def test_a_sweep_within_the_native_context_plots_no_empty_panel(
    zoo_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No length past the native 256: no tail figure, so the plot is the whole-prefix panel alone."""
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT[:3000], encoding="utf-8")
    plot = tmp_path / "within.svg"
    args = ["--url", zoo_server.base_url, "sweep", "--text-file", str(text_file), "--lengths", "64,200"]
    assert (
        main([*args, "--scaling", "none", "--scaling", "linear:factor=2", "--json", "--plot", str(plot)]) == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert [cell["tail_bits_per_token"] for cell in printed["cells"]] == [None] * 4
    assert svg_panels(plot) == 1
    assert "whole prefix" in plot.read_text() and "past native" not in plot.read_text()


def test_a_ruler_plot_of_groups_with_different_lengths_leaves_the_missing_cells_blank(tmp_path: Path) -> None:
    """Groups of the RULER bench run apart (none at 4k and 8k, yarn at 8k only): one plot of them
    all draws every configuration's cells and marks a length it lacks instead of failing."""
    cells = [
        RulerCell(task=task, length=length, scaling=scaling, samples=10, score=0.5)
        for scaling, lengths in ((NoScaling(), (4096, 8192)), (YarnScaling(factor=2), (8192,)))
        for task in ("niah_single", "vt")
        for length in lengths
    ]
    plot = tmp_path / "ruler.svg"
    plot_ruler(RulerResult(model="m", cells=cells, wall_s=1.0, samples=[], chat=True), plot)
    drawn = plot.read_text()
    assert drawn.count("—") == 2 and "50%" in drawn


def test_a_passkey_plot_of_stages_run_apart_leaves_the_missing_cells_blank(tmp_path: Path) -> None:
    """bench.attention merges passkey stages run apart (none at 8k and 12k, yarn at 12k only): the
    plot draws every configuration's cells and marks a length one lacks instead of failing."""
    cells = [
        PasskeyCell(length=length, depth=depth, scaling=scaling, trials=5, correct=5)
        for scaling, lengths in ((NoScaling(), (8192, 12288)), (YarnScaling(factor=2), (12288,)))
        for length in lengths
        for depth in (0.1, 0.9)
    ]
    plot = tmp_path / "passkey.svg"
    plot_passkey(PasskeyResult(model="m", cells=cells, wall_s=1.0, chat=True), plot)
    drawn = plot.read_text()
    assert drawn.count("—") == 2 and "100%" in drawn


def svg_size(path: Path) -> tuple[float, float]:
    """An SVG plot's width and height in points."""
    found = re.search(r'<svg[^>]*width="([\d.]+)pt" height="([\d.]+)pt"', path.read_text())
    assert found is not None
    return float(found.group(1)), float(found.group(2))


def test_a_plot_of_many_configurations_wraps_its_panels_into_lines(tmp_path: Path) -> None:
    """bench.attention's eight passkey rows in one line ran their titles into each other: past four
    configurations the panels go on a further line, as wide as four and taller, each one drawn."""

    def plot(configurations: int) -> Path:
        scalings: list[NoScaling | YarnScaling] = [NoScaling()]
        scalings += [YarnScaling(factor=factor) for factor in range(2, configurations + 1)]
        cells = [
            PasskeyCell(length=8192, depth=depth, scaling=scaling, trials=5, correct=5)
            for scaling in scalings
            for depth in (0.1, 0.9)
        ]
        path = tmp_path / f"passkey-{configurations}.svg"
        plot_passkey(PasskeyResult(model="m", cells=cells, wall_s=1.0, chat=True), path)
        return path

    four, six = plot(4), plot(6)
    assert svg_panels(six) == 6 + 1  # the heatmaps and the colour bar, no empty panel
    (four_wide, four_high), (six_wide, six_high) = svg_size(four), svg_size(six)
    assert six_wide == four_wide and six_high > 1.5 * four_high


def test_sweep_table_shows_only_what_has_data() -> None:
    """Within the native context there is no tail: no all-dash second table. Past it, the tail
    table has the lengths that pass it, and rows name the scaling and the rule."""

    def cell(length: int, attention: SelfExtendAttention | None = None) -> SweepCell:
        tail = 2.5 if length > NATIVE else None
        return SweepCell(
            length=length,
            scaling=ALIAS_SCALING,
            attention=attention,
            tokens=length,
            bits_per_token=2.0,
            tail_bits_per_token=tail,
        )

    within = SweepResult(model="m", cells=[cell(64), cell(200)], wall_s=1.0, native_context=NATIVE)
    lines = sweep_table(within).splitlines()
    assert len(lines) == 4 and not any("past" in line for line in lines)  # title, head, rule, one row
    assert lines[-1].split() == ["yarn", "x4", "(orig=256)", "2.000", "2.000"]

    rule = SelfExtendAttention(group_size=4, window=64)
    beyond = SweepResult(
        model="m", cells=[cell(64, rule), cell(200, rule), cell(400, rule)], wall_s=1.0, native_context=NATIVE
    )
    head, tail = sweep_table(beyond).split("\n\n")
    assert "yarn x4 (orig=256) + self_extend (group_size=4,window=64)" in head
    assert tail.splitlines()[1].split() == ["past", "256", "400"]  # only the length past native
    assert tail.splitlines()[-1].split()[-1] == "2.500"


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (["--lengths", "128", "--scaling", "rotary:factor=2"], "unknown scaling type 'rotary'"),
        (["--lengths", "128", "--scaling", "yarn:factor=2|0"], "factor must be a finite positive number"),
        (["--lengths", "128", "--scaling", "linear:factor=-4"], "factor must be a finite positive number"),
        (["--lengths", "128", "--scaling", "ntk:factor=0.5"], "factor must be at least 1"),
        (["--lengths", "128", "--scaling", "yarn:factor=2,beta=3"], "beta"),
        (["--lengths", f"128,{MAX_CONTEXT + 1}", "--scaling", "none"], f"max_context {MAX_CONTEXT}"),
        (["--model", "zoo-alibi", "--lengths", "128", "--scaling", "yarn:factor=2"], "does not take yarn"),
        (["--lengths", "128", "--scaling", "none", "--plot", "out.pdf"], ".png or .svg"),
    ],
)
def test_bad_grids_fail_before_anything_is_scored(
    zoo_server: LiveServer, grid: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = requests_seen(zoo_server)
    for command in ("sweep", "passkey"):
        text = ["--corpus", "pydoc-topics"] if command == "sweep" else []
        assert main(["--url", zoo_server.base_url, command, *text, *grid]) == 1
        _, err = capsys.readouterr()
        assert message in err, err
    after = requests_seen(zoo_server)
    for endpoint in ("/score", "/tokenize", "/generate", "/tokenizer_info"):
        assert count(after, endpoint) == count(before, endpoint), endpoint


def test_the_sdk_raises_grid_errors_too(zoo: PEClient) -> None:
    with pytest.raises(GridError, match="length 1: "):
        sweep(zoo, text=TEXT, lengths=[1], scalings=["none"])
    with pytest.raises(GridError, match="depths must lie between 0 and 1"):
        passkey(zoo, lengths=[128], depths=[1.5], scalings=["none"])


def test_an_interrupted_sweep_cancels_its_requests_in_flight(zoo_server: LiveServer) -> None:
    """Cancelled at the first finished cell: every other pass's request is closed, and the server
    cancels it (499) rather than scoring it for nobody. Dynamic NTK's 64-token cell is a pass of its
    own, done first; the others are one full-length pass per scaling."""
    before = requests_seen(zoo_server)
    scalings = ["none", "linear:factor=8", "ntk:factor=8", "yarn:factor=8", "dynamic:factor=8"]
    finished: list[SweepCell] = []

    async def interrupted() -> None:
        async with AsyncPEClient(zoo_server.base_url, timeout=120.0) as client:
            task = asyncio.current_task()
            assert task is not None

            def stop_at_first(cell: SweepCell) -> None:
                finished.append(cell)
                task.cancel()

            with pytest.raises(asyncio.CancelledError):
                await async_sweep(
                    client, text=TEXT, lengths=[64, MAX_CONTEXT], scalings=scalings, on_cell=stop_at_first
                )

    asyncio.run(interrupted())
    passes = len(scalings) + 1  # dynamic's two lengths are two passes
    seen = requests_seen(zoo_server)
    for _ in range(100):  # the server notices a closed connection within a few engine steps
        cancelled = count(seen, "/score", "499") - count(before, "/score", "499")
        scored = count(seen, "/score", "200") - count(before, "/score", "200")
        if cancelled + scored == passes:
            break
        asyncio.run(asyncio.sleep(0.1))
        seen = requests_seen(zoo_server)
    assert finished  # cancelled at the first cell back (others may land in the same loop turn)
    assert cancelled + scored == passes
    assert cancelled >= len(scalings)  # at least every full-length pass was still running


def test_passkey_sdk_and_cli(
    zoo: PEClient, zoo_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = requests_seen(zoo_server)
    grid = ["none", "yarn:factor=2"]
    result = passkey(zoo, lengths=[512, 384], depths=[0.1, 0.9], scalings=grid, trials=1)
    generated = count(requests_seen(zoo_server), "/generate", "200") - count(before, "/generate", "200")
    assert generated == 2 * 2 * 2 * 1  # scalings x lengths x depths x trials, one generation each
    assert not result.chat  # the zoo has no chat template: a completion prompt
    assert [(cell.scaling.type, cell.length, cell.depth) for cell in result.cells] == [
        (scaling, length, depth)
        for scaling in ("none", "yarn")
        for length in (384, 512)
        for depth in (0.1, 0.9)
    ]
    assert all(cell.trials == 1 and 0 <= cell.correct <= 1 for cell in result.cells)
    assert all(
        cell.attention is None and cell.interval == wilson_interval(cell.correct, 1) for cell in result.cells
    )

    heatmap = tmp_path / "passkey.svg"
    args = ["--url", zoo_server.base_url, "passkey", "--lengths", "384,512", "--depths", "0.1,0.9"]
    args += ["--scaling", "none", "--scaling", "yarn:factor=2", "--json", "--plot", str(heatmap)]
    assert main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"cells"}
    assert printed["cells"] == [cell.model_dump(mode="json") for cell in result.cells]  # same seed, same keys
    assert all(
        set(cell) == {"length", "depth", "scaling", "attention", "trials", "correct", "interval"}
        and cell["attention"] is None
        for cell in printed["cells"]
    )
    assert "<svg" in heatmap.read_text()


def test_passkey_prompts_sharing_a_filler_reuse_it_from_the_prefix_cache(
    zoo: PEClient, zoo_server: LiveServer
) -> None:
    """A trial's filler is the same in every cell and its prompts go in turn, most filler before
    the key first: the later prompts read the filler before their key from the prefix cache.
    With a filler drawn per cell (as before), only the prompt's first line could be shared."""
    with httpx.Client(base_url=zoo_server.base_url) as http:
        hits_before = metric_sum(http, "pe_prefix_cache_hits_total")
        queried_before = metric_sum(http, "pe_prefix_cache_queries_total")
        passkey(zoo, lengths=[512, 448], depths=[0.9, 0.5], scalings=["none"], trials=1, seed=4242)
        hits = metric_sum(http, "pe_prefix_cache_hits_total") - hits_before
        queried = metric_sum(http, "pe_prefix_cache_queries_total") - queried_before
    # In turn: 512 at 0.9 (nothing cached), 448 at 0.9, 512 at 0.5, 448 at 0.5: each later prompt
    # shares about its depth times its length, less a partial block.
    assert queried >= 4 * 400
    assert hits >= 0.8 * (0.9 * 448 + 0.5 * 512 + 0.5 * 448) - 3 * 16


def test_ruler_cli_json_dump_and_plot(
    zoo_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every task at one length, one sample each (the SDK test below averages several): each
    cell's score is `string_match_all` of its dumped sample, and each prompt is within 10% of the
    length in the model's own tokens."""
    before = requests_seen(zoo_server)
    dump, plot = tmp_path / "ruler.jsonl", tmp_path / "ruler.svg"
    args = ["--url", zoo_server.base_url, "ruler", "--lengths", "880", "--samples", "1", "--seed", "3"]
    assert main([*args, "--json", "--dump", str(dump), "--plot", str(plot), "--progress"]) == 0
    out, err = capsys.readouterr()
    generated = count(requests_seen(zoo_server), "/generate", "200") - count(before, "/generate", "200")
    assert generated == len(TASKS)
    assert f"{len(TASKS)}/{len(TASKS)} samples" in err  # the progress bar, on stderr
    printed = json.loads(out)
    assert set(printed) == {"model", "cells", "wall_s"} and printed["model"] == "zoo-rope"
    assert [cell["task"] for cell in printed["cells"]] == list(TASKS)
    assert all(
        set(cell) == {"task", "length", "scaling", "attention", "samples", "score"}
        and (cell["length"], cell["scaling"], cell["attention"], cell["samples"])
        == (880, {"type": "none"}, None, 1)
        for cell in printed["cells"]
    )
    lines = [json.loads(line) for line in dump.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(TASKS)
    for cell in printed["cells"]:
        (sample,) = [line for line in lines if line["task"] == cell["task"]]
        assert cell["score"] == string_match_all(sample["output"], sample["answers"])
    for line in lines:
        assert set(line) == {
            "task",
            "length",
            "scaling",
            "attention",
            "prompt",
            "prompt_tokens",
            "answers",
            "output",
        }
        assert 0.9 * 880 <= line["prompt_tokens"] <= 880
        assert len(zoo_server_tokens(zoo_server, line["prompt"])) == line["prompt_tokens"]
        assert all(answer in line["prompt"] for answer in line["answers"])
    assert "<svg" in plot.read_text()


def zoo_server_tokens(server: LiveServer, prompt: str) -> list[int]:
    response = httpx.post(server.url("/tokenize"), json={"prompt": prompt}, timeout=10.0)
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_ruler_sdk_asks_every_sample_under_every_scaling(zoo: PEClient) -> None:
    """The sync SDK call: the same prompts under each scaling, a cell's score the mean of its
    samples' `string_match_all` (the CLI test above has one sample per cell)."""
    result = ruler(zoo, tasks=["vt"], lengths=[600], samples=2, scalings=["none", "linear:factor=2"], seed=9)
    assert [(cell.task, cell.scaling.type, cell.samples) for cell in result.cells] == [
        ("vt", "none", 2),
        ("vt", "linear", 2),
    ]
    assert [sample.prompt for sample in result.samples[:2]] == [
        sample.prompt for sample in result.samples[2:]
    ]
    assert len({sample.prompt for sample in result.samples}) == 2
    for cell, samples in zip(result.cells, (result.samples[:2], result.samples[2:]), strict=True):
        assert cell.score == pytest.approx(
            sum(string_match_all(sample.output, sample.answers) for sample in samples) / 2
        )


def test_ruler_needle_prompts_of_one_length_reuse_their_haystack_from_the_prefix_cache(
    zoo: PEClient, zoo_server: LiveServer
) -> None:
    """A needle task's samples of one length open with the same haystack up to their first needle:
    they go in turn, most haystack first, so each later one reads that opening from the prefix
    cache. Sent all at once (as before), they were prefilled side by side and shared nothing."""
    with httpx.Client(base_url=zoo_server.base_url) as http:
        hits_before = metric_sum(http, "pe_prefix_cache_hits_total")
        result = ruler(zoo, tasks=["niah_single"], lengths=[640], samples=4, seed=31)
        hits = metric_sum(http, "pe_prefix_cache_hits_total") - hits_before
    prompts = [zoo.tokenize(sample.prompt) for sample in result.samples]
    # Each prompt's longest opening shared with another; in turn, every prompt but the first
    # reads its own from the one before it, less a partial block (and a token BPE joins across).
    shared = sorted(
        max(_common_prefix(one, other) for other in prompts if other is not one) for one in prompts
    )
    assert shared[0] > 16  # the seed puts every first needle past the first block
    assert hits >= sum(shared[:-1]) - 3 * 2 * 16  # 608 of 648 here; 0 when sent all at once


def _common_prefix(one: list[int], other: list[int]) -> int:
    return next(
        (index for index, (a, b) in enumerate(zip(one, other, strict=False)) if a != b),
        min(len(one), len(other)),
    )


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (["--tasks", "niah_single,qa_squad"], "unknown task 'qa_squad'"),
        (["--scaling", "yarn:factor=0.5"], "factor must be at least 1"),
        (["--attention", "self_extend:group_size=4"], "window"),
        (["--attention", "sliding:window=8"], "unknown attention type 'sliding'"),
        (["--samples", "0"], "samples must be at least 1"),
        (["--lengths", f"{MAX_CONTEXT + 1}"], f"max_context {MAX_CONTEXT}"),
        (["--haystack", "/nonexistent/haystack.txt"], "--haystack /nonexistent/haystack.txt"),
        (["--plot", "ruler.pdf"], ".png or .svg"),
    ],
)
def test_bad_ruler_grids_fail_before_any_request(
    zoo_server: LiveServer, grid: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = requests_seen(zoo_server)
    args = ["--url", zoo_server.base_url, "ruler", "--lengths", "512", *grid]
    assert main(args) == 1
    _, err = capsys.readouterr()
    assert message in err, err
    after = requests_seen(zoo_server)
    for endpoint in ("/score", "/tokenize", "/generate", "/tokenizer_info"):
        assert count(after, endpoint) == count(before, endpoint), endpoint
