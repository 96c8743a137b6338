"""Encoder embedding throughput (BERT-base's shape: bge-base-en-v1.5, e5-base; or ``--shape modernbert``,
ModernBERT-base's: modernbert-embed-base, gte-modernbert-base): pagellm's ``LLM.embed`` against transformers' model
in static batches and, where ``make peers`` installed it, vLLM's ``LLM.embed``, on the
same random-weight checkpoint and the same prompts (token ids of random lengths), each in its own Python, in one
run. Prints prompts/s and prompt tokens/s of each, the ratios to pagellm, and the largest difference between
pagellm's normalised embeddings and each other system's.

    .venv/bin/python benchmarks/encoder_embed.py [--shape bert|modernbert] [--num-prompts 256] [--min-len 32]
        [--max-len 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".peers" / "vllm" / "bin" / "python"
RESULT = "RESULT "
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
MODERNBERT_BASE = dict(vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                       intermediate_size=1152, max_position_embeddings=8192, pad_token_id=0, bos_token_id=101,
                       eos_token_id=102, cls_token_id=101, sep_token_id=102)


def make_model(root: Path, shape: str = "bert") -> Path:
    """BERT-base (or ModernBERT-base) with random weights (bfloat16) and a WordPiece tokenizer of its vocabulary's
    size, CLS pooling."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    out = root / f"{shape}-base-shape"
    sizes = BERT_BASE if shape == "bert" else MODERNBERT_BASE
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += [f"w{i}" for i in range(sizes["vocab_size"] - len(vocab))]
    backend = Tokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[
        ("[CLS]", 101), ("[SEP]", 102)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                                     cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    torch.manual_seed(0)
    if shape == "bert":
        transformers.BertModel(transformers.BertConfig(**BERT_BASE)).to(torch.bfloat16).save_pretrained(out)
    else:
        transformers.ModernBertModel(transformers.ModernBertConfig(**MODERNBERT_BASE)).to(torch.bfloat16) \
            .save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prompts(args: argparse.Namespace) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[101] + [rng.randrange(1000, 30000) for _ in range(rng.randint(args.min_len, args.max_len) - 2)] + [102]
            for _ in range(args.num_prompts)]


def worker(args: argparse.Namespace) -> None:
    """One system's run: warm-up, then every prompt embedded, timed; the embeddings and time on stdout."""
    import torch

    batch = prompts(args)
    if args.worker == "transformers":
        from transformers import AutoModel

        model = AutoModel.from_pretrained(args.model, dtype=torch.bfloat16).eval()

        def embed(items: list[list[int]]) -> list[list[float]]:
            out = []
            for i in range(0, len(items), args.hf_batch):
                chunk = items[i:i + args.hf_batch]
                longest = max(map(len, chunk))
                ids = torch.tensor([p + [0] * (longest - len(p)) for p in chunk])
                mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in chunk])
                with torch.inference_mode():
                    cls = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0].float()
                out += (cls / cls.norm(dim=-1, keepdim=True)).tolist()
            return out
    else:
        if args.worker == "vllm":
            from vllm import LLM
        else:
            sys.path.insert(0, str(REPO))
            from pagellm import LLM
        kwargs = {"runner": "pooling", "pooler_config": {"pooling_type": "CLS"}} if args.worker == "vllm" else {}
        llm = LLM(str(args.model), dtype="bfloat16", max_model_len=512, **kwargs)

        def embed(items: list[list[int]]) -> list[list[float]]:
            return [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in items], use_tqdm=False)]
    embed(batch[:8])  # warm-up
    start = time.perf_counter()
    vectors = embed(batch)
    print(RESULT + json.dumps({"elapsed": time.perf_counter() - start, "vectors": vectors}))


def run(system: str, model: Path, args: argparse.Namespace) -> dict | None:
    python = VLLM_PYTHON if system == "vllm" else REPO / ".venv" / "bin" / "python"
    if not python.exists():
        print(f"{system}: not installed ({python}); skipped")
        return None
    env = {**os.environ, "PAGELLM_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads),
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    argv = [str(python), __file__, "--worker", system, "--model", str(model), "--num-prompts", str(args.num_prompts),
            "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--hf-batch", str(args.hf_batch)]
    proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        print(f"{system}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
        return None
    if proc.returncode:  # its result is in: a crash on the way out does not change it
        print(f"{system}: exited with {proc.returncode} after its result")
    return json.loads(lines[-1][len(RESULT):])


def main() -> None:
    import numpy as np

    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--shape", choices=["bert", "modernbert"], default="bert")
    cmd.add_argument("--num-prompts", type=int, default=256)
    cmd.add_argument("--min-len", type=int, default=32)
    cmd.add_argument("--max-len", type=int, default=256)
    cmd.add_argument("--hf-batch", type=int, default=32, help="transformers' static batch size")
    cmd.add_argument("--threads", type=int, default=2)
    cmd.add_argument("--timeout", type=int, default=1800)
    cmd.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    cmd.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    args = cmd.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="encoder-embed-") as tmp:
        model = make_model(Path(tmp), args.shape)
        results = {system: run(system, model, args) for system in ("pagellm", "transformers", "vllm")}
    tokens = sum(map(len, prompts(args)))
    ours = results["pagellm"]
    print(f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens ({tokens} in all), {args.shape}-base's "
          f"shape, bfloat16, {args.threads} threads")
    for system, result in results.items():
        if result is None:
            continue
        line = f"{system:>12} {args.num_prompts / result['elapsed']:7.1f} prompts/s {tokens / result['elapsed']:8.0f}" \
               f" tokens/s ({result['elapsed']:.2f} s)"
        if ours is not None and system != "pagellm":
            diff = np.abs(np.array(result["vectors"]) - np.array(ours["vectors"])).max()
            line += f"; pagellm {result['elapsed'] / ours['elapsed']:.2f}x its rate, largest difference {diff:.1e}"
        print(line)


if __name__ == "__main__":
    main()
