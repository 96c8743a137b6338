"""A Llama GGUF of a chosen shape with random float16 weights and the built-in model's tokenizer, for speed
comparisons at sizes the built-in model does not have (its 576 inputs are not whole Q4_K super-blocks of 256, so
llama.cpp's K-quants fall back to other types on it). Quantize it with llama.cpp's own tool:

    .venv/bin/python benchmarks/random_gguf.py /tmp/llama-1b-f16.gguf        # Llama-3.2-1B's shape (the default)
    LD_LIBRARY_PATH=.peers/llama.cpp/build/bin .peers/llama.cpp/build/bin/llama-quantize \\
        /tmp/llama-1b-f16.gguf /tmp/llama-1b-Q4_K_M.gguf Q4_K_M

Weights are N(0, 0.02) (norms 1), so the model's text is noise: its figures are speeds, not quality.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm.model.loader import default_model_path  # noqa: E402

_SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "rope.dimension_count")


def write(path: Path, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seed: int) -> None:
    source = gguf.GGUFReader(str(default_model_path()))
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for name, field in source.fields.items():  # the tokenizer, the chat template, rope and norm settings
        if name.startswith("GGUF.") or name == "general.architecture" or name == "general.file_type" or \
                name.removeprefix("llama.") in _SHAPE_KEYS:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)
    vocab = int(source.fields["llama.vocab_size"].contents())
    head_dim = hidden // heads

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for name, (rows, cols) in {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                                   "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                                   "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden),
                                   "ffn_down": (hidden, intermediate)}.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--intermediate-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.path, args.hidden_size, args.num_layers, args.num_heads, args.num_kv_heads, args.intermediate_size,
          args.seed)
    print(f"wrote {args.path}")


if __name__ == "__main__":
    main()
