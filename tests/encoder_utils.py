"""Tiny random encoder-only embedding models (BERT, XLM-RoBERTa) with a WordPiece tokenizer and, where asked, a
sentence-transformers Pooling module, for the encoder tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "big", "red", "house", "is", "here"]


def build_encoder(out: Path, kind: str, pooling: str | None = None, labels: int = 0, head_size: int = 16,
                  after: list[dict] | None = None) -> Path:
    """A tiny BERT (``kind`` "bert"), ModernBERT ("modernbert") or XLM-RoBERTa ("xlm-roberta": its specials ordered
    as XLM-R's, so the padding id is 1) with a WordPiece tokenizer, and a sentence-transformers Pooling module where
    ``pooling`` says; with
    ``labels``, its ``*ForSequenceClassification`` of that many classes (a cross-encoder); ``after``: more
    sentence-transformers modules after the Pooling one (``modules.json`` entries)."""
    out.mkdir(parents=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if kind == "bert" else \
        ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]
    tokenizer = _word_pieces(specials, typed=kind == "bert")
    shape = dict(vocab_size=len(tokenizer), hidden_size=4 * head_size, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128)
    torch.manual_seed(0)
    if labels:
        shape["num_labels"] = labels
    if kind == "modernbert":  # a global layer, then local ones of a 3-token reach each way; biases and norms
        config = transformers.ModernBertConfig(**{**shape, "num_hidden_layers": 3}, max_position_embeddings=128,
                                               local_attention=6, global_attn_every_n_layers=2, norm_bias=True,
                                               attention_bias=True, mlp_bias=True, pad_token_id=0, bos_token_id=2,
                                               eos_token_id=3, cls_token_id=2, sep_token_id=3, global_rope_theta=500.0,
                                               classifier_pooling="mean" if labels > 1 else "cls")
        model = (transformers.ModernBertForSequenceClassification if labels else transformers.ModernBertModel)(config)
    elif kind == "bert":
        config = transformers.BertConfig(**shape, max_position_embeddings=64)
        model = (transformers.BertForSequenceClassification if labels else transformers.BertModel)(config)
    else:
        config = transformers.XLMRobertaConfig(**shape, max_position_embeddings=66, pad_token_id=1, type_vocab_size=1)
        model = (transformers.XLMRobertaForSequenceClassification if labels else transformers.XLMRobertaModel)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or "norm." in name:
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.3)
            elif name.endswith(".bias") and kind == "modernbert":
                param.normal_(0.0, 0.3)
            elif "token_type" in name or "classifier" in name or "pooler" in name or "head" in name:  # to matter
                param.normal_(0.0, 0.5)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    if pooling is not None:
        (out / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            *(after or [])]))
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 4 * head_size, "pooling_mode_cls_token": pooling == "CLS",
            "pooling_mode_mean_tokens": pooling == "MEAN", "pooling_mode_max_tokens": False,
            "pooling_mode_lasttoken": pooling == "LAST"}))
    return out


def _word_pieces(specials: list[str], typed: bool) -> transformers.PreTrainedTokenizerFast:
    """A WordPiece tokenizer over ``specials`` (in that id order), ``WORDS`` and letters, adding [CLS] ... [SEP];
    a pair as BERT's joins it (``typed``: the second text and its [SEP] of type 1) or as XLM-R's (two separators
    between the texts, no types)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    letters = list("abcdefghijklmnopqrstuvwxyz")
    vocab = {token: i for i, token in enumerate(specials + WORDS + letters + [f"##{c}" for c in letters])}
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1" if typed else "[CLS] $A [SEP] [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    backend.decoder = decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_input_names=["input_ids", "token_type_ids", "attention_mask"]
                                                if typed else ["input_ids", "attention_mask"])
