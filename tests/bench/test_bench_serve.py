"""``pagellm bench serve`` against a live tiny-model ``pagellm serve``: metrics, JSON schema, plots, CPU sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import ServerProcess
from transformers import AutoTokenizer

from pagellm.bench.cpu import TreeSampler, find_listening_pid
from pagellm.cli import main

RUN_KEYS = {"request_rate", "max_concurrency", "metrics", "cpu", "requests"}
METRIC_KEYS = {"completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
               "request_throughput", "output_throughput", "total_token_throughput"} | {
    f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p50", "p95", "p99")
    for name in ("ttft", "tpot", "itl", "e2el")}
REQUEST_KEYS = {"success", "error", "prompt_len", "output_len", "ttft", "latency", "itl", "streamed"}
CPU_KEYS = {"mean_cpu_percent", "peak_cpu_percent", "peak_rss_mb", "cpu_samples", "cpu_cores"}


def _bench(server: ServerProcess, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--no-progress", "--vocab-size", "256",
               "--api-key", server.api_key, "--result-json", str(out), *args])
    return rc, json.loads(out.read_text())


def test_random_sweep_reports_metrics_json_and_plots(bench_server: ServerProcess, tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
                        "--max-concurrency", "1", "2", "--goodput", "ttft:600000", "--plot", str(plots),
                        "--server-pid", str(bench_server.proc.pid))
    assert rc == 0
    assert result["label"] == "tiny" and result["config"]["model"] == "tiny"
    assert [(r["request_rate"], r["max_concurrency"]) for r in result["runs"]] == [("inf", 1), ("inf", 2)]
    for run in result["runs"]:
        assert set(run) == RUN_KEYS
        m = run["metrics"]
        assert METRIC_KEYS <= set(m)
        assert (m["completed"], m["failed"]) == (4, 0)
        assert (m["total_input_tokens"], m["total_output_tokens"]) == (32, 20)  # usage from the server
        assert m["goodput_requests"] == 4
        assert m["output_throughput"] == pytest.approx(20 / m["duration_s"])
        assert 0 < m["median_ttft_ms"] <= m["p99_ttft_ms"] <= m["p99_e2el_ms"]
        assert set(run["cpu"]) == CPU_KEYS
        for req in run["requests"]:
            assert set(req) == REQUEST_KEYS
            assert req["success"] and req["output_len"] == 5 and req["prompt_len"] == 8
            assert 0 < req["ttft"] <= req["latency"] and len(req["itl"]) <= 4
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["latency_cdf_c1.png", "latency_cdf_c2.png", "sweep.png"]
    assert all((plots / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)


@pytest.mark.parametrize("dataset", ["chat", "code"])
def test_text_datasets_are_served(bench_server: ServerProcess, tmp_path: Path, dataset: str) -> None:
    rc, result = _bench(bench_server, tmp_path, "--dataset", dataset, "--num-prompts", "2", "--output-len", "3",
                        "--seed", "9", "--num-warmups", "0")  # short transcripts: the tiny context is 2048
    assert rc == 0
    (run,) = result["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["total_output_tokens"]) == (2, 6)
    assert all(r["prompt_len"] > 20 for r in run["requests"])  # counted by the server, from real text


def test_sharegpt_file_asks_for_each_reply_length(bench_server: ServerProcess, tmp_path: Path) -> None:
    replies = ["Sure, here is a short answer.", "No.", "The capital of France is Paris, a city on the Seine."]
    conversations = [{"conversations": [{"from": "human", "value": f"Question number {i}, please answer it."},
                                        {"from": "gpt", "value": reply}]} for i, reply in enumerate(replies)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    count = AutoTokenizer.from_pretrained(bench_server.model)
    lengths = [len(count.encode(r, add_special_tokens=False)) for r in replies]
    kept = [n for n in lengths if n >= 4]  # vLLM's rule drops replies under 4 tokens
    assert len(kept) == 2
    rc, result = _bench(bench_server, tmp_path, "--dataset", "sharegpt", "--dataset-path", str(path),
                        "--tokenizer", str(bench_server.model), "--num-prompts", "4", "--num-warmups", "0")
    assert rc == 0
    (run,) = result["runs"]
    assert run["metrics"]["completed"] == 4
    assert sorted(r["output_len"] for r in run["requests"]) == sorted(kept * 2)  # each reply's length, EOS ignored


def test_custom_text_prompts_go_to_chat_on_request(bench_server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": "Tell me a story.", "max_tokens": 4}\n{"prompt": "Count to three.", "max_tokens": 2}\n')
    rc, result = _bench(bench_server, tmp_path, "--dataset", "custom", "--dataset-path", str(path),
                        "--endpoint", "chat", "--num-prompts", "2", "--num-warmups", "0")
    assert rc == 0
    (run,) = result["runs"]
    assert sorted(r["output_len"] for r in run["requests"]) == [2, 4]
    text = AutoTokenizer.from_pretrained(bench_server.model).encode("Tell me a story.", add_special_tokens=False)
    longest = max(r["prompt_len"] for r in run["requests"])
    assert longest > len(text) + 2  # counted by the server: the chat template wrapped each text


def test_a_server_behind_a_key_needs_it(bench_server: ServerProcess, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = main(["bench", "serve", "--base-url", bench_server.base_url, "--no-progress", "--vocab-size", "256",
               "--num-prompts", "1", "--output-len", "2"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "pass --api-key" in err


def test_failed_requests_are_counted_not_raised(bench_server: ServerProcess, tmp_path: Path) -> None:
    rc, result = _bench(bench_server, tmp_path, "--model", "no-such-model", "--num-warmups", "0",
                        "--num-prompts", "3", "--output-len", "2")
    assert rc == 1
    m = result["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    assert all("HTTP 404" in r["error"] for r in result["runs"][0]["requests"])


def test_a_refused_warm_up_stops_before_the_runs(bench_server: ServerProcess,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--base-url", bench_server.base_url, "--no-progress", "--vocab-size", "256",
               "--api-key", bench_server.api_key, "--num-prompts", "2", "--output-len", "2", "--model",
               "no-such-model"])
    assert rc == 2  # a usage error, named, not a traceback
    err = capsys.readouterr().err
    assert "the warm-up request failed, so no run started: " in err and "HTTP 404" in err and "no-such-model" in err
    rc = main(["bench", "serve", "--base-url", bench_server.base_url, "--no-progress", "--num-prompts", "2",
               "--api-key", bench_server.api_key, "--max-concurrency", "4", "-1"])
    assert rc == 2 and "--max-concurrency (0: no cap) and --num-warmups must be 0 or more" in capsys.readouterr().err


def test_cpu_sampler_finds_the_server_and_sums_its_tree(bench_server: ServerProcess) -> None:
    assert find_listening_pid(bench_server.port) == bench_server.proc.pid
    sampler = TreeSampler(bench_server.proc.pid)
    sampler.sample()
    children = bench_server.child_pids()
    assert children  # the engine core runs in a child process: the tree, not one process, is what counts
    assert sampler.stats.num_samples == 1 and sampler.stats.peak_rss_mb > 50


def test_a_ramp_records_each_requests_offered_rate_and_the_first_slo_miss(bench_server: ServerProcess,
                                                                         tmp_path: Path) -> None:
    plots = tmp_path / "plots"
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "5", "--input-len", "8", "--output-len", "3",
                        "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "20", "--ramp-up-end-rps", "100",
                        "--goodput", "ttft:0.001", "--plot", str(plots), "--metadata", "commit=abc", "run=ramp")
    assert rc == 0
    (run,) = result["runs"]
    assert run["request_rate"] == "ramp"
    assert run["ramp_up"] == {"strategy": "linear", "start_rps": 20.0, "end_rps": 100.0}
    assert [r["offered_rps"] for r in run["requests"]] == pytest.approx([20.0, 40.0, 60.0, 80.0, 100.0])
    assert all(set(r) == REQUEST_KEYS | {"offered_rps"} and r["success"] for r in run["requests"])
    assert run["metrics"]["first_slo_miss_rps"] == 20.0  # no first token comes within 1 µs
    assert result["metadata"] == {"commit": "abc", "run": "ramp"}
    assert sorted(p.name for p in plots.iterdir()) == ["latency_cdf.png", "ramp.png"]


def test_sampling_flags_and_extra_body_fields_reach_the_server(bench_server: ServerProcess, tmp_path: Path) -> None:
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "2", "--output-len", "5", "--num-warmups", "0",
                        "--top-k", "5", "--extra-body", '{"max_tokens": 2}', "--header", "X-Tenant=blue")
    assert rc == 0
    assert [r["output_len"] for r in result["runs"][0]["requests"]] == [2, 2]  # the body's max_tokens was served
    assert result["config"]["header"] == ["X-Tenant"]  # names only: a header may carry a secret
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "2", "--output-len", "2", "--num-warmups", "0",
                        "--top-p", "2")
    assert rc == 1  # the server refused the sampling field: counted as failures, with its message
    assert all("HTTP 400" in r["error"] and "top_p" in r["error"] for r in result["runs"][0]["requests"])


def test_no_server_at_the_address_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--no-progress", "--num-prompts", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nothing answers at http://127.0.0.1:9" in err and "--ready-check-timeout" in err


def test_profile_wraps_the_runs_in_a_server_side_torch_profile(bench_server: ServerProcess, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "3", "--output-len", "3", "--num-warmups", "0",
                        "--max-concurrency", "1", "2", "--profile")
    assert rc == 0
    trace, summary = map(Path, result["profile_files"])  # one profile across both runs
    assert trace.exists() and "pagellm::forward" in summary.read_text()
    assert f"the server wrote {summary}" in capsys.readouterr().out


def test_no_stream_times_whole_answers(bench_server: ServerProcess, tmp_path: Path) -> None:
    rc, result = _bench(bench_server, tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                        "--no-stream", "--goodput", "e2el:600000")
    assert rc == 0
    (run,) = result["runs"]
    m = run["metrics"]
    assert (m["completed"], m["total_output_tokens"], m["goodput_requests"]) == (3, 12, 3)
    assert all(r["ttft"] == r["latency"] and not r["streamed"] and r["itl"] == [] for r in run["requests"])
    assert m["median_ttft_ms"] == m["median_e2el_ms"] and m["median_tpot_ms"] == 0.0  # no TPOT without a stream


def test_a_timed_trace_is_replayed_when_its_timestamps_say(bench_server: ServerProcess, tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(f'{{"prompt": [{i + 1}, 2, 3], "timestamp": {100 + i}, "max_tokens": 2}}\n'
                            for i in range(3)))
    rc, result = _bench(bench_server, tmp_path, "--dataset", "custom", "--dataset-path", str(path),
                        "--num-prompts", "3", "--num-warmups", "0", "--trace-speed", "2")
    assert rc == 0
    (run,) = result["runs"]
    assert (run["request_rate"], run["trace_speed"], run["metrics"]["completed"]) == ("trace", 2.0, 3)
    assert run["metrics"]["duration_s"] >= 1.0  # the last request goes out 2 s into the trace, at twice its speed
