"""``pagellm bench throughput`` (pagellm and the transformers baseline) and ``pagellm bench latency`` on a tiny
model, under our flag names and vLLM's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.cli import main

TINY_ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16000000", "--max-model-len", "256"]


def test_throughput_runs_pagellm_and_transformers_on_the_same_requests(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *TINY_ENGINE, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "5", "--vocab-size", "256", "--backend", "pagellm",
               "transformers", "--hf-batch-size", "2", "--result-json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["pagellm", "transformers"]
    for r in results:
        assert (r["num_requests"], r["total_input_tokens"], r["total_output_tokens"]) == (4, 32, 20)
        assert r["output_throughput"] == 20 / r["elapsed_s"]
    assert results[0]["preemptions"] == 0 and results[1]["batch_size"] == 2


def test_latency_reports_each_batch_size(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"  # vLLM's spellings: --num-iters-warmup, --output-json
    rc = main(["bench", "latency", "--model", str(tiny_llama), *TINY_ENGINE, "--batch-size", "1", "2",
               "--input-len", "8", "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "0",
               "--vocab-size", "256", "--output-json", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in results] == [1, 2]
    for r in results:
        assert 0 < r["median_latency_ms"] <= r["p99_latency_ms"]
        assert r["mean_prefill_ms"] > 0 and "decode_ms_per_token" in r
        assert r["output_throughput"] == pytest.approx(r["batch_size"] * 4 / (r["mean_latency_ms"] / 1e3))


def test_bench_reports_bad_options_as_usage_errors(capsys) -> None:
    assert main(["bench", "serve", "--dataset", "random", "--num-prompts", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_throughput_on_a_sharegpt_file_counts_replies_with_the_models_tokenizer(tiny_llama: Path,
                                                                                 tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    replies = ["A reply of a few words here.", "Another, somewhat longer reply to the second question."]
    data = [{"conversations": [{"from": "human", "value": f"Please answer question {i} in a sentence."},
                               {"from": "gpt", "value": r}]} for i, r in enumerate(replies)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama), *TINY_ENGINE, "--dataset-name", "sharegpt",
               "--dataset-path", str(path), "--num-prompts", "2", "--output-json", str(out)])  # vLLM's spellings
    assert rc == 0
    (result,) = json.loads(out.read_text())["results"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert result["total_output_tokens"] == sum(len(tokenizer.encode(r, add_special_tokens=False)) for r in replies)


def test_throughput_refuses_a_file_mixing_prompts_and_messages(tmp_path: Path, capsys) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["bench", "throughput", "--dataset", "custom", "--dataset-path", str(path), "--num-prompts", "2"]) == 2
    assert "mix prompts and chat messages" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_profile_writes_a_trace_of_one_more_run(tiny_llama: Path, tmp_path: Path, command: str) -> None:
    out, traces = tmp_path / "result.json", tmp_path / "traces"
    sizes = ["--num-prompts", "2"] if command == "throughput" else ["--batch-size", "2", "--num-iters", "1",
                                                                    "--num-warmup", "0"]
    rc = main(["bench", command, "--model", str(tiny_llama), *TINY_ENGINE, *sizes, "--input-len", "8",
               "--output-len", "4", "--vocab-size", "256", "--profile", "--profiler-dir", str(traces),
               "--result-json", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())["results"]
    trace, summary = map(Path, result["profile_files"])
    assert trace.parent == traces and trace.exists()
    assert "pagellm::forward" in summary.read_text()


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_profile_without_a_folder_is_refused_before_any_run(command: str, capsys) -> None:
    assert main(["bench", command, "--profile"]) == 2
    assert "--profile needs --profiler-dir DIR" in capsys.readouterr().err


def test_a_models_shapes_are_timed_with_dummy_weights_and_its_own_vocabulary(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's ``--load-format dummy``: a folder with only the config and tokenizer; random prompts are drawn from
    the model's vocabulary (320 tokens here) when ``--vocab-size`` is not given."""
    for path in tiny_llama.iterdir():
        if path.suffix != ".safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", str(tmp_path), *TINY_ENGINE, "--load-format", "dummy",
                 "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--result-json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert (result["num_requests"], result["total_output_tokens"]) == (3, 12)
    assert main(["bench", "latency", "--model", str(tmp_path), *TINY_ENGINE, "--load-format", "dummy",
                 "--batch-size", "2", "--input-len", "8", "--output-len", "3", "--num-iters", "1",
                 "--num-warmup", "0"]) == 0
