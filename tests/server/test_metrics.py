"""``GET /metrics`` after a known workload: exact counters, one histogram sample per request, a real Prometheus
scraping the server, and the Grafana dashboard and docs naming only (and all) real series."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from metrics_utils import families, random_prompt, require_binary, scrape, value
from server_utils import ServerProcess, _free_port, engine_idle, wait_until

MODEL = "tiny-metrics"
ROOT = Path(__file__).resolve().parents[2]
REQUEST_HISTOGRAMS = ["e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                      "time_to_first_token_seconds"]


@pytest.fixture(scope="module")
def metrics_server(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama, "--served-model-name", MODEL)
    yield server
    server.stop()  # not left running (idle) for the rest of the session


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_exact_counters_and_one_histogram_sample_per_request(metrics_server: ServerProcess) -> None:
    before = scrape(metrics_server.base_url)
    shared, other = random_prompt(40, seed=11), random_prompt(24, seed=12)
    _complete(metrics_server, shared, 5, ignore_eos=True)                 # length, 5 tokens, no hit
    _complete(metrics_server, shared, 5, ignore_eos=True)                 # length, hits (40 - 1) // 16 blocks
    stop = _complete(metrics_server, other, 4, stop_token_ids=list(range(320)))  # any token stops it: 1 token
    assert stop["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: engine_idle(metrics_server.base_url), 10, "the engine to go idle")
    after = scrape(metrics_server.base_url)

    def delta(name: str, **labels: str) -> float:
        return value(after, "pagellm:" + name, **labels) - value(before, "pagellm:" + name, **labels)

    assert delta("prompt_tokens_total") == 40 + 40 + 24
    assert delta("generation_tokens_total") == 5 + 5 + 1
    assert delta("request_success_total", finished_reason="length") == 2
    assert delta("request_success_total", finished_reason="stop") == 1
    assert delta("prefix_cache_queries_total") == 104
    assert delta("prefix_cache_hits_total") == 32
    assert delta("num_preemptions_total") == 0
    assert delta("num_aborted_requests_total") == 0
    for name in REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count") == 3, name
    assert delta("request_prompt_tokens_sum") == 104
    assert delta("request_generation_tokens_sum") == 11
    assert delta("request_time_per_output_token_seconds_count") == 2  # a one-token output has no TPOT
    assert delta("inter_token_latency_seconds_count") == 4 + 4        # one gap per later token (one per step)
    assert delta("iteration_tokens_total_sum") == (40 + 4) + (8 + 4) + 24  # computed tokens (hits excluded)
    assert value(after, "pagellm:num_requests_running") == 0
    assert value(after, "pagellm:kv_cache_usage_perc") == 0
    assert value(after, "pagellm:time_to_first_token_seconds_bucket", le="+Inf") == \
        value(after, "pagellm:time_to_first_token_seconds_count")


def test_aborted_request_is_counted(metrics_server: ServerProcess) -> None:
    before = value(scrape(metrics_server.base_url), "pagellm:num_aborted_requests_total")
    body = {"model": MODEL, "prompt": random_prompt(8, seed=13), "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{metrics_server.base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: the server aborts the request
    wait_until(lambda: value(scrape(metrics_server.base_url), "pagellm:num_aborted_requests_total") == before + 1,
               30, "the abort to be counted")


def test_series_names_labels_and_info(metrics_server: ServerProcess) -> None:
    text = httpx.get(f"{metrics_server.base_url}/metrics").text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            assert line.startswith("pagellm:") and f'model_name="{MODEL}"' in line, line
    kinds = families(metrics_server.base_url)
    assert kinds["pagellm:num_requests_running"] == "gauge"
    assert kinds["pagellm:prompt_tokens"] == "counter"
    assert kinds["pagellm:time_to_first_token_seconds"] == "histogram"
    assert 'pagellm:cache_config_info{block_size="16"' in text and 'cache_dtype="auto"' in text
    assert re.search(r'pagellm:build_info\{.*version="\d+\.\d+\.\d+"', text)


@pytest.fixture
def prometheus_url(metrics_server: ServerProcess, tmp_path: Path) -> Iterator[str]:
    """A real Prometheus (Debian's package) on a free loopback port, scraping the server every second."""
    binary = require_binary("prometheus")
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: pagellm\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_server.port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, proc), 60, "Prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ready(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"prometheus exited with {proc.returncode}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_prometheus_scrapes_the_request_count(metrics_server: ServerProcess, prometheus_url: str) -> None:
    for seed in range(4):
        _complete(metrics_server, random_prompt(12, seed=100 + seed), 3, ignore_eos=True)
    expected = sum(value(scrape(metrics_server.base_url), "pagellm:request_success_total", finished_reason=r)
                   for r in ("stop", "length"))
    query = f'sum(pagellm:request_success_total{{model_name="{MODEL}"}})'

    def scraped() -> float | None:
        data = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": query}, timeout=5).json()
        result = data["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    wait_until(lambda: scraped() == expected, 60, f"Prometheus to report {expected} requests")
    assert expected >= 4


def test_grafana_dashboard_and_docs_use_real_series(metrics_server: ServerProcess) -> None:
    kinds = families(metrics_server.base_url)
    sample_names = {name for name, _ in scrape(metrics_server.base_url)}
    dashboard = json.loads((ROOT / "deploy/grafana/pagellm.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"pagellm:[a-z0-9_:]+", e)}
    assert used and used <= sample_names, used - sample_names
    docs = (ROOT / "docs/metrics.md").read_text()
    for family, kind in kinds.items():
        shown = family + "_total" if kind == "counter" else family
        assert f"`{shown}`" in docs, shown
