"""Sequence classifiers (``*ForSequenceClassification`` checkpoints: reward models, classifiers): ``LLM.classify``
gives each prompt's class probabilities as transformers computes them (its last token's state through the score
head; softmax, or a sigmoid with one class) in float32, with the checkpoint's class names; generation and
embeddings are refused by name, and other models refuse to classify."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from classifier_utils import KINDS, build_classifier

from pagellm import LLM, SamplingParams


@pytest.fixture(scope="module", params=list(KINDS))
def classifier(request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_classifier(tmp_path_factory.mktemp(f"classifier-{request.param}"), request.param, tiny_llama)


def test_classify_matches_transformers(classifier: Path) -> None:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    labels = [hf.config.id2label[i] for i in range(hf.config.num_labels)]
    llm = LLM(str(classifier), dtype="float32", max_num_batched_tokens=32)  # the longer prompts run in chunks
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 5, 17, 40, 77)]
    outputs = llm.classify(prompts + ["some text to classify"], use_tqdm=False)
    assert list(llm.labels) == labels
    for prompt, out in zip(prompts + [llm.tokenizer.encode("some text to classify")], outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0]
        ref = torch.sigmoid(logits) if len(labels) == 1 else torch.softmax(logits, -1)
        assert out.prompt_token_ids == prompt and out.outputs.num_classes == len(labels)
        assert out.outputs.probs == pytest.approx(ref.tolist(), abs=1e-5)
    again = llm.classify(prompts[-1:], use_tqdm=False)[0]  # its prefix now comes from the cache
    assert again.num_cached_tokens > 0 and again.outputs.probs == pytest.approx(outputs[-2].outputs.probs, abs=1e-5)
    with pytest.raises(ValueError, match="sequence classifier .* serves classify requests only"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="serves classify requests only"):
        llm.embed(["hi"], use_tqdm=False)


def test_a_model_without_a_head_does_not_classify(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    assert llm.labels == ()
    with pytest.raises(ValueError, match="no classification head: LLM.classify needs a \\*ForSequenceClassification"):
        llm.classify(["hi"], use_tqdm=False)
