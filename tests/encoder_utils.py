"""Tiny random encoder-only embedding models (BERT, XLM-RoBERTa) with a WordPiece tokenizer and, where asked, a
sentence-transformers Pooling module, for the encoder tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "big", "red", "house", "is", "here"]


def build_encoder(out: Path, kind: str, pooling: str | None = None) -> Path:
    """A tiny BERT (``kind`` "bert") or XLM-RoBERTa ("xlm-roberta": its specials ordered as XLM-R's, so the padding
    id is 1) with a WordPiece tokenizer, and a sentence-transformers Pooling module where ``pooling`` says."""
    out.mkdir(parents=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if kind == "bert" else \
        ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
    tokenizer = _word_pieces(specials)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128)
    torch.manual_seed(0)
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**shape, max_position_embeddings=64))
    else:
        model = transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**shape, max_position_embeddings=66,
                                                                           pad_token_id=1, type_vocab_size=1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    if pooling is not None:
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "CLS",
            "pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": pooling == "LAST"}))
    return out


def _word_pieces(specials: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A WordPiece tokenizer over ``specials`` (in that id order), ``WORDS`` and letters, adding [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = {token: i for i, token in enumerate(specials + WORDS + letters + [f"##{c}" for c in letters])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
