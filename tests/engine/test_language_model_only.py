"""``language_model_only`` (vLLM's ``--language-model-only``): a vision-language model's decoder served alone, for
SmolVLM (Idefics3), LLaVA-NeXT and Gemma 3 (each family's checkpoint names): no encoder is built or loaded, text
prompts get the whole model's tokens, and prompts with images are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from vlm_utils import build_gemma3, build_llava, build_vlm, image

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BUILDERS = {"idefics3": (build_vlm, "llama", "<image>"),
            "llava_next": (lambda decoder, out: build_llava(decoder, out, anyres=True), "llama", "<image>"),
            "gemma3": (build_gemma3, "gemma3", "<start_of_image>")}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_decoder_alone_serves_text_and_refuses_images(family: str, tiny_model_factory: Callable[..., Path],
                                                          tmp_path: Path) -> None:
    build, decoder, placeholder = BUILDERS[family]
    model_dir = build(tiny_model_factory(decoder), tmp_path / family)
    whole = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22)
    alone = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, language_model_only=True)
    model = alone.engine.core.executor.worker.runner.model
    assert model.vision is None and not any(name.startswith("vision.") for name, _ in model.named_parameters())
    prompts = ["Tell me a story", "Count: one two"]
    assert [o.outputs[0].token_ids for o in alone.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.raises(ValueError, match="this model takes no images"):
        alone.generate({"prompt": f"Look {placeholder}", "multi_modal_data": {"image": image(0, 40, 40)}}, GREEDY,
                       use_tqdm=False)
