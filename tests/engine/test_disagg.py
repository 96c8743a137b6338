"""Disaggregated prefill and decode in-process: a producer engine runs the prompts for one token and stores their
blocks; a fresh consumer engine loads them as prefix hits (its usage says so) and its greedy tokens equal
transformers'; a store that holds only some prompts' blocks serves those and computes the rest; what the connector
cannot hand over is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_parity import _prompts, assert_greedy_parity, run

from pagellm import LLM, SamplingParams


def _kv(role: str, path: Path) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_consumer_loads_what_the_producer_stored_and_decodes_alike(tiny_model_factory, arch: str,
                                                                       tmp_path: Path) -> None:
    model_dir = tiny_model_factory(arch)
    prompts = _prompts(seed=21)
    producer = LLM(str(model_dir), dtype="float32", kv_transfer_config=_kv("kv_producer", tmp_path))
    producer.generate(prompts[:6], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    stored = len(list(tmp_path.rglob("*.safetensors")))
    assert stored == sum(len(p) // 16 for p in prompts[:6])
    consumer = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=40,
                   kv_transfer_config=_kv("kv_consumer", tmp_path))
    outputs = consumer.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
    loaded = [o.num_cached_tokens for o in outputs]
    assert loaded == [(len(p) - 1) // 16 * 16 for p in prompts[:6]] + [0] * (len(prompts) - 6)
    assert_greedy_parity(model_dir, prompts, [o.outputs[0].token_ids for o in outputs])
    assert len(list(tmp_path.rglob("*.safetensors"))) == stored  # a consumer writes nothing
    kv = consumer.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_block_removed_after_the_lookup_is_computed_instead(tiny_llama: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from pagellm.disagg.connector import StoredBlocks

    prompts = _prompts(seed=23)[4:8]  # 48 to 121 tokens: several blocks each
    producer = LLM(str(tiny_llama), dtype="float32", kv_transfer_config=_kv("kv_producer", tmp_path))
    producer.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    consumer = LLM(str(tiny_llama), dtype="float32", kv_transfer_config=_kv("kv_consumer", tmp_path))
    count = StoredBlocks.count

    def count_then_remove(self: StoredBlocks, hashes: list) -> int:  # the race: found, then gone before the load
        found = count(self, hashes)
        if found > 1:
            (Path(self.folder) / (hashes[1].hex() + ".safetensors")).unlink()
        return found

    monkeypatch.setattr(StoredBlocks, "count", count_then_remove)
    outputs = consumer.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                use_tqdm=False)
    assert_greedy_parity(tiny_llama, prompts, [o.outputs[0].token_ids for o in outputs])
    assert "cannot be read" in caplog.text  # (a prompt looked up twice finds the hole the second time)
    kv = consumer.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_kv_both_stores_and_loads(tiny_llama: Path, tmp_path: Path) -> None:
    prompts = _prompts(seed=22)[:4]
    first = LLM(str(tiny_llama), dtype="float32", kv_transfer_config=_kv("kv_both", tmp_path))
    ours = run(first, prompts)
    second = LLM(str(tiny_llama), dtype="float32", kv_transfer_config=_kv("kv_both", tmp_path))
    assert run(second, prompts) == ours and sum(s.prefix_cache_hits for s in second.last_stats) > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(enable_prefix_caching=False), "kv_transfer_config needs enable_prefix_caching"),
    (dict(tensor_parallel_size=2), "kv_transfer_config runs with tensor_parallel_size and pipeline_parallel_size 1"),
    (dict(kv_transfer_config={"kv_connector": "Nope"}), "kv_connector 'Nope' is not available"),
    (dict(kv_transfer_config={"kv_connector": "SharedStorageConnector"}), "needs kv_connector_extra_config"),
    (dict(kv_transfer_config='{"kv_role": "kv_producer", "oops": 1}'), r"unknown keys \['oops'\]"),
    (dict(kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {
        "shared_storage_path": "/tmp/x", "max_storage_bytes": "lots"}}), "'lots' is not a size"),
])
def test_what_cannot_be_handed_over_is_refused(tiny_llama: Path, tmp_path: Path, kwargs: dict,
                                               message: str) -> None:
    kwargs = {"kv_transfer_config": _kv("kv_both", tmp_path), **kwargs}
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), dtype="float32", **kwargs)


def test_vllms_hashes_name_the_stored_blocks(tiny_llama: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``prefix_caching_hash_algo`` the producer names its blocks by vLLM's hashes, as the consumer's prefix
    cache computes them, so the consumer still loads them; xxHash without a shared seed is refused (every process
    would root its hashes apart)."""
    from pagellm.kv.hash_algos import VllmBlockHasher

    monkeypatch.setenv("PYTHONHASHSEED", "3")
    prompts = _prompts(seed=23)[:3]
    producer = LLM(str(tiny_llama), dtype="float32", prefix_caching_hash_algo="xxhash_cbor",
                   kv_transfer_config=_kv("kv_producer", tmp_path))
    producer.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    names = {p.stem for p in tmp_path.rglob("*.safetensors")}
    hasher = VllmBlockHasher("xxhash_cbor")
    assert names == {h.hex() for p in prompts for h in hasher.token_hashes(p, 16)}
    consumer = LLM(str(tiny_llama), dtype="float32", prefix_caching_hash_algo="xxhash_cbor",
                   kv_transfer_config=_kv("kv_consumer", tmp_path))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = consumer.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == \
        [o.outputs[0].token_ids for o in producer.generate(prompts, params, use_tqdm=False)]
    monkeypatch.delenv("PYTHONHASHSEED")
    with pytest.raises(ValueError, match="needs PYTHONHASHSEED set"):
        LLM(str(tiny_llama), dtype="float32", prefix_caching_hash_algo="xxhash",
            kv_transfer_config=_kv("kv_consumer", tmp_path))
