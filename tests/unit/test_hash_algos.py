"""vLLM's block hashes (``--prefix-caching-hash-algo``, ``kv/hash_algos.py``) equal the ones vLLM computes.

The expected values are vLLM 0.32's own: its ``get_request_block_hasher(16, get_hash_fn_by_name(algo))`` after
``init_none_hash``, run in the peers' vLLM environment (``make peers``) on the tokens 1000..1039 (two full blocks of
16), once plain and once with the LoRA adapter ``ad`` at ``/adapters/ad`` and the cache salt ``s1``; ``PYTHONHASHSEED``
unset for ``sha256`` and ``sha256_cbor`` (seed "vllm-none-hash"), 7 for the rest. pagellm's requests are built as its
input processor builds them (the caller's salt length-prefixed, then the adapter's part)."""

from __future__ import annotations

import pytest

from pagellm.kv.events import external_hash
from pagellm.kv.hash_algos import VllmBlockHasher, block_keys
from pagellm.lora import LoRARequest
from pagellm.request import Request, caller_salt, caller_salt_part
from pagellm.sampling_params import SamplingParams

TOKENS = list(range(1000, 1040))
# algo, PYTHONHASHSEED: root, plain request's two blocks, adapter + salt request's two blocks, plain first external
VLLM = {
    ("sha256", None): (
        "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        ["9d9c413731095d0ee811a14814414907cafccd751ce2052f659e8e1f547aeb68",
         "6eab5151ee783ec014728198ae09f5b0c20f18673ff098bcec4f29beb1e71e61"],
        ["db654f152a98a47273aa2952d82636fecf2e03ade70e531393e846b1a5418bdf",
         "4a206ff028d11bd8dc8cbd75c2a21f001ae914e3e4fafc70b1cc016147a9390f"],
        7322446309363477352),
    ("sha256_cbor", None): (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        ["15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc",
         "b057b31190789434ae1b5f233801e9a318f5a49e9baf90762102e4d3c29c9005"],
        ["d17e3b5c7435fb870f4a49f81708287e901399f106aa1fa7cfd212164e976149",
         "169cec023004eb5ef8fbf8cd02dd106741dc20a6d021465f73201b6cc544ce7f"],
        3753563854825738204),
    ("sha256_cbor", "7"): (
        "20377cec9f51f6bf5ba1fa64649f3b1614e4eee833fd0fc5893f24f6e0accbaf",
        ["8cc8206a123adab4da823647eabf531df7cd4341326452385b01c8d4cad827ac",
         "eeae1321cce7365f728820938d728620bcac2fbf2f6e18f586054a035c2186f0"],
        ["84e7e4259e4e5461c7b5be9c495809c6b210e9e212421938a03a5bec48d85082",
         "07d428c9796d712ab69a211da1a121287010a4f292cee7bc9d9ff3ccabdd9c65"],
        6557743348689938348),
    ("xxhash", "7"): (
        "dc45d051a0062f6dfadd06f4455350e5",
        ["21c92628525115f3fb1625add953b950", "23add7d6150f091ce103eff2fb491a6a"],
        ["6d0c1323351a8c808f2a7cc049807d1e", "e867fba4a7a52e17b492a67a94a80fd3"],
        18092689981613259088),
    ("xxhash_cbor", "7"): (
        "590402640c85269766fbb87c28a2165c",
        ["f8c60b683cdd136ac65f11b0196dbafa", "78466f929c4605d77faf6c03a483a313"],
        ["d1f5bc22b7d6c22b67c021376939927f", "586943ab4d231eb8cd4a80afeab353c4"],
        14294163190335781626),
}
ADAPTER = LoRARequest("ad", 3, "/adapters/ad")


def _request(lora: LoRARequest | None = None, salt: str | None = None, **params: object) -> Request:
    parts = ([caller_salt_part(salt)] if salt else []) + ([lora.cache_salt] if lora else [])
    return Request("r", list(TOKENS), SamplingParams(max_tokens=1, lora_request=lora, **params),  # type: ignore
                   cache_salt="/".join(parts) or None)


def _hashes(hasher: VllmBlockHasher, request: Request) -> list[str]:
    hasher.extend(request, 16)
    return [h.hex() for h in request.block_hashes]


@pytest.mark.parametrize(("algo", "seed"), list(VLLM))
def test_hashes_are_vllms(algo: str, seed: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    root, plain, adapted, first_external = VLLM[(algo, seed)]
    hasher = VllmBlockHasher(algo)
    assert hasher.root.hex() == root
    assert _hashes(hasher, _request()) == plain
    assert _hashes(hasher, _request(ADAPTER, "s1")) == adapted
    assert [h.hex() for h in hasher.token_hashes(TOKENS, 16)] == plain  # the KV connector's names
    assert external_hash(bytes.fromhex(plain[0])) == first_external


def test_xxhash_without_a_seed_is_rooted_apart_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert VllmBlockHasher("xxhash").root != VllmBlockHasher("xxhash").root  # as vLLM: unpredictable
    assert VllmBlockHasher("sha256").root == VllmBlockHasher("sha256").root


def test_extend_hashes_only_the_new_full_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    hasher = VllmBlockHasher("sha256_cbor")
    request = _request()
    request.all_token_ids[:] = TOKENS[:20]
    hasher.extend(request, 16)
    assert len(request.block_hashes) == 1
    request.all_token_ids.extend(TOKENS[20:])
    hasher.extend(request, 16)
    assert [h.hex() for h in request.block_hashes] == VLLM[("sha256_cbor", "7")][1]


def test_keys_salt_only_the_first_block_and_isolate_prompt_logprobs() -> None:
    adapted = _request(ADAPTER, "a/b:c")  # a salt with the separators in it
    assert caller_salt(adapted.cache_salt) == "a/b:c"
    assert block_keys(adapted, 0, 16) == (("lora", "ad", "/adapters/ad"), ("cache_salt", "a/b:c"))
    assert block_keys(adapted, 1, 16) == (("lora", "ad", "/adapters/ad"),)
    assert caller_salt(_request(ADAPTER).cache_salt) is None and block_keys(_request(), 0, 16) == ()
    scored = _request(prompt_logprobs=0)
    scored.cache_salt = "prompt-logprobs-1234"  # the input processor's unique part
    assert block_keys(scored, 0, 16) == (("pagellm", "prompt-logprobs-1234"),) and block_keys(scored, 1, 16) == ()


def test_an_unknown_algorithm_is_refused_by_name() -> None:
    from pagellm.config import CacheConfig

    with pytest.raises(ValueError, match="use one of sha256, sha256_cbor, xxhash, xxhash_cbor"):
        CacheConfig(prefix_caching_hash_algo="md5")
