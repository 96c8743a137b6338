"""Speculative decoding on parallel ranks: a draft model (its own, or the target's first layers), Medusa heads and
an EAGLE head each run whole on every tensor-parallel rank or pipeline stage (their weights are small; the target's
embedding and LM head they share do their ranks' collectives), so every rank drafts and verifies alike. Greedy tokens
equal one process's without speculation, and drafts are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_eagle import SHAPES, eagle_file  # noqa: F401  (a fixture: a head trained on the tiny target)
from test_spec_decode import ANY_BATCH, GREEDY, SMALL_KV, _drafted, _prompts, _run, medusa_file  # noqa: F401

from pagellm import LLM

PARALLEL = {"tensor": {"tensor_parallel_size": 2}, "pipeline": {"pipeline_parallel_size": 2}}


def _specs(tiny_llama: Path, eagle: Path, medusa: Path) -> dict[str, dict]:
    return {"draft model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_llama)},
            "medusa": {"method": "medusa", "model": str(medusa), "num_speculative_tokens": 3},
            "eagle": {"method": "eagle", "model": str(eagle), **SHAPES["chain"]},  # its draft vocabulary's rows
            "eagle tree, whole vocabulary": {"method": "eagle", "model": str(eagle), **SHAPES["dynamic"],
                                             "draft_vocab_size": 0}}  # the LM head's own logits, gathered


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_speculation_on_parallel_ranks_keeps_the_greedy_tokens(tiny_llama: Path, eagle_file: Path,  # noqa: F811
                                                               medusa_file: Path, parallel: str) -> None:  # noqa: F811
    prompts = _prompts(6, n=4)
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV)
    try:
        expected = _run(plain, prompts, GREEDY)
    finally:
        plain.shutdown()
    specs = _specs(tiny_llama, eagle_file, medusa_file)
    if parallel == "tensor":
        specs["self-drafting"] = {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1}
    for name, spec in specs.items():
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=SMALL_KV, speculative_config={**spec, **ANY_BATCH},
                  **PARALLEL[parallel])
        try:
            assert _run(llm, prompts, GREEDY) == expected, name
            drafted, accepted = _drafted(llm)
            assert drafted > 0 and accepted > 0, name
        finally:
            llm.shutdown()


def test_self_drafting_is_refused_on_pipeline_stages(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="draft_model with draft_layers .* does not run with pipeline_parallel_size=2"):
        LLM(str(tiny_llama), dtype="float32", pipeline_parallel_size=2,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 1})
