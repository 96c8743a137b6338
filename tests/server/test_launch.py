"""``pagellm serve`` as a process: the ready line, model names, a taken port, SIGTERM → clean exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import openai
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
