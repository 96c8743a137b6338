"""``pagellm serve --quantization w8a8_int8``: the OpenAI SDK gets the completions the offline engine makes with the
same int8 weights, and every block comes back."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import openai
import pytest
from server_utils import ServerProcess, engine_idle, wait_until

from pagellm import LLM, SamplingParams
from pagellm.ops import gemm_w8a8


@pytest.mark.skipif(not gemm_w8a8.available(), reason="the int8 GEMM needs AVX-512 VNNI and a compiler")
def test_a_server_on_int8_weights_answers_as_the_offline_engine(start_server: Callable[..., ServerProcess],
                                                                tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--dtype", "bfloat16", "--quantization", "w8a8_int8")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    prompts = ["hello there", "the quick brown fox jumps", "abc" * 20]
    served = [client.completions.create(model=str(server.model), prompt=p, max_tokens=12, temperature=0.0)
              .choices[0].text for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    offline = LLM(str(tiny_llama), dtype="bfloat16", quantization="w8a8_int8").generate(prompts, params,
                                                                                      use_tqdm=False)
    assert served == [o.outputs[0].text for o in offline]
    plain = LLM(str(tiny_llama), dtype="bfloat16").generate(prompts, params, use_tqdm=False)
    assert served != [o.outputs[0].text for o in plain]  # the int8 weights were in use
    wait_until(lambda: engine_idle(server.base_url), 30, "every request to finish and its blocks to come back")
