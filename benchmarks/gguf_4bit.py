"""A 4-bit GGUF in the 4-bit kernels, its blocks kept as the file has them, beside the same file's weights
quantized again at load from their dequantized values (how a GGUF reached the 4-bit kernels before its blocks were
kept), and beside its dequantized bfloat16 model, in one run: load time, decode time per output token at each batch
size and perplexity on the HumanEval prompts, for

- ``bf16``: the file dequantized, in bfloat16 (no flag; the baseline of every ratio);
- ``blocks+w4a16_int4`` and ``blocks+w4a8_int4``: ``--quantization w4a16_int4`` / ``w4a8_int4``: its Q4_0, Q4_1
  and Q4_K matrices as they are, its other matrices (a Q4_K_M file's Q6_K ones) quantized to 4 bits at load;
- ``requantized+w4a16_int4`` and ``requantized+w4a8_int4``: the same flags on a copy of the converted directory
  without its blocks, so every matrix is quantized at load from its dequantized bfloat16 values.

It prints first, per block type, how far requantizing moves the weights from the file's: the root mean square of
the difference over that of the weights (0 for a Q4_1 file, whose groups survive the round trip exactly).

    .venv/bin/python benchmarks/gguf_4bit.py [--gguf FILE] [--batch-size 1 8] [--num-prompts 64]

``--gguf`` defaults to the built-in model's Q4_1 file; ``benchmarks/random_gguf.py`` writes larger ones (then
``--num-prompts 0``: random weights have no perplexity worth the time). Each setting runs in a fresh process
(``weight_only.run_settings``). ``PAGELLM_NUM_THREADS`` sets the threads.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from weight_only import print_table, run_settings  # noqa: E402

from pagellm.model import gguf_blocks  # noqa: E402
from pagellm.model.loader import default_model_path, hf_model_dir  # noqa: E402
from pagellm.ops import gemm_w4a8  # noqa: E402


def requantization_error(model_dir: Path) -> dict[str, float]:
    """Per 4-bit block type, ``rms(requantized - file) / rms(file)`` over the blocks' matrices (Q8_0 ones, quantized
    at load in either setting, are not among them)."""
    from safetensors import safe_open

    sums: dict[str, list[float]] = {}
    with safe_open(str(model_dir / gguf_blocks.BLOCKS_FILE), framework="pt") as handle:
        kinds = handle.metadata()
        for name in (name for name in handle.keys() if kinds[name] in gguf_blocks.LAYOUTS):
            q, groups = gguf_blocks.decode(handle.get_tensor(name), kinds[name])
            n = q.shape[0]
            exact = (q.float().view(n, -1, 32) * groups[..., :1] + groups[..., 1:]).view(n, -1)
            rq, d, m = gemm_w4a8.quantize(exact.to(torch.bfloat16))
            again = (rq.float().view(n, -1, 32) * d.float()[..., None] + m.float()[..., None]).view(n, -1)
            acc = sums.setdefault(kinds[name], [0.0, 0.0])
            acc[0] += float(((again - exact) ** 2).sum())
            acc[1] += float((exact ** 2).sum())
    return {kind: (err / total) ** 0.5 for kind, (err, total) in sums.items()}


def without_blocks(model_dir: Path, tmp: Path) -> Path:
    """A copy of a converted directory without its blocks (its files linked, not copied): its float32 copies of the
    blocks' matrices (``hf_model_dir``) load in their place."""
    copy = tmp / f"{model_dir.name}-requantized"
    copy.mkdir()
    for path in model_dir.iterdir():
        if path.name != gguf_blocks.BLOCKS_FILE:
            (copy / path.name).symlink_to(path)
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="a 4-bit GGUF (default: the built-in model's)")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64, help="HumanEval prompts for perplexity; 0 skips it")
    args = parser.parse_args()
    argv = ["--batch-size", *map(str, args.batch_size), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--num-iters", str(args.num_iters), "--num-prompts", str(args.num_prompts)]
    model_dir = hf_model_dir(args.gguf or default_model_path())  # with the float32 copies the requantized run reads
    if not (model_dir / gguf_blocks.BLOCKS_FILE).is_file():
        sys.exit(f"{args.gguf or default_model_path()} has no Q4_0, Q4_1 or Q4_K decoder matrices")
    for kind, error in requantization_error(model_dir).items():
        print(f"{kind}: requantized to Q4_1 from the dequantized values, the weights move by {error:.2%} (RMS)")
    with tempfile.TemporaryDirectory() as tmp:
        requantized = without_blocks(model_dir, Path(tmp))
        settings = {"bf16": (model_dir, None)}
        for fmt in ("w4a16_int4", "w4a8_int4"):
            settings |= {f"blocks+{fmt}": (model_dir, fmt), f"requantized+{fmt}": (requantized, fmt)}
        results = run_settings(settings, argv)
    print_table(results, args.batch_size)


if __name__ == "__main__":
    main()
