"""gpt-oss's experts kept in MXFP4 (the MXFP4 GEMM) against the same values in bfloat16, offline, with peak memory.

No model hub here: the script writes an MXFP4 checkpoint of gpt-oss-20b's layers (``--layers`` of its 24; its
experts' blocks and scales random, as a checkpoint stores them, its other tensors random bfloat16) and its float
twin (the experts dequantized as transformers dequantizes them, the other tensors the same: the same model, so the
same routing), then runs ``pagellm bench throughput`` on each in turn, each round: on the MXFP4 one the experts stay
in 4 bits, on the twin they are bfloat16. It prints output tok/s and the peak private memory of the process tree
(resident less shared, file-backed pages: the checkpoint's mapped pages are the page cache's; sampled every 0.1 s).

    .venv/bin/python benchmarks/gpt_oss_mxfp4.py --layers 4 --rounds 2

With ``--gguf FILE`` it writes the MXFP4 checkpoint as a GGUF instead, with llama.cpp's own converter
(``.peers/llama.cpp/convert_hf_to_gguf.py`` from ``make peers``, ``--outtype bf16``: the experts' MXFP4 blocks as
they are, every other matrix bfloat16, as ``gpt-oss-20b-mxfp4.gguf`` is written), and stops; ``benchmarks/compare.py
--gguf FILE --systems pagellm llama.cpp`` then serves that file on both:

    .venv/bin/python benchmarks/gpt_oss_mxfp4.py --layers 4 --gguf /tmp/gpt-oss-20b-4layers-mxfp4.gguf
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

import psutil
import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from shapes_vs_vllm import SHAPES, shape_dir  # noqa: E402

QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}


def mxfp4_checkpoint(dense: Path, out: Path) -> Path:
    """``dense``'s shape as an MXFP4 checkpoint: random expert codes with scales near 2^-6, random small bfloat16."""
    cfg = json.loads((dense / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (out / file).write_bytes((dense / file).read_bytes())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    gen = torch.Generator().manual_seed(0)
    h, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def small(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 2e-2 - 1e-2).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": small(cfg["vocab_size"], h), "lm_head.weight": small(cfg["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows, cols in (("q", heads * d, h), ("k", kv * d, h), ("v", kv * d, h), ("o", h, heads * d)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = small(rows, cols)
            tensors[f"{p}self_attn.{name}_proj.bias"] = small(rows)
        tensors[f"{p}self_attn.sinks"] = small(heads)
        tensors[f"{p}mlp.router.weight"], tensors[f"{p}mlp.router.bias"] = small(experts, h), small(experts)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for name, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            shape = (experts, rows, cols // 32)
            tensors[f"{p}mlp.experts.{name}_blocks"] = torch.randint(0, 256, (*shape, 16), generator=gen,
                                                                     dtype=torch.uint8)
            tensors[f"{p}mlp.experts.{name}_scales"] = torch.randint(119, 122, shape, generator=gen, dtype=torch.uint8)
            tensors[f"{p}mlp.experts.{name}_bias"] = small(experts, rows)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def float_twin(packed: Path, out: Path) -> Path:
    """``packed``'s float checkpoint: its experts dequantized to bfloat16 (``[experts, in, out]``, transformers'
    layout), every other tensor and file the same but the config's quantization."""
    sys.path.insert(0, str(REPO))
    from pagellm.model import mxfp4

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((packed / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (out / file).write_bytes((packed / file).read_bytes())
    with safe_open(str(packed / "model.safetensors"), framework="pt") as handle:
        tensors = dict(mxfp4.weights((name, handle.get_tensor(name)) for name in handle.keys()))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(out / "model.safetensors"))
    return out


def run(model: Path, args: argparse.Namespace, result: Path) -> tuple[float, float]:
    """(output tok/s, peak private GiB of the process tree) of one ``bench throughput`` run."""
    result.unlink(missing_ok=True)
    argv = [str(REPO / ".venv" / "bin" / "pagellm"), "bench", "throughput", "--model", str(model), "--dtype",
            "bfloat16", "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--kv-cache-memory", str(2 << 30), "--max-model-len", "2048", "--result-json",
            str(result)]
    proc = subprocess.Popen(argv, env={**os.environ, "PAGELLM_NUM_THREADS": str(args.threads)}, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            # private memory (resident less file-backed pages: the checkpoint's mapped pages are the page cache's)
            peak = max(peak, sum(m.rss - m.shared for m in (p.memory_info() for p in [root, *root.children(True)])))
        except psutil.Error:
            pass
        time.sleep(0.1)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"bench throughput exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
    return json.loads(result.read_text())["results"][0]["output_throughput"], peak / 2**30


def write_gguf(packed: Path, out: Path) -> None:
    """``packed`` converted by llama.cpp's own ``convert_hf_to_gguf.py`` (bfloat16 around its MXFP4 experts)."""
    converter = REPO / ".peers" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not converter.exists():
        sys.exit(f"{converter} not found (run `make peers`)")
    env = {**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")}
    subprocess.run([sys.executable, str(converter), str(packed), "--outtype", "bf16", "--outfile", str(out)], env=env,
                   check=True)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")


def main() -> None:
    cmd = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cmd.add_argument("--layers", type=int, default=4)
    cmd.add_argument("--rounds", type=int, default=2)
    cmd.add_argument("--num-prompts", type=int, default=16)
    cmd.add_argument("--input-len", type=int, default=128)
    cmd.add_argument("--output-len", type=int, default=64)
    cmd.add_argument("--threads", type=int, default=2)
    cmd.add_argument("--gguf", type=Path, default=None, metavar="FILE",
                     help="write the MXFP4 checkpoint as a GGUF with llama.cpp's converter to FILE and stop")
    args = cmd.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpt-oss-mxfp4-") as tmp:
        root = Path(tmp)
        SHAPES["gpt-oss"] = {**SHAPES["gpt-oss-20b-4layers"], "num_hidden_layers": args.layers,
                             "layer_types": ["sliding_attention", "full_attention"] * (args.layers // 2)}
        packed = mxfp4_checkpoint(shape_dir("gpt-oss", root), root / "mxfp4")
        if args.gguf is not None:
            return write_gguf(packed, args.gguf)
        twin = float_twin(packed, root / "float")
        for round_ in range(1, args.rounds + 1):
            kept, kept_gib = run(packed, args, root / "kept.json")
            bf16, bf16_gib = run(twin, args, root / "bf16.json")
            print(f"round {round_}: MXFP4 experts {kept:.1f} output tok/s, {kept_gib:.2f} GiB peak; bfloat16 "
                  f"experts {bf16:.1f} tok/s, {bf16_gib:.2f} GiB: {kept / bf16:.2f}x the speed, "
                  f"{kept_gib / bf16_gib:.2f}x the memory", flush=True)


if __name__ == "__main__":
    main()
