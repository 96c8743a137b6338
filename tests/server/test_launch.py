"""``pagellm serve`` as a process: the ready line, model names, a taken port, SIGTERM → clean exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from server_utils import ENGINE_FLAGS, ServerProcess, wait_until


def test_ready_line_names_and_clean_sigterm(start_server: Callable[..., ServerProcess], tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "first", "--served-model-name", "second")
    assert f"at http://127.0.0.1:{server.port}/v1" in server.log()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["first", "second"]
    out = client.completions.create(model="second", prompt="a", max_tokens=2)
    assert out.model == "second"  # the name the client asked for
    children = server.child_pids()
    assert children
    assert server.stop() == 0
    assert "shutting down the engine" in server.log()
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 10,
               "the engine core process to exit")


def test_taken_port_fails_fast(server: ServerProcess, tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--port",
                             str(server.port), *ENGINE_FLAGS], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "pick another --port" in result.stderr


def test_frontend_imports_no_torch() -> None:
    # `pagellm serve` starts the engine core (which imports torch) before loading its tokenizer; the frontend's
    # own imports up to that point stay torch-free, so the core starts about a second sooner.
    code = ("import sys; import pagellm.cli; pagellm.cli.build_parser(); import pagellm.server.launch; "
            "from pagellm.engine.async_engine import AsyncLLM; import pagellm; pagellm.SamplingParams; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_vllm_command_line_with_a_config_file(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                                                tmp_path: Path) -> None:
    """vLLM's --config (YAML; the command line wins), --root-path behind a prefix-routing proxy, the GPU flags a
    ported command line carries, accepted and named in the log, and the access log without the probes' paths."""
    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: [from-file, also-from-file]\nroot_path: /llm\nmax-model-len: 256\n"
                      "enable-prefix-caching: false\nspeculative-config: {method: ngram, num_speculative_tokens: 2}\n")
    server = start_server(tiny_llama, "--config", str(config), "--max-model-len", "384",
                          "--gpu-memory-utilization", "0.9", "--trust-remote-code", "--max-loras", "4",
                          "--disable-uvicorn-access-log", "--structured-outputs-config", '{"backend": "xgrammar"}',
                          "--async-scheduling", "--hf-token", "--log-error-stack",
                          # vLLM 0.32's GPU knobs
                          "--max-cudagraph-capture-size", "512", "--cudagraph-capture-sizes", "1", "8",
                          "--performance-mode", "throughput", "--disable-hybrid-kv-cache-manager",
                          "--no-enable-cumem-allocator",
                          "--access-log", "--disable-access-log-for-endpoints", "/health,/metrics",
                          "--h11-max-header-count", "128")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["from-file", "also-from-file"]
    assert client.models.list().data[0].max_model_len == 384  # the command line's, over the file's 256
    # The proxy strips /llm; the URLs the app writes carry it back (here a trailing-slash redirect's).
    redirect = httpx.get(f"{server.base_url}/v1/models/", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"].endswith("/llm/v1/models")
    log = server.log()
    assert "--gpu-memory-utilization has no effect in pagellm" in log and "--trust-remote-code has no effect" in log
    assert "--max-loras has no effect in pagellm: every step mixes any number of adapters" in log
    assert "--disable-uvicorn-access-log has no effect in pagellm: the access log is off unless" in log
    assert "--async-scheduling has no effect in pagellm: the engine core's scheduler step" in log
    assert "--hf-token has no effect in pagellm" in log and "--log-error-stack has no effect" in log
    assert "--max-cudagraph-capture-size has no effect in pagellm: pagellm captures no graphs" in log
    assert "--cudagraph-capture-sizes has no effect" in log and "--performance-mode has no effect" in log
    assert "--disable-hybrid-kv-cache-manager has no effect in pagellm: pagellm keeps one KV cache group" in log
    assert "--h11-max-header-count has no effect in pagellm: pagellm's HTTP server parses requests with httptools" \
        in log
    stats = httpx.get(f"{server.base_url}/metrics?probe=1").text
    assert 'enable_prefix_caching="false"' in stats
    log = server.log()  # the access log (under the root path) keeps the API's requests, not the probes and scrapes
    assert '"GET /llm/v1/models HTTP/1.1" 200' in log and "/health HTTP" not in log and "/metrics?probe=1" not in log
    assert server.stop() == 0


def test_a_bad_config_file_is_refused_by_name(tmp_path: Path, tiny_llama: Path) -> None:
    for text, message in (("max-model-len: 4096\nno-such-flag: 1\n", "'no-such-flag' is not a flag of this command"),
                          ("- a list\n", "give a mapping of flag names to values")):
        (tmp_path / "bad.yaml").write_text(text)
        result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--config",
                                 str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_config_file_values_parse_as_their_flags(tmp_path: Path) -> None:
    from pagellm import cli
    from pagellm.server import vllm_cli

    (tmp_path / "c.yaml").write_text("allowed-origins: [https://a.example]\nspeculative_config: {method: ngram}\n"
                                     "lora-modules: [a=/adapters/a]\nport: 1234\nmax-num-seqs: 8\n")
    parser = cli.build_parser()
    argv = ["serve", "--config", str(tmp_path / "c.yaml"), "--port", "9"]
    args = vllm_cli.reparse(parser, parser.parse_args(argv), argv)
    assert args.allowed_origins == ["https://a.example"] and json.loads(args.speculative_config) == {"method": "ngram"}
    assert args.lora_modules == [("a", "/adapters/a")] and args.max_num_seqs == 8
    assert args.port == 9  # the command line's


def test_the_structured_output_backend_flags_take_xgrammar_and_refuse_others() -> None:
    """vLLM's --structured-outputs-config (JSON or dotted) and --guided-decoding-backend: auto and xgrammar, which
    pagellm's grammars run on, are taken; another backend, or a setting of vLLM's that pagellm lacks, is refused.
    So is a --tokenizer-mode but auto or hf, and an --api-server-count but 1."""
    from pagellm import cli
    from pagellm.server import vllm_cli

    parser = cli.build_parser()
    for flags in (["--structured-outputs-config", '{"backend": "xgrammar"}'], ["--guided-decoding-backend", "auto"],
                  ["--structured-outputs-config.backend", "xgrammar"], ["--tokenizer-mode", "auto"],
                  ["--api-server-count", "1"], ["-asc", "1"]):
        vllm_cli.reparse(parser, parser.parse_args(["serve", *flags]), ["serve", *flags])
    for flags, message in ((["--guided-decoding-backend", "outlines"], "backend 'outlines' is not pagellm's"),
                           (["--structured-outputs-config.backend", "guidance"], "backend 'guidance' is not"),
                           (["--structured-outputs-config", '{"backend": "lm-format-enforcer"}'], "is not pagellm's"),
                           (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "the backend only"),
                           (["--tokenizer-mode", "mistral"], "--tokenizer-mode 'mistral': pagellm runs Hugging Face"),
                           (["-asc", "4"], "--api-server-count 4: pagellm runs one API server process")):
        with pytest.raises(ValueError, match=message):
            vllm_cli.reparse(parser, parser.parse_args(["serve", *flags]), ["serve", *flags])


def test_log_level_reaches_the_server_and_its_engine_core(start_server: Callable[..., ServerProcess],
                                                          tiny_llama: Path) -> None:
    """vLLM's ``--log-level``: at WARNING neither the server nor its engine core logs an INFO line (the default
    server's log has both: its engine core's "loaded ..." line and the server's own)."""
    quiet = start_server(tiny_llama, "--log-level", "warning")
    client = openai.OpenAI(base_url=f"{quiet.base_url}/v1", api_key="x", max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="a", max_tokens=2).choices
    assert quiet.stop() == 0
    assert "INFO" not in quiet.log()
    loud = start_server(tiny_llama)
    assert "INFO EngineCore" in loud.log() and "INFO pagellm" in loud.log()
