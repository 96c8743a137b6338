"""Sleep mode served (vLLM's ``--enable-sleep-mode`` routes): ``POST /sleep`` puts the engine to sleep (level 1 or 2),
``GET /is_sleeping`` says so, requests meanwhile are 503s that say how to wake it, ``POST /wake_up`` brings it back;
a server without sleep mode refuses by name. And weight updates from disk (SGLang's route)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import httpx
from server_utils import ServerProcess

BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_sleep_and_wake_up(start_server: Callable[..., ServerProcess], tiny_llama: Path,
                           server: ServerProcess) -> None:
    sleepy = start_server(tiny_llama, "--served-model-name", "tiny", "--enable-sleep-mode")
    url = sleepy.base_url
    before = httpx.post(f"{url}/v1/completions", json=BODY).json()["choices"][0]["text"]
    assert httpx.post(f"{url}/sleep", params={"level": 3}).status_code == 400  # levels 1 and 2 only
    assert httpx.post(f"{url}/sleep").json() == {"is_sleeping": True}
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    refused = httpx.post(f"{url}/v1/completions", json=BODY)
    assert refused.status_code == 503 and "POST /wake_up" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200  # asleep, not dead
    assert httpx.post(f"{url}/wake_up").json() == {"is_sleeping": False}
    assert httpx.post(f"{url}/v1/completions", json=BODY).json()["choices"][0]["text"] == before
    assert httpx.post(f"{url}/sleep", params={"level": 2}).json() == {"is_sleeping": True}  # the weights go too
    assert httpx.post(f"{url}/wake_up", params={"tags": "gpu"}).status_code == 400
    # vLLM's tags: the weights load again while the engine sleeps on, then the KV cache wakes it
    assert httpx.post(f"{url}/wake_up", params={"tags": "weights"}, timeout=60).json() == {"is_sleeping": True}
    assert httpx.post(f"{url}/v1/completions", json=BODY).status_code == 503
    assert httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
    assert httpx.post(f"{url}/v1/completions", json=BODY).json()["choices"][0]["text"] == before
    plain = httpx.post(f"{server.base_url}/sleep")
    assert plain.status_code == 400 and "--enable-sleep-mode" in plain.json()["error"]["message"]


def test_weights_update_from_disk(start_server: Callable[..., ServerProcess],
                                  tiny_model_factory: Callable[..., Path]) -> None:
    """SGLang's ``POST /update_weights_from_disk``: the server answers as one started on the new checkpoint; its
    own weights come back without a ``model_path``; a checkpoint of other shapes is a 400."""
    first, second = tiny_model_factory("llama", seed=0), tiny_model_factory("llama", seed=1)
    served = start_server(first, "--served-model-name", "tiny")
    other = start_server(second, "--served-model-name", "tiny")

    def text(url: str) -> str:
        return httpx.post(f"{url}/v1/completions", json=BODY).json()["choices"][0]["text"]

    own, expected = text(served.base_url), text(other.base_url)
    assert own != expected
    update = httpx.post(f"{served.base_url}/update_weights_from_disk", json={"model_path": str(second)}, timeout=60)
    assert update.status_code == 200 and update.json()["success"] is True
    assert text(served.base_url) == expected
    assert httpx.post(f"{served.base_url}/update_weights_from_disk", json={}, timeout=60).status_code == 200
    assert text(served.base_url) == own
    wider = tiny_model_factory("llama", hidden_size=96)
    refused = httpx.post(f"{served.base_url}/update_weights_from_disk", json={"model_path": str(wider)}, timeout=60)
    assert refused.status_code == 400 and "served model's shapes" in refused.json()["error"]["message"]
    assert httpx.post(f"{served.base_url}/update_weights_from_disk", json={"model_path": 5}).status_code == 400
