"""The playground page in a real headless Chromium (Debian's, driven by Playwright) against a live
server on loopback, with an API key: the page's results must equal the SDK's for the same requests.

The whole page is one browser session: the key is entered once and survives reloads, and every
test ends by asserting that the page logged no console error and no request failed. Set
`PLAYGROUND_SCREENSHOTS=docs/img` to refresh the README's screenshots; otherwise they are written
to a temporary directory (taking them is still exercised).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from pe_client import PEClient
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Response, sync_playwright

from service.api.loading import bundled_zoo
from service.api.routes.playground import STATIC_DIR
from tests.live_server import LiveServer, OptionValue, live_server

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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian's chromium is absent (.ci/run installs it)"
    ),
    pytest.mark.skipif(ZOO_ROPE is None, reason="no bundled models/zoo-rope checkpoint"),
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
    assert ZOO_ROPE is not None
    options: dict[str, OptionValue] = {
        "device": "cpu",
        "dtype": "float32",
        "max_context": 1024,
        "api_key": API_KEY,
    }
    with live_server([ZOO_ROPE], options=options, env={"OMP_NUM_THREADS": "1"}) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(server: LiveServer) -> Iterator[PEClient]:
    with PEClient(server.base_url, api_key=API_KEY, timeout=120.0) as client:
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


def test_settings_and_key_survive_a_reload(page: Page) -> None:
    url = page.url
    assert "scaling.yarn=1" in url and "inspect.scaling=yarn" in url
    page.reload()
    page.wait_for_selector("#model option[value='zoo-rope']", state="attached")
    assert page.input_value("#inspect-scaling") == "yarn"
    assert page.is_checked("#use-yarn") and not page.is_checked("#use-ntk")
    assert page.evaluate("() => sessionStorage.getItem('pe-serve-api-key')") == API_KEY
