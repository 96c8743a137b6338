"""Weight updates from disk (SGLang's ``update_weights_from_disk``; an RL loop's new policy): the engine serves
another checkpoint of the same shapes from then on, token for token as an engine started on it, on every
tensor-parallel rank; its own weights read again bring its old answers back; a checkpoint of other shapes, or a
busy engine, is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[72, 101, 108, 108, 111], list(range(30, 60))]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("tp", [1, 2])
def test_another_checkpoint_is_served_as_if_started_on_it(tiny_model_factory: Callable[..., Path], tp: int) -> None:
    first, second = tiny_model_factory("llama", seed=0), tiny_model_factory("llama", seed=1)
    expected = _tokens(LLM(str(second), dtype="float32", max_model_len=128))
    llm = LLM(str(first), dtype="float32", max_model_len=128, tensor_parallel_size=tp)
    try:
        own = _tokens(llm)
        assert own != expected
        llm.update_weights_from_disk(str(second))
        assert llm.engine.core.scheduler.kv.pool.cached == {}  # the old weights' blocks are forgotten
        assert _tokens(llm) == expected
        llm.update_weights_from_disk()  # its own weights again
        assert _tokens(llm) == own
    finally:
        llm.shutdown()


def test_other_shapes_and_a_busy_engine_are_refused(tiny_model_factory: Callable[..., Path]) -> None:
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=128)
    wider: Any = tiny_model_factory("llama", hidden_size=96)
    with pytest.raises(ValueError, match="not a checkpoint of the served model's shapes"):
        llm.update_weights_from_disk(str(wider))
    llm._add_requests([[1, 2, 3]], [GREEDY], [0])
    with pytest.raises(ValueError, match="only an idle engine updates its weights: 1 requests"):
        llm.update_weights_from_disk()
