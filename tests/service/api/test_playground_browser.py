"""The playground page in a real headless Chromium (Debian's, driven by Playwright) against a live
server on loopback, with an API key: the page's results must equal the SDK's for the same requests,
and each attention rule it sends (`pe_attention`) must give what a direct /generate or /score with
that field gives.

The whole page is one browser session: the key is entered once and survives reloads, and every
test ends by asserting that the page logged no console error and no request failed. Set
`PLAYGROUND_SCREENSHOTS=docs/img` to refresh the README's screenshots; otherwise they are written
to a temporary directory (taking them is still exercised).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from pe_client import PEClient
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, sync_playwright

from service.api.loading import bundled_zoo
from service.api.routes.playground import STATIC_DIR
from tests.live_server import LiveServer, OptionValue, live_server
from tests.service.api.helpers import metric_sum, wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# What works on a closed network, as root: no sandbox, nothing fetched in the background.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ZOO_ROPE = next((path for path in bundled_zoo() if path.name == "zoo-rope"), None)
# A second model whose scheme takes fewer rules (standard and streaming): the page offers only those.
ZOO_ALIBI = next((path for path in bundled_zoo() if path.name == "zoo-alibi"), None)
API_KEY = "playground-key"
SCALINGS: dict[str, dict[str, Any]] = {
    "none": {"type": "none"},
    "linear": {"type": "linear", "factor": 4.0},
    "yarn": {"type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0},
}
PROMPT = "def fibonacci(n):\n"
SAMPLING = {"max_new_tokens": 24, "temperature": 0.8, "seed": 7}
# Past the zoo's native context of 256 tokens, so the scalings differ where the plot is read.
SCORED_CHARS = 700
PAGE_TIMEOUT_MS = 180_000
# The sweep: lengths on both sides of the native 256 (the reference, no scaling at 256, is then one
# more cell, read from the unscaled pass), a grid that expands `factor=2|4`, and dynamic NTK, whose
# positions depend on the total length (one pass per length; the others one pass per scaling).
NATIVE = 256
SWEEP_TEXT_CHARS = 600
SWEEP_LENGTHS = [128, 384, 512]
SWEEP_GRID = "none\nlinear:factor=2\nyarn:factor=2|4\ndynamic:factor=2"
SWEEP_SCALINGS: list[dict[str, Any]] = [
    {"type": "none"},
    {"type": "linear", "factor": 2},
    {"type": "yarn", "factor": 2},
    {"type": "yarn", "factor": 4},
    {"type": "dynamic", "factor": 2},
]
SWEEP_PASSES = 4 + len(SWEEP_LENGTHS)
SWEEP_THRESHOLD = 0.25
CANCELLED_SCORES = 'endpoint="/score",protocol="http",status="499"'
MAX_CONTEXT = 1024
RULE_TYPES = ["standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming"]
EDITOR_SCALINGS = ["none", "linear", "ntk", "dynamic", "yarn", "llama3"]
# Rules crossed with scalings in the sweep: fields left out take the page's defaults (`rule_defaults`).
RULE_SWEEP_GRID = "none\nlinear:factor=2"
RULE_SWEEP_RULES = "standard\nstreaming:sink_tokens=4,window=64\nleaky_rerope:window=64,logn=128"
RULE_SWEEP_LENGTHS = [128, 384]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian's chromium is absent (.ci/run installs it)"
    ),
    pytest.mark.skipif(ZOO_ROPE is None, reason="no bundled models/zoo-rope checkpoint"),
    pytest.mark.skipif(ZOO_ALIBI is None, reason="no bundled models/zoo-alibi checkpoint"),
]


@dataclass
class PageProblems:
    """Console errors, uncaught exceptions and failed requests seen by the page."""

    seen: list[str] = field(default_factory=list)

    def console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.seen.append(f"console: {message.text}")

    def page_error(self, error: Exception) -> None:
        self.seen.append(f"exception: {error}")

    def request_failed(self, request: Request) -> None:
        self.seen.append(f"request failed: {request.method} {request.url} ({request.failure})")

    def response(self, response: Response) -> None:
        if response.status >= 400:
            self.seen.append(f"HTTP {response.status}: {response.request.method} {response.url}")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    assert ZOO_ROPE is not None and ZOO_ALIBI is not None
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": MAX_CONTEXT,
        "api_key": API_KEY,
    }
    # zoo-rope first: the page's default model.
    with live_server([ZOO_ROPE, ZOO_ALIBI], options=options, env={"OMP_NUM_THREADS": "1"}) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(server: LiveServer) -> Iterator[PEClient]:
    with PEClient(server.base_url, api_key=API_KEY, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def api(server: LiveServer) -> Iterator[httpx.Client]:
    """Direct calls with the key, for the bodies the page sent."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120.0) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def problems() -> PageProblems:
    return PageProblems()


@pytest.fixture(scope="module")
def page(browser: Browser, server: LiveServer, problems: PageProblems) -> Iterator[Page]:
    """The page with the key entered once, at a URL that ticks the three scalings."""
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    opened = context.new_page()
    opened.set_default_timeout(PAGE_TIMEOUT_MS)
    opened.on("console", problems.console)
    opened.on("pageerror", problems.page_error)
    opened.on("requestfailed", problems.request_failed)
    opened.on("response", problems.response)
    ticked = {f"scaling.{name}": "1" if name in SCALINGS else "0" for name in (*SCALINGS, "ntk", "dynamic")}
    settings = {**ticked, "scaling.llama3": "0", "window": "1", "temperature": "0.8", "max_new_tokens": "24"}
    opened.goto(server.url("/playground?" + urlencode(settings)))
    opened.wait_for_selector("#status.error")
    # Before the key is entered the page's one call, GET /models, is refused: that is how it learns
    # it needs one. Nothing else may fail, then or later.
    assert sorted(problems.seen) == [
        "HTTP 401: GET " + server.url("/models"),
        "console: Failed to load resource: the server responded with a status of 401 (Unauthorized)",
    ]
    problems.seen.clear()
    opened.fill("#api-key", API_KEY)
    opened.click("#key-form button")
    opened.wait_for_selector("#model option[value='zoo-rope']", state="attached")
    yield opened
    context.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = os.environ.get("PLAYGROUND_SCREENSHOTS")
    directory = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@pytest.fixture(autouse=True)
def no_page_problems(problems: PageProblems) -> Iterator[None]:
    yield
    assert problems.seen == []


def run_section(page: Page, button: str, section: str) -> None:
    page.click(button)
    page.wait_for_selector(f"#{section}[data-state='done'], #{section}[data-state='error']")
    assert page.get_attribute(f"#{section}", "data-state") == "done", page.text_content("#status")


def test_three_scalings_stream_the_sdk_texts(page: Page, sdk: PEClient, screenshots: Path) -> None:
    page.fill("#prompt", PROMPT)
    run_section(page, "#compare", "compare-section")
    columns = page.locator(".column")
    assert columns.count() == len(SCALINGS)
    for name, scaling in SCALINGS.items():
        column = page.locator(f"#column-{name}")
        assert column.get_attribute("data-state") == "done"
        expected = sdk.generate(prompt=PROMPT, model="zoo-rope", pe_scaling=scaling, **SAMPLING)  # type: ignore[arg-type]
        assert column.locator(".column-text").text_content() == expected.text
        assert f"{expected.pe.attention_factor:.4f}" in (column.locator("dl").text_content() or "")
    page.locator("#compare-section").screenshot(path=screenshots / "playground-compare.png")


def test_surprisal_plot_has_one_series_per_scaling_and_a_point_per_token(
    page: Page, sdk: PEClient, screenshots: Path
) -> None:
    text = (STATIC_DIR / "sample.txt").read_text()[:SCORED_CHARS]
    page.fill("#document", text)
    run_section(page, "#score", "breaks-section")
    series = page.evaluate(
        """() => window.playground.chart("surprisal-chart").data.datasets
             .filter((d) => d.scaling).map((d) => [d.scaling, d.data.map((p) => p.y)])"""
    )
    assert [name for name, _ in series] == list(SCALINGS)
    for name, values in series:
        scored = sdk.score(prompt=text, model="zoo-rope", pe_scaling=SCALINGS[name])  # type: ignore[arg-type]
        assert len(values) == scored.num_tokens
        # A moving average over one token: the plot is the surprisal itself, in bits. The page's three
        # documents are scored in one batch, the SDK's one alone: float32 sums differ by ~1e-5.
        expected = [None, *(-logprob / math.log(2) for logprob in scored.token_logprobs[1:])]  # type: ignore[operator]
        assert values[0] is None
        assert values[1:] == pytest.approx(expected[1:], abs=1e-4)
    sweep = page.evaluate(
        """() => window.playground.chart("sweep-chart").data.datasets.map((d) => d.data.length)"""
    )
    assert sweep == [3] * len(SCALINGS)  # L = 256, 512 and the whole text (701 tokens)
    page.fill("#window", "32")  # the readable view, for the picture
    run_section(page, "#score", "breaks-section")
    page.locator("#breaks-section").screenshot(path=screenshots / "playground-surprisal.png")


def test_inspector_draws_a_heatmap_of_the_rope_table(page: Page, screenshots: Path) -> None:
    page.select_option("#inspect-pe", "rope")
    page.select_option("#inspect-scaling", "yarn")
    page.fill("#inspect-length", "512")
    run_section(page, "#inspect", "inspect-section")
    cells = page.evaluate("""() => window.playground.chart("inspect-heatmap").data.datasets[0].data.length""")
    assert cells == 128 * 16  # 512 positions thinned to 128 rows, head_dim 32: 16 frequencies
    description = page.get_attribute("#inspect-heatmap", "aria-label") or ""
    assert description.startswith("Heatmap of cos by position")
    result = page.evaluate("""() => window.playground.results["inspect-section"]""")
    assert result["scaling"]["type"] == "yarn"
    assert len(result["rope"]["cos"]) == 512
    page.screenshot(path=screenshots / "playground.png", full_page=True)


def test_inspector_draws_alibi_s_causal_bias(page: Page) -> None:
    page.select_option("#inspect-pe", "alibi")
    page.select_option("#inspect-scaling", "none")
    page.fill("#inspect-length", "32")
    page.fill("#inspect-heads", "4")
    run_section(page, "#inspect", "inspect-section")
    cells = page.evaluate("""() => window.playground.chart("inspect-heatmap").data.datasets[0].data.length""")
    assert cells == 32 * 33 // 2  # keys up to the query only
    slopes = page.evaluate("""() => window.playground.chart("inspect-lines").data.datasets[0].data.length""")
    assert slopes == 4
    page.select_option("#inspect-pe", "rope")  # leave the page as the reload test expects it
    page.select_option("#inspect-scaling", "yarn")


def rule_defaults(native: int, max_context: int, window: int | None = None) -> dict[str, dict[str, int]]:
    """The fields the page fills in for a rule left blank, from the model's context: positions kept
    within the native context N (Leaky ReRoPE's leak for `window` when given, else for N/2)."""
    half = native // 2
    leaky_window = half if window is None else window
    leak = max(2, math.ceil((max_context - leaky_window) / max(native - leaky_window, 1)))
    return {
        "standard": {},
        "self_extend": {"group_size": 4, "window": native // 4},
        "rerope": {"window": half},
        "leaky_rerope": {"window": half, "leak": leak},
        "dca": {"chunk_size": native * 3 // 4, "local_window": native // 16},
        "streaming": {"sink_tokens": 4, "window": native - 4 - 1},
    }


def choose(page: Page, scalings: set[str], rules: set[str]) -> None:
    """Tick exactly these scalings and attention rules in the settings."""
    for name in EDITOR_SCALINGS:
        page.set_checked(f"#use-{name}", name in scalings)
    for name in RULE_TYPES:
        page.set_checked(f"#use-attention-{name}", name in rules)


def sweep_bits(logprobs: list[float | None], start: int, length: int) -> float | None:
    """Mean -log2 p of tokens start..length-1 (0-based), the SPEC's sweep figures; None if empty."""
    if length <= start:
        return None
    return -sum(logprobs[start:length]) / (length - start) / math.log(2)  # type: ignore[arg-type]


@dataclass
class Traffic:
    """The requests a page sent and what became of them while recording, in order: ("sent",
    "answered" or "failed", url); and the JSON body of each POST, in the order sent."""

    events: list[tuple[str, str]] = field(default_factory=list)
    posts: list[tuple[str, Any]] = field(default_factory=list)

    def request(self, request: Request) -> None:
        self.events.append(("sent", request.url))
        if request.method == "POST":
            self.posts.append((request.url, request.post_data_json))

    def bodies(self, url: str) -> list[Any]:
        return [body for posted, body in self.posts if posted == url]

    def response(self, response: Response) -> None:
        self.events.append(("answered", response.url))

    def failure(self, request: Request) -> None:
        self.events.append(("failed", request.url))

    @property
    def sent(self) -> list[str]:
        return [url for kind, url in self.events if kind == "sent"]

    @property
    def answered(self) -> list[str]:
        return [url for kind, url in self.events if kind == "answered"]

    def settled(self, url: str) -> bool:
        """Whether every request sent to `url` has been answered or has failed."""
        ended = sum(1 for kind, seen in self.events if kind != "sent" and seen == url)
        return ended == self.sent.count(url)

    def wait_until_settled(self, page: Page, url: str, timeout_s: float = 10.0) -> None:
        """Chromium reports an aborted request some time after the script aborted it; the sync
        API delivers those events only while a Playwright call runs, so this waits through
        the page rather than sleeping."""
        deadline = time.monotonic() + timeout_s
        while not self.settled(url):
            assert time.monotonic() < deadline, f"requests to {url} still open: {self.events}"
            page.wait_for_timeout(25)


@contextlib.contextmanager
def traffic(page: Page) -> Iterator[Traffic]:
    seen = Traffic()
    page.on("request", seen.request)
    page.on("response", seen.response)
    page.on("requestfailed", seen.failure)
    try:
        yield seen
    finally:
        page.remove_listener("request", seen.request)
        page.remove_listener("response", seen.response)
        page.remove_listener("requestfailed", seen.failure)


def start_sweep(page: Page, text: str, lengths: str, grid: str, rules: str = "standard") -> None:
    page.fill("#sweep-text", text)
    page.fill("#sweep-lengths", lengths)
    page.fill("#sweep-grid", grid)
    page.fill("#sweep-rules", rules)
    page.click("#sweep")


def finish(page: Page, section: str) -> str:
    """The section's end state once it has one."""
    page.wait_for_selector(
        f"#{section}:is([data-state='done'], [data-state='error'], [data-state='cancelled'])"
    )
    return page.get_attribute(f"#{section}", "data-state") or ""


def test_sweep_cells_equal_score_alone_and_draw(
    page: Page, server: LiveServer, sdk: PEClient, screenshots: Path
) -> None:
    text = (STATIC_DIR / "sample.txt").read_text()[:SWEEP_TEXT_CHARS]
    page.fill("#sweep-threshold", str(SWEEP_THRESHOLD))
    with traffic(page) as seen:
        start_sweep(page, text, ", ".join(map(str, SWEEP_LENGTHS)), SWEEP_GRID)
        assert finish(page, "sweep-section") == "done", page.text_content("#sweep-message")
    # One tokenization, then one /score per scaling (its longest length, 512, which holds the
    # reference's 256 too) and one per dynamic cell, all sent before the first answer (the browser
    # holds back those past its six connections; the server batches the rest).
    scores = SWEEP_PASSES
    assert seen.sent.count(server.url("/tokenize")) == 1
    assert seen.sent.count(server.url("/score")) == scores
    first_answer = seen.events.index(("answered", server.url("/score")))
    assert seen.events[:first_answer].count(("sent", server.url("/score"))) == scores
    rendered = page.evaluate(
        """() => [...document.querySelectorAll("#sweep-table tbody tr")].map((row) => [
             JSON.parse(row.dataset.scaling),
             [...row.querySelectorAll("td[data-length]")].map((td) => [
               Number(td.dataset.length), Number(td.dataset.bits), td.dataset.tailBits,
               td.firstChild.textContent,
             ]),
             row.lastElementChild.textContent])"""
    )
    assert [scaling for scaling, _, _ in rendered] == SWEEP_SCALINGS
    tokens = sdk.score(prompt=text, model="zoo-rope").tokens
    alone: dict[tuple[int, int], float] = {}
    for index, (scaling, cells, _) in enumerate(rendered):
        assert [length for length, *_ in cells] == SWEEP_LENGTHS
        for length, bits, tail, shown in cells:
            scored = sdk.score(tokens=tokens[:length], model="zoo-rope", pe_scaling=scaling)  # type: ignore[arg-type]
            expected = sweep_bits(scored.token_logprobs, 1, length)
            assert expected is not None
            alone[index, length] = expected
            # The page's cells are prefixes of longer passes run in batches, the SDK's passes of
            # their own tokens alone: float32 sums differ by ~1e-5; the SPEC allows 1e-3.
            assert bits == pytest.approx(expected, abs=1e-3)
            assert shown == f"{bits:.3f}"
            expected_tail = sweep_bits(scored.token_logprobs, NATIVE, length)
            if expected_tail is None:
                assert tail == "null"
            else:
                assert float(tail) == pytest.approx(expected_tail, abs=1e-3)
    # The break rule the page states, applied to the SDK's figures: the first L >= 256 above the limit.
    reference = sdk.score(tokens=tokens[:NATIVE], model="zoo-rope", pe_scaling={"type": "none"})
    limit = sweep_bits(reference.token_logprobs, 1, NATIVE) + SWEEP_THRESHOLD  # type: ignore[operator]
    assert f"the limit is {limit:.3f}" in (page.text_content("#sweep-reference") or "")
    for index, (_, _, verdict) in enumerate(rendered):
        broken = [length for length in SWEEP_LENGTHS if length >= NATIVE and alone[index, length] > limit]
        assert verdict == (f"breaks at {broken[0]}" if broken else "holds at every length judged")
    curves = page.evaluate(
        """() => window.playground.chart("sweep-curves").data.datasets
             .filter((d) => d.scaling).map((d) => d.data.length)"""
    )
    assert curves == [len(SWEEP_LENGTHS)] * len(SWEEP_SCALINGS)
    cells = page.evaluate("""() => window.playground.chart("sweep-heatmap").data.datasets[0].data.length""")
    assert cells == len(SWEEP_LENGTHS) * len(SWEEP_SCALINGS)
    page.locator("#sweep-section").screenshot(path=screenshots / "playground-sweep.png")


def test_the_rules_offered_are_the_model_s_with_defaults_from_its_context(
    page: Page, api: httpx.Client
) -> None:
    cards = {card["name"]: card for card in api.get("/models").json()["models"]}
    assert cards["zoo-rope"]["supported_attention"] == RULE_TYPES
    assert cards["zoo-alibi"]["supported_attention"] == ["standard", "streaming"]
    offered = """() => [...document.querySelectorAll("#attention-rules .rule")]
                   .filter((row) => row.checkVisibility()).map((row) => row.dataset.rule)"""
    for name in ("zoo-alibi", "zoo-rope"):
        card = cards[name]
        page.select_option("#model", name)
        assert page.evaluate(offered) == card["supported_attention"]
        defaults = rule_defaults(card["native_context"], card["max_context"])
        for rule in card["supported_attention"]:
            for key, value in defaults[rule].items():
                assert page.get_attribute(f"#attention-{rule}-{key}", "placeholder") == str(value)
            assert page.get_attribute(f"#attention-{rule}-logn", "placeholder") == "off"
        if name == "zoo-alibi":
            assert page.is_disabled("#use-attention-dca") and not page.is_checked("#use-attention-dca")
            # The sweep's rules are held to the same list before anything is sent.
            with traffic(page) as seen:
                start_sweep(page, "some text to score", "128", "none", "standard\ndca")
                assert finish(page, "sweep-section") == "error"
            assert seen.sent == []
            message = page.text_content("#sweep-message") or ""
            assert (
                "Attention line 2: this model does not take dca attention (it takes standard, streaming)"
                in message
            )
    # A leak left blank follows the window typed beside it.
    page.fill("#attention-leaky_rerope-window", "64")
    assert page.get_attribute("#attention-leaky_rerope-leak", "placeholder") == str(
        rule_defaults(NATIVE, MAX_CONTEXT, window=64)["leaky_rerope"]["leak"]
    )
    page.fill("#attention-leaky_rerope-window", "")
    choose(page, set(SCALINGS), {"standard"})  # zoo-alibi unticked the scalings it cannot run


def test_compare_sets_rules_side_by_side_each_as_generate_gives_it(
    page: Page, server: LiveServer, api: httpx.Client
) -> None:
    """Two columns that differ only in the rule: each sends its `pe_attention`, shows the text a
    direct /generate of its body gives, and the rule the server echoes."""
    choose(page, {"none"}, {"standard", "self_extend"})
    page.fill("#attention-self_extend-group_size", "")  # the default: 4
    page.fill("#attention-self_extend-window", "8")
    page.fill("#prompt", PROMPT)
    with traffic(page) as seen:
        run_section(page, "#compare", "compare-section")
    rules = [{"type": "standard"}, {"type": "self_extend", "group_size": 4, "window": 8}]
    common = {
        "model": "zoo-rope",
        "prompt": PROMPT,
        **SAMPLING,
        "pe_scaling": {"type": "none"},
        "stream": True,
    }
    sent = seen.bodies(server.url("/generate"))
    assert sent == [{**common, "pe_attention": rule} for rule in rules]
    texts = []
    for body, title in zip(
        sent, ["none + standard", "none + self_extend (group_size=4,window=8)"], strict=True
    ):
        column = page.locator(f"#column-none-{body['pe_attention']['type']}")
        assert column.get_attribute("data-state") == "done"
        direct = api.post("/generate", json={**body, "stream": False})
        assert direct.status_code == 200, direct.text
        expected = direct.json()
        assert column.locator(".column-text").text_content() == expected["text"]
        shown = column.locator("dd[data-term='attention']").text_content() or ""
        assert json.loads(shown) == expected["pe"]["attention"] == body["pe_attention"]
        assert column.locator("h3").text_content() == title
        texts.append(expected["text"])
    assert texts[0] != texts[1]  # the rule took effect: 43 tokens, most pairs past the window of 8


def test_a_rule_the_server_refuses_shows_its_message_beside_the_field(
    page: Page, server: LiveServer, api: httpx.Client, problems: PageProblems
) -> None:
    choose(page, {"none"}, {"dca"})
    page.fill("#attention-dca-chunk_size", "32")
    page.fill("#attention-dca-local_window", "32")
    with traffic(page) as seen:
        run_section(page, "#compare", "compare-section")  # the section ends; its one column failed
    [body] = seen.bodies(server.url("/generate"))
    assert body["pe_attention"] == {"type": "dca", "chunk_size": 32, "local_window": 32}
    direct = api.post("/generate", json={**body, "stream": False})
    assert direct.status_code == 422
    error = direct.json()["error"]
    assert error["param"] == "pe_attention.local_window"
    expected = f"{error['message']} ({error['param']})"
    assert page.locator("#column-none-dca").get_attribute("data-state") == "error"
    assert page.text_content("#attention-dca-local_window-error") == expected
    assert page.get_attribute("#attention-dca-local_window", "aria-invalid") == "true"
    assert page.text_content("#attention-dca-chunk_size-error") == ""
    # The surprisal panel reports the same refusal beside the same field.
    page.fill("#document", "some text to score")
    page.click("#score")
    assert finish(page, "breaks-section") == "error"
    assert page.text_content("#attention-dca-local_window-error") == expected
    refused = [f"HTTP 422: POST {server.url(path)}" for path in ("/generate", "/score")]
    logged = (
        "console: Failed to load resource: the server responded with a status of 422 (Unprocessable Entity)"
    )
    assert sorted(problems.seen) == sorted([*refused, logged, logged])
    problems.seen.clear()
    # Mending the field clears its message.
    page.fill("#attention-dca-local_window", "8")
    assert page.text_content("#attention-dca-local_window-error") == ""
    assert page.get_attribute("#attention-dca-local_window", "aria-invalid") is None


def test_surprisal_crosses_scalings_with_rules_as_score_gives_them(
    page: Page, server: LiveServer, api: httpx.Client
) -> None:
    text = (STATIC_DIR / "sample.txt").read_text()[:SCORED_CHARS]
    choose(page, {"none", "linear"}, {"standard", "rerope"})
    page.fill("#attention-rerope-window", "")  # the default: half the native 256
    page.fill("#attention-rerope-logn", "256")
    page.fill("#window", "1")
    page.fill("#document", text)
    with traffic(page) as seen:
        run_section(page, "#score", "breaks-section")
    rerope = {"type": "rerope", "window": NATIVE // 2, "logn": 256}
    configurations = [(name, rule) for name in ("none", "linear") for rule in ({"type": "standard"}, rerope)]
    sent = seen.bodies(server.url("/score"))
    assert sent == [
        {"model": "zoo-rope", "prompt": text, "pe_scaling": SCALINGS[name], "pe_attention": rule}
        for name, rule in configurations
    ]
    series = page.evaluate(
        """() => window.playground.chart("surprisal-chart").data.datasets
             .filter((d) => d.scaling).map((d) => [d.label, d.attention, d.data.map((p) => p.y)])"""
    )
    listed = page.evaluate(
        """() => [...document.querySelectorAll("#score-resolved li")].map((item) => [
             JSON.parse(item.dataset.scaling), JSON.parse(item.dataset.attention), item.textContent])"""
    )
    labels = [
        "none + standard",
        "none + rerope (window=128,logn=256)",
        "linear + standard",
        "linear + rerope (window=128,logn=256)",
    ]
    assert [label for label, *_ in series] == labels
    for body, (label, attention, values), (scaling, echoed, line) in zip(sent, series, listed, strict=True):
        direct = api.post("/score", json=body)
        assert direct.status_code == 200, direct.text
        scored = direct.json()
        assert attention == echoed == scored["pe"]["attention"] == body["pe_attention"]
        assert scaling == scored["pe"]["scaling"]
        assert line.startswith(f"{label}: scaling ")
        assert values[0] is None
        # Rows with a rule run beside the plain ones in the page's batch, alone here: ~1e-5 apart.
        expected = [-logprob / math.log(2) for logprob in scored["token_logprobs"][1:]]
        assert values[1:] == pytest.approx(expected, abs=1e-4)
    assert series[0][2] != series[1][2]  # 701 tokens, past ReRoPE's window: the rule took effect
    page.fill("#attention-rerope-logn", "")
    choose(page, set(SCALINGS), {"standard"})


def test_sweep_crosses_rules_with_scalings_each_cell_as_score_gives_it(
    page: Page, server: LiveServer, api: httpx.Client, sdk: PEClient
) -> None:
    text = (STATIC_DIR / "sample.txt").read_text()[:SWEEP_TEXT_CHARS]
    with traffic(page) as seen:
        start_sweep(page, text, ", ".join(map(str, RULE_SWEEP_LENGTHS)), RULE_SWEEP_GRID, RULE_SWEEP_RULES)
        assert finish(page, "sweep-section") == "done", page.text_content("#sweep-message")
    leak = rule_defaults(NATIVE, MAX_CONTEXT, window=64)["leaky_rerope"]["leak"]
    scalings: list[dict[str, Any]] = [{"type": "none"}, {"type": "linear", "factor": 2}]
    rules: list[dict[str, Any]] = [
        {"type": "standard"},
        {"type": "streaming", "sink_tokens": 4, "window": 64},
        {"type": "leaky_rerope", "window": 64, "leak": leak, "logn": 128},
    ]
    configurations = [(scaling, rule) for scaling in scalings for rule in rules]
    # One /score per configuration at the longest length (the reference's 256 read from none + standard).
    longest = RULE_SWEEP_LENGTHS[-1]
    sent = seen.bodies(server.url("/score"))
    assert [(body["pe_scaling"], body["pe_attention"]) for body in sent] == configurations
    assert {len(body["tokens"]) for body in sent} == {longest}
    rendered = page.evaluate(
        """() => [...document.querySelectorAll("#sweep-table tbody tr")].map((row) => [
             JSON.parse(row.dataset.scaling), JSON.parse(row.dataset.attention),
             row.querySelector("th").textContent,
             [...row.querySelectorAll("td[data-length]")].map((td) => [
               Number(td.dataset.length), Number(td.dataset.bits)])])"""
    )
    assert [(scaling, attention) for scaling, attention, _, _ in rendered] == configurations
    rule_labels = [
        "standard",
        "streaming (sink_tokens=4,window=64)",
        f"leaky_rerope (window=64,leak={leak},logn=128)",
    ]
    assert [label for _, _, label, _ in rendered] == [
        f"{scaling} + {rule}" for scaling in ("none", "linear x2") for rule in rule_labels
    ]
    tokens = sdk.score(prompt=text, model="zoo-rope").tokens
    for scaling, attention, _, cells in rendered:
        assert [length for length, _ in cells] == RULE_SWEEP_LENGTHS
        for length, bits in cells:
            body = {
                "model": "zoo-rope",
                "tokens": tokens[:length],
                "pe_scaling": scaling,
                "pe_attention": attention,
            }
            direct = api.post("/score", json=body)
            assert direct.status_code == 200, direct.text
            scored = direct.json()
            assert scored["pe"]["attention"] == attention
            assert bits == pytest.approx(sweep_bits(scored["token_logprobs"], 1, length), abs=1e-3)
    curves = page.evaluate(
        """() => window.playground.chart("sweep-curves").data.datasets
             .filter((d) => d.scaling).map((d) => [d.label, d.attention])"""
    )
    assert curves == [[label, attention] for _, attention, label, _ in rendered]
    cells = page.evaluate("""() => window.playground.chart("sweep-heatmap").data.datasets[0].data.length""")
    assert cells == len(RULE_SWEEP_LENGTHS) * len(configurations)


@pytest.mark.parametrize(
    ("lengths", "grid", "rules", "message"),
    [
        ("128, 256", "none\nrope2:factor=2", "standard", 'unknown scaling type "rope2"'),
        ("128, 256", "yarn:factor=2|0", "standard", "factor must be ≥ 1, got 0"),
        ("128, 2048", "none", "standard", "Length 2048 is above the model's max_context (1024 tokens)"),
        ("128, x", "none", "standard", 'Length "x" must be a whole number of tokens ≥ 2'),
        ("128", "ntk", "standard", "ntk needs a factor"),
        ("128", "yarn:factor=2,beta=3", "standard", '"beta" is not a parameter of yarn'),
        ("128", "none", "standard\nlonglm", 'Attention line 2: unknown attention type "longlm"'),
        ("128", "none", "self_extend:G=4", '"G" is not a parameter of self_extend attention'),
        ("128", "none", "rerope:window=64|x", "window=x is not a number"),
    ],
)
def test_a_bad_sweep_grid_is_refused_before_any_request(
    page: Page, lengths: str, grid: str, rules: str, message: str
) -> None:
    with traffic(page) as seen:
        start_sweep(page, "some text to score", lengths, grid, rules)
        assert finish(page, "sweep-section") == "error"
    assert message in (page.text_content("#sweep-message") or "")
    assert seen.sent == []


def test_a_sweep_longer_than_its_text_is_refused_before_scoring(page: Page, server: LiveServer) -> None:
    with traffic(page) as seen:
        start_sweep(page, "a short text", "128", "none")
        assert finish(page, "sweep-section") == "error"
    assert seen.sent == [server.url("/tokenize")]
    message = page.text_content("#sweep-message") or ""
    assert "The text is 13 tokens long, shorter than the longest length asked (128)" in message


@pytest.mark.parametrize(
    ("grid", "rules", "message"),
    [
        (
            "none\nllama3:factor=2,low_freq_factor=4,high_freq_factor=1",
            "standard",
            "high_freq_factor must be greater than low_freq_factor",
        ),
        (
            "none",
            "standard\ndca:chunk_size=64,local_window=64",
            "none + dca (chunk_size=64,local_window=64): pe_attention.local_window: "
            "local_window must be below chunk_size (64), got 64 (pe_attention.local_window)",
        ),
    ],
)
def test_a_cell_the_server_refuses_ends_the_sweep_with_its_message(
    page: Page, server: LiveServer, problems: PageProblems, grid: str, rules: str, message: str
) -> None:
    """The grid's syntax is right but the server's range check is not met (llama3's high <= low, a
    DCA window not below its chunk): its 422 message, led by the configuration, is shown, and the
    cells still in flight are aborted."""
    text = (STATIC_DIR / "sample.txt").read_text()[:300]
    score = server.url("/score")
    with traffic(page) as seen:
        start_sweep(page, text, "128, 256", grid, rules)
        assert finish(page, "sweep-section") == "error"
        assert message in (page.text_content("#sweep-message") or "")
        seen.wait_until_settled(page, score)
    refused = problems.seen.count(f"HTTP 422: POST {score}")
    aborted = problems.seen.count(f"request failed: POST {score} (net::ERR_ABORTED)")
    logged = [seen for seen in problems.seen if seen.startswith("console: Failed to load resource")]
    assert refused >= 1 and refused + aborted + len(logged) == len(problems.seen)
    problems.seen.clear()


def test_cancel_aborts_the_sweep_s_requests(page: Page, server: LiveServer, problems: PageProblems) -> None:
    text = (STATIC_DIR / "sample.txt").read_text()[:1100]
    grid = "none\nlinear:factor=2|4|8\nntk:factor=2|4|8\nyarn:factor=2|4|8"
    cells = 4 * 10
    score = server.url("/score")
    with httpx.Client(base_url=server.base_url) as metrics, traffic(page) as seen:
        cancelled_before = metric_sum(metrics, "pe_serve_requests_total", CANCELLED_SCORES)
        with page.expect_response(score):
            start_sweep(page, text, "256, 512, 768, 1024", grid)
        page.click("#sweep-cancel")
        assert finish(page, "sweep-section") == "cancelled"
        assert page.text_content("#status") == "Cancelled."
        assert page.is_disabled("#sweep-cancel") and page.is_enabled("#sweep")
        # Every /score the page sent was either answered before the cancel or aborted by it.
        seen.wait_until_settled(page, score)
        aborted = problems.seen.count(f"request failed: POST {score} (net::ERR_ABORTED)")
        assert aborted > 0 and aborted == len(problems.seen)
        answered = seen.answered.count(score)
        assert answered < cells and answered + aborted == seen.sent.count(score)
        # The server dropped the work of those it had received.
        wait_for(
            lambda: metric_sum(metrics, "pe_serve_requests_total", CANCELLED_SCORES) > cancelled_before,
            "the server to count a cancelled /score",
        )
    problems.seen.clear()


def test_settings_and_key_survive_a_reload(page: Page) -> None:
    url = page.url
    assert "scaling.yarn=1" in url and "inspect.scaling=yarn" in url
    page.reload()
    page.wait_for_selector("#model option[value='zoo-rope']", state="attached")
    assert page.input_value("#inspect-scaling") == "yarn"
    assert page.is_checked("#use-yarn") and not page.is_checked("#use-ntk")
    assert page.is_checked("#use-attention-standard") and not page.is_checked("#use-attention-self_extend")
    assert page.input_value("#attention-self_extend-window") == "8"  # typed in the rule comparison
    assert page.input_value("#sweep-rules") == "standard"
    assert page.input_value("#sweep-lengths") == "256, 512, 768, 1024"  # the cancelled sweep's
    assert page.input_value("#sweep-grid").startswith("none\nlinear:factor=2|4|8\n")
    assert page.evaluate("() => sessionStorage.getItem('pe-serve-api-key')") == API_KEY
