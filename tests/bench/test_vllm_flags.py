"""A ``vllm bench serve`` command line runs as ``pagellm bench serve``: vLLM's spellings parse to the same settings
as ours, run against a live server and write the result where vLLM would; where a command gives both spellings with
different meanings, the error names the two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import ServerProcess

from pagellm.bench import vllm_flags
from pagellm.cli import build_parser, main

SETTINGS = ("base_url", "dataset", "input_len", "output_len", "range_ratio", "num_prefixes", "prefix_len",
            "no_progress", "ready_check_timeout", "endpoint", "model", "percentiles", "result_json")


def _resolved(*argv: str) -> dict:
    args = build_parser().parse_args(["bench", "serve", *argv])
    vllm_flags.resolve(args)
    return {name: getattr(args, name) for name in SETTINGS}


def test_vllm_spellings_mean_our_flags(tmp_path: Path) -> None:
    vllm = _resolved("--host", "10.0.0.2", "--port", "8011", "--dataset-name", "random", "--random-input-len", "64",
                     "--random-output-len", "16", "--random-range-ratio", "0.25", "--disable-tqdm",
                     "--ready-check-timeout-sec", "30", "--backend", "openai-chat", "--served-model-name", "m",
                     "--metric-percentiles", "50,90,99.9", "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "r.json")
    ours = _resolved("--base-url", "http://10.0.0.2:8011", "--dataset", "random", "--input-len", "64",
                     "--output-len", "16", "--range-ratio", "0.25", "--no-progress", "--ready-check-timeout", "30",
                     "--endpoint", "chat", "--model", "m", "--percentiles", "50", "90", "99.9", "--result-json",
                     str(tmp_path / "r.json"))
    assert vllm == ours
    prefix = _resolved("--dataset-name", "prefix_repetition", "--prefix-repetition-num-prefixes", "3",
                       "--prefix-repetition-prefix-len", "100", "--prefix-repetition-suffix-len", "20",
                       "--prefix-repetition-output-len", "8")
    assert prefix == _resolved("--dataset", "prefix", "--num-prefixes", "3", "--prefix-len", "100",
                               "--input-len", "20", "--output-len", "8")
    assert _resolved("--port", "9000")["base_url"] == "http://127.0.0.1:9000"
    assert _resolved("--backend", "vllm")["endpoint"] == "completions"
    assert _resolved("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")["endpoint"] == "chat"
    assert _resolved("--endpoint", "/v1/completions")["endpoint"] == "completions"
    saved = _resolved("--save-result")["result_json"]
    assert saved.startswith("./pagellm-bench-") and saved.endswith(".json")


@pytest.mark.parametrize(("argv", "message"), [
    (["--base-url", "http://h:1", "--port", "2"], "give the server as --base-url or as --host/--port, not both"),
    (["--backend", "openai", "--endpoint", "chat"], "--backend openai sends to completions, --endpoint says chat"),
    (["--served-model-name", "a", "--model", "b"], "--served-model-name and --model name different models"),
    (["--save-result", "--result-json", "x.json"], "give --result-json or --save-result, not both"),
    (["--result-dir", "out"], "--result-dir and --result-filename go with --save-result"),
])
def test_both_spellings_that_disagree_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _resolved(*argv)


def test_bad_percentile_list_says_how_to_write_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "serve", "--metric-percentiles", "50;95"])
    assert exc.value.code == 2
    assert "'50;95': give percentiles separated by commas, e.g. 50,95,99" in capsys.readouterr().err


def test_a_vllm_command_line_runs_and_saves_its_result(bench_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "results"
    rc = main(["bench", "serve", "--host", "127.0.0.1", "--port", str(bench_server.port), "--backend", "vllm",
               "--served-model-name", "tiny", "--dataset-name", "random", "--random-input-len", "8",
               "--random-output-len", "4", "--num-prompts", "3", "--max-concurrency", "2", "--disable-tqdm",
               "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(out), "--result-filename",
               "run.json", "--vocab-size", "256", "--header", f"Authorization=Bearer {bench_server.api_key}"])
    assert rc == 0
    result = json.loads((out / "run.json").read_text())
    assert result["config"]["endpoint"] == "completions" and result["config"]["model"] == "tiny"
    (run,) = result["runs"]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["total_output_tokens"]) == (3, 0, 12)
    assert {"p50_ttft_ms", "p90_ttft_ms"} <= set(metrics) and "p95_ttft_ms" not in metrics
