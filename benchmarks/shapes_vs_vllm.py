"""pagellm beside vLLM on the published shapes of models this machine has no weights for.

No model hub here: each shape is its published config.json (the numbers below), its weights random
(``--load-format dummy`` on both sides) and its tokenizer the built-in model's, so the prompts are random tokens and
the text means nothing, but every GEMM, attention and norm is the model's own size. For each shape and round, pagellm's
``bench throughput`` and vLLM's (``.peers/vllm``, ``make peers``) run back to back, the same prompts' shape, dtype
and thread count, and the script prints each pair's output tok/s and their ratio.

    .venv/bin/python benchmarks/shapes_vs_vllm.py --shapes smollm3-3b olmo2-1b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM = REPO / ".peers" / "vllm" / "bin" / "vllm"

SHAPES = {  # published configs (their hub config.json), the keys a shape needs
    "smollm3-3b": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048,
                   "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "max_position_embeddings": 65536, "rope_theta": 5000000.0,
                   "rms_norm_eps": 1e-06, "vocab_size": 128256, "tie_word_embeddings": True,
                   "no_rope_layer_interval": 4, "use_sliding_window": False, "hidden_act": "silu",
                   "pad_token_id": 128004, "eos_token_id": 128012},
    "olmo2-1b": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 2048,
                 "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "max_position_embeddings": 4096, "rope_theta": 500000,
                 "rms_norm_eps": 1e-06, "vocab_size": 100352, "tie_word_embeddings": False, "hidden_act": "silu",
                 "pad_token_id": 100277, "eos_token_id": 100257},
    "granite-3.3-2b": {"architectures": ["GraniteForCausalLM"], "model_type": "granite", "hidden_size": 2048,
                       "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 10000000.0,
                       "rms_norm_eps": 1e-05, "vocab_size": 49159, "tie_word_embeddings": True,
                       "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                       "logits_scaling": 8.0, "hidden_act": "silu", "pad_token_id": 0, "eos_token_id": 0},
    # gpt-oss-20b's layers, 4 of its 24 (its whole would not fit this machine's memory in bfloat16), its experts in
    # bfloat16 on both sides (no MXFP4 quantization_config)
    "gpt-oss-20b-4layers": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                            "intermediate_size": 2880, "num_hidden_layers": 4, "num_attention_heads": 64,
                            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
                            "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
                            "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True,
                            "rope_theta": 150000, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
                            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 4096},
                            "rms_norm_eps": 1e-05, "vocab_size": 201088, "tie_word_embeddings": False,
                            "hidden_act": "silu", "pad_token_id": 199999, "eos_token_id": 200002},
    # Gemma 2 2B: its soft-capped attention (50) and logits (30), a 4,096-token window in every other layer, 256-wide
    # heads
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
                   "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-06, "vocab_size": 256000, "tie_word_embeddings": True,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256,
                   "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh",
                   "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "eos_token_id": 1,
                   "bos_token_id": 2},
    # Gemma 3 1B: 4 query heads over one KV head of 256, a global layer every sixth among 512-token sliding ones with
    # their own rope base (10,000 against 1,000,000), q/k norms, a 262,144-token vocabulary
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
                   "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
                   "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                   "rms_norm_eps": 1e-06, "vocab_size": 262144, "hidden_activation": "gelu_pytorch_tanh",
                   "attn_logit_softcapping": None, "final_logit_softcapping": None, "pad_token_id": 0,
                   "eos_token_id": [1, 106], "bos_token_id": 2},
    # Command R7B's layers, 4 of its 32 (three sliding, then a full-attention one without a rotary embedding):
    # LayerNorms, attention and the MLP side by side on one norm's output, a logit scale
    "command-r7b-4layers": {"architectures": ["Cohere2ForCausalLM"], "model_type": "cohere2", "hidden_size": 4096,
                            "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32,
                            "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 50000.0,
                            "layer_norm_eps": 1e-05, "logit_scale": 0.25, "sliding_window": 4096,
                            "sliding_window_pattern": 4, "use_qk_norm": False, "attention_bias": False,
                            "vocab_size": 256000, "tie_word_embeddings": True, "hidden_act": "silu",
                            "pad_token_id": 0, "bos_token_id": 5, "eos_token_id": 255001},
}


def shape_dir(name: str, root: Path) -> Path:
    """The shape's folder: its config and the built-in model's tokenizer."""
    sys.path.insert(0, str(REPO))
    from pagellm.model.loader import hf_model_dir

    builtin = hf_model_dir(None)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**SHAPES[name], "torch_dtype": "bfloat16"}, indent=1))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / file, out / file)
    return out


def run(argv: list[str], env: dict[str, str], result: Path, timeout: float) -> None:
    proc = subprocess.run(argv, env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def pagellm(model: Path, args: argparse.Namespace, out: Path) -> float:
    result = out / "pagellm.json"
    result.unlink(missing_ok=True)
    run([str(REPO / ".venv" / "bin" / "pagellm"), "bench", "throughput", "--model", str(model), "--load-format",
         "dummy", "--dtype", "bfloat16", "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
         "--output-len", str(args.output_len), "--kv-cache-memory", str(args.kv_gib << 30), "--max-model-len",
         str(args.max_model_len), "--result-json", str(result)],
        {"PAGELLM_NUM_THREADS": str(args.threads)}, result, args.timeout)
    return json.loads(result.read_text())["results"][0]["output_throughput"]


def vllm(model: Path, args: argparse.Namespace, out: Path) -> float:
    result = out / "vllm.json"
    result.unlink(missing_ok=True)
    run([str(VLLM), "bench", "throughput", "--model", str(model), "--load-format", "dummy", "--dtype", "bfloat16",
         "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
         str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-model-len", str(args.max_model_len),
         "--output-json", str(result)],
        {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
         "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, result, args.timeout)
    return json.loads(result.read_text())["requests_per_second"] * args.output_len  # each request: output_len tokens


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm3-3b", "olmo2-1b"])
    cmd.add_argument("--rounds", type=int, default=2)
    cmd.add_argument("--num-prompts", type=int, default=16)
    cmd.add_argument("--input-len", type=int, default=128)
    cmd.add_argument("--output-len", type=int, default=64)
    cmd.add_argument("--max-model-len", type=int, default=2048)
    cmd.add_argument("--kv-gib", type=int, default=2)
    cmd.add_argument("--threads", type=int, default=2)
    cmd.add_argument("--timeout", type=float, default=1800)
    args = cmd.parse_args()
    if not VLLM.exists():
        sys.exit(f"vLLM is not installed at {VLLM}: run `make peers`")
    with tempfile.TemporaryDirectory(prefix="shapes-") as tmp:
        root = Path(tmp)
        for name in args.shapes:
            model = shape_dir(name, root)
            for round_ in range(1, args.rounds + 1):
                ours, theirs = pagellm(model, args, root), vllm(model, args, root)
                print(f"{name} round {round_}: pagellm {ours:.1f} output tok/s, vLLM {theirs:.1f}: "
                      f"{ours / theirs:.2f}x", flush=True)


if __name__ == "__main__":
    main()
