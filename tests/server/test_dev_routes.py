"""vLLM's ``POST /collective_rpc`` under ``PAGELLM_SERVER_DEV_MODE=1``: a worker method by name on every rank over
HTTP (an RL framework's weight sync), behind the API key; absent without dev mode."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import httpx
import torch
from server_utils import ServerProcess

from pagellm.server.openai.dev_routes import _as_json

TESTS = Path(__file__).resolve().parents[1]  # worker_extensions.py, imported by the engine core's worker
DOWN = "model.layers.0.mlp.down_proj.weight"


def test_collective_rpc_runs_worker_methods_over_http(start_server: Callable[..., ServerProcess],
                                                      tiny_llama: Path) -> None:
    server = start_server(tiny_llama, "--served-model-name", "tiny", "--api-key", "sk-dev",
                          "--worker-extension-cls", "worker_extensions:WeightTools",
                          env={"PAGELLM_SERVER_DEV_MODE": "1",
                               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    url, key = f"{server.base_url}/collective_rpc", {"Authorization": "Bearer sk-dev"}
    assert httpx.post(url, json={"method": "weight_shape", "args": [DOWN]}).status_code == 401
    reply = httpx.post(url, json={"method": "weight_shape", "args": [DOWN]}, headers=key, timeout=30)
    assert reply.status_code == 200 and reply.json() == {"results": [[64, 128]]}  # [hidden, intermediate]
    for body, status, fragment in [({"method": "nope"}, 400, "the worker has no method 'nope'"),
                                   ({"args": [DOWN]}, 400, "method"),
                                   ({"method": "weight_shape", "timeout": -1}, 400, "timeout"),
                                   ({"method": "fail"}, 500, "rank 0 refuses")]:
        refused = httpx.post(url, json=body, headers=key, timeout=30)
        assert refused.status_code == status and fragment in refused.json()["error"]["message"], refused.text
    # what the call does to the weights is what the server serves next: lm_head zeroed, every logit is 0 and
    # greedy decoding picks token 0
    zeroed = httpx.post(url, json={"method": "scale_weight", "args": ["lm_head.weight"], "kwargs": {"factor": 0.0},
                                   "timeout": 30}, headers=key, timeout=30)
    assert zeroed.json() == {"results": [0.0]}
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=key, timeout=30,
                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
    assert reply.json()["choices"][0]["token_ids"] == [0, 0, 0]


def test_collective_rpc_is_absent_without_dev_mode(server: ServerProcess) -> None:
    assert httpx.post(f"{server.base_url}/collective_rpc", json={"method": "weight_shape"}).status_code == 404


def test_results_json_cannot_carry_come_back_as_text() -> None:
    assert _as_json((1, [2.5, None], {"a": True})) == (1, [2.5, None], {"a": True})
    assert _as_json(float("nan")) == "nan" and _as_json(torch.float32) == "torch.float32"
