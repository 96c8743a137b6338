"""Encoder-only embedding models (``model/bert.py``): tiny random BERT and XLM-RoBERTa models built here with
transformers (a WordPiece tokenizer; XLM-RoBERTa's padding id 1, its positions from 2), each prompt's embedding
pooled as its sentence-transformers config says (CLS, mean or last token; ``--pooler-config`` over it) must equal
transformers' token states pooled so, in float32, for prompts of different lengths in one step; generation is
refused, and the engine runs them with chunked prefill and prefix caching off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from encoder_utils import build_encoder

from pagellm import LLM, SamplingParams

TEXTS = ["the cat sat on the mat", "a big red house", "dog", "the dog is here on a big mat the cat sat"]


def _expected(model_dir: Path, kind: str, pooling: str) -> list[torch.Tensor]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir)
    out = []
    for text in TEXTS:
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            states = model.eval()(**ids).last_hidden_state[0]
        out.append(states[0] if pooling == "CLS" else states.mean(0) if pooling == "MEAN" else states[-1])
    return out


@pytest.mark.parametrize("backend", ["cpu_paged", "torch_ref"])
@pytest.mark.parametrize("kind,pooling,flag", [("bert", "CLS", None), ("bert", "MEAN", None),
                                               ("xlm-roberta", "CLS", None), ("xlm-roberta", None, "MEAN"),
                                               ("bert", "MEAN", "LAST"), ("modernbert", "MEAN", None)])
def test_embeddings_are_transformers_token_states_pooled(kind: str, pooling: str | None, flag: str | None,
                                                          backend: str, tmp_path: Path) -> None:
    """The sentence-transformers Pooling config picks the pooling; ``pooler_config`` overrides it; without either,
    CLS. Attention through the C++ kernel or its plain twin."""
    model_dir = build_encoder(tmp_path / kind, kind, pooling)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, attention_backend=backend,
              **({"pooler_config": {"pooling_type": flag}} if flag else {}))
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(TEXTS, normalize=False, use_tqdm=False)]
    for ours, theirs in zip(got, _expected(model_dir, kind, flag or pooling or "CLS")):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    normalized = llm.embed(TEXTS[:1], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(normalized), got[0] / got[0].norm(), atol=1e-6, rtol=1e-5)
    if kind == "xlm-roberta":  # a pad token inside a prompt keeps the padding position, as transformers numbers it
        ids = [0, 5, 1, 6, 2]
        model = transformers.XLMRobertaModel.from_pretrained(model_dir).eval()
        with torch.no_grad():
            states = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        ours = llm.embed({"prompt_token_ids": ids}, normalize=False, use_tqdm=False)[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(ours), states[0] if (flag or pooling) == "CLS" else states.mean(0),
                                   atol=1e-5, rtol=1e-5)


def test_the_engine_runs_each_prompt_whole_and_refuses_generation(tmp_path: Path) -> None:
    model_dir = build_encoder(tmp_path / "bert", "bert", "MEAN")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=64,
              enable_chunked_prefill=True, enable_prefix_caching=True, long_prefill_token_threshold=4)
    scheduler = llm.engine.core.scheduler
    assert not scheduler.chunked_prefill and not scheduler.kv.enable_caching
    assert llm.engine.core.executor.worker.runner.kv_caches == []
    first, again = (llm.embed([TEXTS[3]] * 2, normalize=False, use_tqdm=False) for _ in range(2))
    assert first[0].outputs.embedding == first[1].outputs.embedding == again[0].outputs.embedding
    with pytest.raises(ValueError, match="embedding"):
        llm.generate(TEXTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"an encoder-only model computes each prompt in one step: "
                                         r"max_num_batched_tokens \(16\) must be >= max_model_len \(64\)"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="pooling_type 'SUM'"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22, pooler_config='{"pooling_type": "sum"}')


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "modernbert"])
def test_cross_encoders_score_pairs_and_classify_as_transformers(kind: str, tmp_path: Path) -> None:
    """A reranker (one class): ``LLM.score`` is the sigmoid of transformers' logit over each pair as the tokenizer
    joins it (BERT's second text typed 1); a classifier of three classes: ``LLM.classify`` is transformers'
    softmax."""
    query, docs = "where is the cat", ["the cat sat on the mat", "a big red house", "dog"]
    reranker = build_encoder(tmp_path / "reranker", kind, labels=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reranker)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(reranker).eval()
    with torch.no_grad():
        logits = torch.cat([reference(**tokenizer(query, doc, return_tensors="pt")).logits[0] for doc in docs])
    llm = LLM(str(reranker), dtype="float32", kv_cache_memory=1 << 22)
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(scores), logits.sigmoid(), atol=1e-5, rtol=1e-5)
    if kind == "bert":  # the second text's type matters: typed 0 throughout, the logits differ
        types = tokenizer(query, docs[0], return_tensors="pt")
        with torch.no_grad():
            untyped = reference(input_ids=types["input_ids"], token_type_ids=torch.zeros_like(types["input_ids"]))
        assert abs(untyped.logits[0, 0].item() - logits[0].item()) > 1e-3
    classifier = build_encoder(tmp_path / "classifier", kind, labels=3)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    with torch.no_grad():
        probs = [reference(**tokenizer(text, return_tensors="pt")).logits[0].softmax(-1) for text in docs]
    llm = LLM(str(classifier), dtype="float32", kv_cache_memory=1 << 22)
    got = [torch.tensor(o.outputs.probs) for o in llm.classify(docs, use_tqdm=False)]
    torch.testing.assert_close(torch.stack(got), torch.stack(probs), atol=1e-5, rtol=1e-5)


def test_bfloat16_embeddings_on_both_attention_paths_agree(tmp_path: Path) -> None:
    """In bfloat16 (the packed GEMM, the kernel's flash tiles at head size 64) the embeddings stay within bfloat16's
    rounding of the float32 ones, on the C++ kernel and on its SDPA twin."""
    model_dir = build_encoder(tmp_path / "bert", "bert", "MEAN", head_size=64)
    exact = torch.tensor([o.outputs.embedding for o in LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22)
                          .embed(TEXTS, use_tqdm=False)])
    for backend in ("cpu_paged", "torch_ref"):
        llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=1 << 22, attention_backend=backend)
        got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
        assert (got * exact).sum(-1).min() > 0.999  # cosine of unit vectors


def test_a_decoder_takes_last_token_pooling_only(tiny_llama: Path) -> None:
    """``pooler_config`` asks a decoder embedding model for LAST (what it does) or is refused by name."""
    last = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1 << 22, pooler_config={"pooling_type": "LAST"})
    assert len(last.embed(["hello"], use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="a decoder pools its prompt's last token"):
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1 << 22, pooler_config={"pooling_type": "MEAN"})


def test_runner_pooling_serves_a_generative_checkpoint_as_an_embedding_model(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's ``--runner pooling`` and ``--convert embed``: a causal LM's embeddings (its last token's final state),
    generation refused; ``--runner generate`` on an embedding checkpoint is refused by name."""
    plain = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1 << 22)
    expected = plain.embed(["hello there"], use_tqdm=False)[0].outputs.embedding
    for flags in ({"runner": "pooling"}, {"convert": "embed"}):
        llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1 << 22, **flags)
        assert llm.embed(["hello there"], use_tqdm=False)[0].outputs.embedding == expected
        with pytest.raises(ValueError, match="it serves embeddings only .*--runner pooling / --convert embed"):
            llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='other'; use auto, generate or pooling"):
        LLM(str(tiny_llama), runner="other")
    with pytest.raises(ValueError, match="convert='classify'; use auto, none or embed"):
        LLM(str(tiny_llama), convert="classify")
    with pytest.raises(ValueError, match="BertModel has no language-model head: it serves pooling requests only; "
                                         "drop runner=generate"):
        LLM(str(build_encoder(tmp_path / "bert", "bert")), dtype="float32", kv_cache_memory=1 << 22, runner="generate")


def test_sentence_transformers_dense_layers_follow_the_pooling(tmp_path: Path) -> None:
    """A Dense module (Tanh) after the pooling projects the pooled state, as sentence-transformers computes it; a
    module of a kind the engine does not run is refused by name."""
    from safetensors.torch import save_file

    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    normalize = {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}
    model_dir = build_encoder(tmp_path / "bert", "bert", "MEAN", after=[dense, normalize])
    (model_dir / "2_Dense").mkdir()
    (model_dir / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 64, "out_features": 24, "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh"}))
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(24, 64, generator=gen) * 0.3, torch.randn(24, generator=gen)
    save_file({"linear.weight": weight, "linear.bias": bias}, model_dir / "2_Dense" / "model.safetensors")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, normalize=False, use_tqdm=False)])
    expected = torch.stack([torch.tanh(weight @ pooled + bias) for pooled in _expected(model_dir, "bert", "MEAN")])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    modules = json.loads((model_dir / "modules.json").read_text())
    (model_dir / "modules.json").write_text(json.dumps(modules + [
        {"idx": 4, "name": "4", "path": "4_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}]))
    with pytest.raises(ValueError, match="its sentence-transformers module 'sentence_transformers.models.LayerNorm' "
                                         "is not supported"):
        LLM(str(model_dir), dtype="float32", kv_cache_memory=1 << 22)
