"""The web page at `/` (issue #22) in headless Chromium, driven by Playwright, against spawned
servers with the default model: a chat reply streams in; Stop aborts and the server frees the
request; the sampler panel's fields and order reach the request the page sends; settings survive a
reload; a server with API keys needs the key. The chat and story tests write the screenshots of
docs/screenshots/. The browser is Debian's `chromium` (Playwright's own download needs a CDN);
without one the browser tests skip.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from starlette.testclient import TestClient

from paphos import cli
from tests.server.fakes import FakeEngine, make_app
from tests.server.spawn import NAME, spawn_server

CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
KEY = "web-ui-test-key"
# The stage names of docs/api.md §4.2 in the default order, as the page lists them.
DEFAULT_ORDER = ["dry", "penalties", "no_repeat_ngram", "temperature", "top_nsigma", "top_p_top_k", "top_a",
                 "min_p", "tfs", "eta_cutoff", "epsilon_cutoff", "typical_p", "quadratic", "xtc"]
GENERATION = 90_000  # ms a generation may take in the UI (2 cores, other work on them)


def test_page_served_and_can_be_disabled():
    with TestClient(make_app(FakeEngine())) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module">' in page.text and "script-src 'sha256-" in page.headers["content-security-policy"]
    with TestClient(make_app(FakeEngine(), disable_web_ui=True)) as client:
        assert client.get("/").status_code == 404
    flag = [cli.build_configs(cli.parse_args(["run", "m.gguf", *argv]))[1].disable_web_ui
            for argv in ([], ["--disable-web-ui"], ["--disable_web_ui"])]
    assert flag == [False, True, True]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if CHROMIUM is None:
        pytest.skip("no Chromium binary: install Debian's `chromium` (`make install` does, as root)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


@contextmanager
def open_page(browser: Browser, base: str, expect_model: bool = True) -> Iterator[Page]:
    """A fresh browser context (empty localStorage) on the page; no script error may happen in it."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    errors: list[str] = []
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base}/")
    if expect_model:
        expect(page.locator("#model")).to_contain_text(NAME)
    # Every group of the settings panel (and the system prompt) open, so that the test reaches each field.
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


@pytest.fixture
def page(browser: Browser, spawned_server: str) -> Iterator[Page]:
    with open_page(browser, spawned_server) as page:
        yield page


def set_fields(page: Page, **values: Any) -> None:
    for key, value in values.items():
        field = page.locator(f"#f-{key}")
        if isinstance(value, bool):
            field.set_checked(value)
        elif field.evaluate("e => e.tagName") == "SELECT":
            field.select_option(str(value))
        else:
            field.fill(str(value))


def request_body(page: Page, route: str, action: Callable[[], None]) -> tuple[dict[str, Any], dict[str, str]]:
    """The JSON body and headers of the POST to `route` that `action` makes the page send."""
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith(route)) as info:
        action()
    return info.value.post_data_json, info.value.headers


def send(page: Page, text: str) -> None:
    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")


def wait_done(page: Page) -> None:
    """Until the generation under way ends (the page is busy from before its request is sent)."""
    expect(page.locator("body")).not_to_have_class(re.compile(r"\bbusy\b"), timeout=GENERATION)


def running(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return float(re.search(r"^aphrodite:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_chat_streams(page: Page):
    set_fields(page, max_tokens=40, temperature=0, ban_eos_token=True)
    # Every change of the reply's text, recorded by the page itself as it happens.
    page.evaluate("""() => {
        window.lengths = [];
        new MutationObserver(() => {
            const reply = document.querySelector('#messages .msg.assistant .content');
            if (reply) window.lengths.push(reply.textContent.length);
        }).observe(document.querySelector('#messages'), {childList: true, subtree: true, characterData: true});
    }""")
    body, _ = request_body(page, "/v1/chat/completions", lambda: send(page, "Name three French cheeses."))
    assert body["stream"] is True and body["messages"] == [{"role": "user", "content": "Name three French cheeses."}]
    assert body["logprobs"] is True and body["top_logprobs"] == 5
    wait_done(page)
    lengths = [n for n in page.evaluate("window.lengths") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), lengths  # it grew, in steps
    reply = page.locator("#messages .msg.assistant")
    expect(reply.locator(".stats")).to_contain_text("40 generated tokens")
    expect(reply.locator(".stats")).to_contain_text("tokens/s")
    # The conversation survives a reload too (which also leaves the panels as a user first sees them).
    page.reload()
    expect(reply.locator(".stats")).to_contain_text("40 generated tokens")
    # The alternatives of a token, on hover.
    reply.locator(".tok").nth(6).hover()
    expect(page.locator("#tip")).to_be_visible()
    assert page.locator("#tip tr").count() >= 5
    expect(page.locator("#tip")).to_contain_text("%")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "web-chat.png")


def test_stop_frees_the_request(page: Page, spawned_server: str):
    set_fields(page, max_tokens=1000, ban_eos_token=True)
    send(page, "Tell me a very long story.")
    expect(page.locator("#messages .msg.assistant .content")).to_have_text(re.compile(r"\S"), timeout=GENERATION)
    deadline = time.monotonic() + 10
    while running(spawned_server) != 1:
        assert time.monotonic() < deadline, "the request does not show in /metrics"
        time.sleep(0.05)
    page.click("#stop")
    deadline = time.monotonic() + 5
    while running(spawned_server) != 0:
        assert time.monotonic() < deadline, "the server still runs the request 5 s after Stop"
        time.sleep(0.05)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#messages .msg.assistant .stats")).to_contain_text("stopped")
    expect(page.locator("#error")).to_be_hidden()


def test_samplers_reach_the_request(page: Page):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    set_fields(
        page, max_tokens=3, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, top_a=0.1, tfs=0.95, typical_p=0.9,
        nsigma=2, dynatemp_min=0.5, dynatemp_max=1.2, smoothing_factor=0.2, repetition_penalty=1.1,
        frequency_penalty=0.3, presence_penalty=0.2, dry_multiplier=0.8, dry_allowed_length=3, xtc_threshold=0.2,
        xtc_probability=0.5, mirostat_mode=2, mirostat_tau=4, seed=42, top_logprobs=3, stop="###",
        banned_strings="foo\nbar baz", structured="json_schema", **{"structured-text": schema},
    )
    page.fill("#system", "Answer in JSON.")
    body, _ = request_body(page, "/v1/chat/completions", lambda: send(page, "Give me a number."))
    expected = {
        "max_tokens": 3, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "top_a": 0.1, "tfs": 0.95,
        "typical_p": 0.9, "nsigma": 2, "dynatemp_min": 0.5, "dynatemp_max": 1.2, "smoothing_factor": 0.2,
        "repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.2, "dry_multiplier": 0.8,
        "dry_allowed_length": 3, "xtc_threshold": 0.2, "xtc_probability": 0.5, "mirostat_mode": 2,
        "mirostat_tau": 4, "seed": 42, "top_logprobs": 3, "logprobs": True, "stop": ["###"],
        "banned_strings": ["foo", "bar baz"],
        "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "messages": [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Give me a number."}],
    }
    assert {k: body.get(k) for k in expected} == expected
    # Fields left at the server's default are not sent; nor is the default order.
    assert not {"eta_cutoff", "dry_base", "skew", "sampler_priority", "ban_eos_token"} & set(body)
    wait_done(page)
    expect(page.locator("#error")).to_be_hidden()  # the server took every field
    expect(page.locator("#messages .msg.assistant .stats")).to_contain_text("generated tokens")

    # Story mode: a raw completion, here under a GBNF grammar.
    page.click("#tab-story")
    page.fill("#story", "Is the sky blue? Answer:")
    set_fields(page, mirostat_mode=0, structured="grammar", **{"structured-text": 'root ::= " yes" | " no"'})
    body, _ = request_body(page, "/v1/completions", lambda: page.click("#generate"))
    assert body["prompt"] == "Is the sky blue? Answer:" and body["guided_grammar"] == 'root ::= " yes" | " no"'
    assert body["logprobs"] == 3 and body["temperature"] == 0.7 and "mirostat_mode" not in body
    wait_done(page)
    expect(page.locator("#story")).to_have_value(re.compile(r"Answer: (yes|no)$"))
    expect(page.locator("#error")).to_be_hidden()


def test_sampler_order(page: Page):
    set_fields(page, max_tokens=2)
    # Drag XTC to the top of the list, by its handle.
    page.locator('#order li[data-stage="xtc"] .handle').drag_to(
        page.locator("#order li").first, target_position={"x": 20, "y": 3})
    # Then Min-p up twice with the keyboard: focus stays on its button after each move.
    page.get_by_role("button", name="Move Min-p up").focus()
    page.keyboard.press("Enter")
    page.keyboard.press("Enter")
    order = ["xtc", "dry", "penalties", "no_repeat_ngram", "temperature", "top_nsigma", "min_p", "top_p_top_k",
             "top_a", "tfs", "eta_cutoff", "epsilon_cutoff", "typical_p", "quadratic"]
    assert page.eval_on_selector_all("#order li", "items => items.map(li => li.dataset.stage)") == order
    expect(page.locator("#order-note")).to_contain_text("sampler_priority")
    body, _ = request_body(page, "/v1/chat/completions", lambda: send(page, "Hi"))
    assert body["sampler_priority"] == order
    wait_done(page)
    expect(page.locator("#error")).to_be_hidden()
    page.click("#order-reset")
    assert page.eval_on_selector_all("#order li", "items => items.map(li => li.dataset.stage)") == DEFAULT_ORDER


def test_settings_survive_a_reload(page: Page):
    set_fields(page, temperature=0.3, top_k=20, banned_strings="xyz", ban_eos_token=True)
    page.fill("#system", "You are terse.")
    page.get_by_role("button", name="Move XTC up").click()
    page.click("#theme-toggle")
    page.click("#tab-story")
    page.fill("#preset-name", "mine")
    page.click("#preset-save")
    page.reload()
    expect(page.locator("#model")).to_contain_text(NAME)
    expect(page.locator("#f-temperature")).to_have_value("0.3")
    expect(page.locator("#f-top_k")).to_have_value("20")
    expect(page.locator("#f-banned_strings")).to_have_value("xyz")
    expect(page.locator("#f-ban_eos_token")).to_be_checked()
    expect(page.locator("#system")).to_have_value("You are terse.")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    expect(page.locator("#tab-story")).to_have_attribute("aria-selected", "true")
    stages = page.eval_on_selector_all("#order li", "items => items.map(li => li.dataset.stage)")
    assert stages[-2:] == ["xtc", "quadratic"]
    # The preset brings the saved values back; Reset brings the defaults.
    page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
    set_fields(page, temperature=0.9)
    page.select_option("#preset-list", "mine")
    page.click("#preset-load")
    expect(page.locator("#f-temperature")).to_have_value("0.3")
    page.click("#reset")
    expect(page.locator("#f-temperature")).to_have_value("1")
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")  # the theme is not part of a preset


def test_story_mode(page: Page):
    page.click("#theme-toggle")
    page.click("#tab-story")
    set_fields(page, max_tokens=40, temperature=0)
    page.fill("#story", "Once upon a time, in a small village by the sea, there lived")
    page.click("#generate")
    expect(page.locator("#story-stop")).to_be_visible()
    wait_done(page)
    expect(page.locator("#story-stats")).to_contain_text("40 generated tokens")
    story = page.locator("#story").input_value()
    assert story.startswith("Once upon a time") and len(story) > 80
    page.locator("#story-tokens .tok").nth(4).hover()
    expect(page.locator("#tip")).to_be_visible()
    page.screenshot(path=SCREENSHOTS / "web-story.png")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with spawn_server(tmp_path_factory.mktemp("keyed"), "--api-keys", KEY) as base:
        yield base


def test_api_key_required(browser: Browser, keyed_server: str):
    assert httpx.get(f"{keyed_server}/").status_code == 200  # the page itself is public
    with open_page(browser, keyed_server, expect_model=False) as page:
        expect(page.locator("#error")).to_contain_text("401")
        expect(page.locator("#model")).to_have_text("not connected")
        set_fields(page, max_tokens=4)
        send(page, "Hello")
        expect(page.locator("#error")).to_contain_text("401 Unauthorized")
        expect(page.locator("#messages .msg.assistant")).to_have_count(0)
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")
        expect(page.locator("#model")).to_contain_text(NAME)
        expect(page.locator("#error")).to_be_hidden()
        # An empty Send answers the pending user message.
        _, headers = request_body(page, "/v1/chat/completions", lambda: page.click("#send"))
        assert headers["authorization"] == f"Bearer {KEY}"
        wait_done(page)
        expect(page.locator("#error")).to_be_hidden()
        expect(page.locator("#messages .msg.assistant .content")).to_have_text(re.compile(r"\S"))
