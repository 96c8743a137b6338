"""``pagellm serve --kv-cache-dtype fp8``: the OpenAI SDK gets the completions the offline engine makes over the same
float8 cache, ``/metrics`` names the cache's dtype, every block comes back, and a bad value stops the server's
start with the choices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import httpx
import openai
from server_utils import ServerProcess, engine_idle, wait_until

from pagellm import LLM, SamplingParams


def test_a_server_on_a_float8_cache_answers_as_the_offline_engine(start_server: Callable[..., ServerProcess],
                                                                   tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    prompts = ["hello there", "the quick brown fox jumps", "abc" * 20]
    served = [client.completions.create(model=str(server.model), prompt=p, max_tokens=12, temperature=0.0)
              .choices[0].text for p in prompts]
    offline = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    assert served == [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'cache_dtype="fp8"' in metrics
    wait_until(lambda: engine_idle(server.base_url), 30, "every request to finish and its blocks to come back")


def test_an_unknown_cache_dtype_stops_the_start_with_the_choices(tiny_llama: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", str(tiny_llama), "--kv-cache-dtype",
                             "int4"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "kv_cache_dtype='int4'; use auto, fp8, fp8_e4m3 or fp8_e5m2" in result.stderr
