"""The live chain page (GET /) of a real 3-stage `skippy serve` behind --auth-token, in a real
browser: Playwright driving Debian's Chromium (README's test command installs it). The page must
load with no console errors, show every stage with its layer range, and its numbers must move
while a stream runs."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import httpx
import pytest

from frontend_support import ServeProcess, wait_until

TOKEN = "page-s3cret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
NO_EOS = {"0": -100, "2": -100}  # SmolLM2's end tokens banned: the stream runs to max_tokens
CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServeProcess(["--stages", "3", "--auth-token", TOKEN, "--ctx-size", "1024"],
                          tmp_path_factory.mktemp("serve") / "serve.log")
    try:
        yield server
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log_text()[-3000:]


def stream_in_background(url: str, max_tokens: int) -> threading.Thread:
    model = httpx.get(url + "/v1/models", headers=BEARER).json()["data"][0]["id"]
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}

    def run() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=BEARER, timeout=300) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_page_and_its_data_are_behind_the_token(served):
    page = httpx.get(served.url + "/")
    assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
    assert page.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/chain").status_code == 401
    assert httpx.get(served.url + "/", auth=("anyone", TOKEN)).headers["content-type"].startswith("text/html")
    data = httpx.get(served.url + "/v1/chain", headers=BEARER).json()
    bounds = [(stage["layer_start"], stage["layer_end"]) for stage in data["stages"]]
    assert len(bounds) == 3 and bounds[0][0] == 0 and bounds[-1][1] == 30
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))  # contiguous
    assert data["model"] and data["active"] == 0 and data["queued"] == 0


def test_chain_data_moves_while_a_stream_runs(served):
    before = httpx.get(served.url + "/v1/chain", headers=BEARER).json()
    thread = stream_in_background(served.url, 160)
    busy = wait_until(lambda: (d := httpx.get(served.url + "/v1/chain", headers=BEARER).json())["tokens_per_s"] > 0
                      and d["active"] == 1 and d, timeout_s=120)
    assert busy, "tokens/s never rose while a stream ran"
    assert all(stage["active_sessions"] == 1 for stage in busy["stages"])
    thread.join(timeout=300)
    after = httpx.get(served.url + "/v1/chain", headers=BEARER).json()
    assert len(after["recent"]) == len(before["recent"]) + 1
    latest = after["recent"][0]
    assert latest["outcome"] == "length" and latest["completion_tokens"] == 160
    assert latest["ttft_ms"] > 0 and latest["decode_tok_s"] > 0
    assert set(latest) == {"finished_at", "outcome", "prompt_tokens", "cached_tokens", "completion_tokens",
                           "ttft_ms", "decode_tok_s"}  # numbers and labels only: never text


def test_page_in_chromium(served, tmp_path):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: README's test command installs Debian's chromium"
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            context = browser.new_context(http_credentials={"username": "operator", "password": TOKEN},
                                          viewport={"width": 1100, "height": 700})
            page = context.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.goto(served.url + "/")
            page.wait_for_function("document.querySelectorAll('.stage').length === 3", timeout=30_000)
            boxes = page.locator(".stage")
            ranges = [boxes.nth(i).inner_text() for i in range(3)]
            assert "layers\n0-" in ranges[0].replace("\t", "\n") and "-29" in ranges[2]
            assert all("ready" in text for text in ranges)
            idle_rate = page.locator("#rate").inner_text()
            thread = stream_in_background(served.url, 200)
            page.wait_for_function("Number(document.getElementById('rate').textContent) > 0", timeout=120_000)
            page.wait_for_function("document.getElementById('active').textContent === '1'", timeout=30_000)
            moving = page.locator("#rate").inner_text()
            # the stages' own figures move too (stage 0 answers them, asking each stage's totals)
            page.wait_for_function("[...document.querySelectorAll('.stage')].every(box => "
                                   "/tokens\\/s\\s+[1-9]/.test(box.innerText))", timeout=30_000)
            page.screenshot(path=str(tmp_path / "chain-page.png"), full_page=True)
            if os.environ.get("SKIPPY_PAGE_SCREENSHOT"):
                page.screenshot(path=os.environ["SKIPPY_PAGE_SCREENSHOT"], full_page=True)
            thread.join(timeout=300)
            page.wait_for_function("document.querySelectorAll('#recent tr').length >= 1", timeout=30_000)
            assert "length" in page.locator("#recent tr").first.inner_text()
        finally:
            browser.close()
    assert idle_rate != moving
    assert not problems, problems
