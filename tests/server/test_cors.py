"""Cross-origin calls, as vLLM's flags set them: by default a page from any origin may call the API (the preflight
answers, responses carry Access-Control-Allow-Origin); ``--allowed-origins`` narrows it, and a page from another
origin then cannot read the API in a real browser (headless Chromium driven by Playwright); ``--api-key`` is
enforced either way; a malformed list stops the start."""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from metrics_utils import CHROMIUM_ARGS, require_binary
from server_utils import ENGINE_FLAGS, ServerProcess

APP = "https://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": "tiny", "prompt": "a", "max_tokens": 2}
FETCH = """async ([url, key]) => {
  try {
    const reply = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json",
      "Authorization": "Bearer " + key}, body: JSON.stringify({model: "tiny", prompt: "a", max_tokens: 2})});
    return {status: reply.status, text: (await reply.json()).choices[0].text};
  } catch (error) {
    return {error: String(error)};
  }
}"""


@pytest.fixture(scope="module")
def narrow(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> ServerProcess:
    return start_server(tiny_llama, "--served-model-name", "tiny", "--api-key", "sk-cors",
                        "--allowed-origins", f'["{APP}"]')


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """A second origin serving an empty page, for the browser to call the API from."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "index.html").write_text("<!doctype html><title>elsewhere</title>")
        handler = functools.partial(SimpleHTTPRequestHandler, directory=folder)
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}"
        finally:
            httpd.shutdown()


def test_any_origin_may_call_by_default(server: ServerProcess) -> None:
    preflight = httpx.options(f"{server.base_url}/v1/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    reply = httpx.post(f"{server.base_url}/v1/completions", json=BODY, headers={"Origin": APP})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_narrow_it_and_the_key_still_counts(narrow: ServerProcess) -> None:
    allowed = httpx.options(f"{narrow.base_url}/v1/completions", headers=PREFLIGHT)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == APP
    other = httpx.options(f"{narrow.base_url}/v1/completions", headers={**PREFLIGHT, "Origin": "https://x.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    keyless = httpx.post(f"{narrow.base_url}/v1/completions", json=BODY, headers={"Origin": APP})
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == APP


def test_a_browser_page_elsewhere_reads_the_api_only_where_allowed(server: ServerProcess, narrow: ServerProcess,
                                                                   page_origin: str) -> None:
    from playwright.sync_api import sync_playwright

    chromium = require_binary("chromium")
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        browser = pw.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_ARGS,
                                                        headless=True)
        page = browser.new_page()
        page.goto(f"{page_origin}/index.html")
        opened = page.evaluate(FETCH, [f"{server.base_url}/v1/completions", "unused"])
        closed = page.evaluate(FETCH, [f"{narrow.base_url}/v1/completions", "sk-cors"])
        browser.close()
    assert opened["status"] == 200 and isinstance(opened["text"], str), opened
    assert "Failed to fetch" in closed.get("error", ""), closed  # the page's origin is not in the list


def test_a_malformed_origin_list_stops_the_start(tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--port", "1",
                             "--allowed-origins", "https://app.example", *ENGINE_FLAGS], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "argument --allowed-origins: 'https://app.example': give a JSON list of strings" in result.stderr
