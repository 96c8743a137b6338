"""The dashboard page in headless Chromium (Debian's ``chromium`` driven by Playwright; no browser download) while
a workload runs: every chart receives non-zero data; a screenshot is saved under ``tests/artifacts/``. The same
load makes the server log its periodic stats line."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Callable

import httpx
from metrics_utils import CHROMIUM_ARGS, random_prompt, require_binary
from server_utils import ServerProcess, wait_until

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# True once every chart holds a non-zero, non-null point (KV usage and hit rate included).
CHARTS_HAVE_DATA = """() => {
  const d = window.pagellmDashboard;
  if (!d || !d.charts) return false;
  const names = ["throughput", "requests", "kv", "hit", "ttft", "tpot"];
  return names.every((n) => d.charts[n] && d.charts[n].data.slice(1).some(
    (series) => series.some((v) => v != null && v > 0)));
}"""


def _workload(base_url: str, stop: threading.Event) -> None:
    """Streams of requests sharing a prefix (so the hit rate is non-zero), until told to stop."""
    shared = random_prompt(48, seed=31)
    seed = 0
    with httpx.Client(base_url=base_url, timeout=60) as http:
        while not stop.is_set():
            seed += 1
            body = {"model": "tiny-dash", "prompt": shared + random_prompt(8, seed=1000 + seed), "max_tokens": 24,
                    "ignore_eos": True, "n": 4}
            try:
                http.post("/v1/completions", json=body)
            except httpx.HTTPError:  # a slow box may time one out; the load must go on
                continue


def test_dashboard_charts_fill_while_serving(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> None:
    from playwright.sync_api import sync_playwright

    chromium = require_binary("chromium")
    server = start_server(tiny_llama, "--served-model-name", "tiny-dash")
    stop = threading.Event()
    load = threading.Thread(target=_workload, args=(server.base_url, stop), daemon=True)
    load.start()
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
            # A fresh profile directory (Playwright passes it as --user-data-dir).
            browser = pw.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_ARGS,
                                                            headless=True, viewport={"width": 1440, "height": 900})
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.base_url}/dashboard")
            page.wait_for_function(CHARTS_HAVE_DATA, timeout=120_000, polling=250)
            assert page.evaluate("window.pagellmDashboard.errors") == 0 and not errors, errors
            assert page.text_content("#model") == "tiny-dash"
            polls = page.evaluate("window.pagellmDashboard.polls")
            page.select_option("#window", "60")  # the screenshot shows the last minute
            page.wait_for_function(f"window.pagellmDashboard.polls > {polls + 1}", timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            browser.close()
        # Under sustained load the server also logs its periodic stats line (every 5 s).
        wait_until(lambda: "INFO pagellm.stats: Engine: prompt " in server.log(), 30, "the stats log line")
    finally:
        stop.set()
        load.join(60)
        server.stop()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
