"""A weight-only 4-bit checkpoint (compressed-tensors W4A16, as llm-compressor's round-to-nearest scheme writes it)
beside the float model it was made from, in one run: load time, decode time per output token at each batch size, and
perplexity on the HumanEval prompts, for

- ``float``: the float checkpoint in bfloat16 (the baseline of every ratio; a checkpoint dequantized at load, as
  one is on a CPU without AVX-512 BF16, runs at its speed);
- ``w4a16``: the W4A16 checkpoint with no flag: its own integers and scales in the W4A16 kernel (``w4a16_int4``,
  bfloat16 activations) where it runs, else dequantized (the ``format`` column says which);
- ``w4a16+w4a8_int4``: the same checkpoint in the 4-bit kernel with int8 activations (``--quantization w4a8_int4``);
- ``w4a16+w8a8_int8``: the same checkpoint dequantized, then quantized to int8 per output channel, int8
  activations (what int8 activations cost on these weights, through the other kernel);
- ``float+w4a8_int4`` and ``float+w4a16_int4``: the float checkpoint quantized at load to Q4_1's groups of 32
  (scale and minimum each), int8 or bfloat16 activations.

    .venv/bin/python benchmarks/weight_only.py [--model HF_DIR] [--group-size 32] [--batch-size 1 8]
        [--input-len 128] [--output-len 64] [--num-iters 3] [--num-prompts 64]

With ``--format gptq-act-order`` the checkpoint is a GPTQ one with act-order (``desc_act``: each group of inputs
taken in the order of a stand-in for GPTQ's Hessian diagonal, the summed squares of the input's column over the
matrices that read it; symmetric round-to-nearest, no calibration), beside

- ``gptq-in-order``: the same quantization with each group's inputs in order (what the act-order gather costs);
- ``act-order@REV`` with ``--baseline-rev REV``: the act-order checkpoint served by that revision's tree.

    .venv/bin/python benchmarks/weight_only.py --format gptq-act-order --group-size 128 --model DIR_OR_GGUF
        [--baseline-rev REV]

``--model`` defaults to the built-in SmolLM2-135M-Instruct (its GGUF's converted directory); its 576 inputs take
groups of 32 or 64, not llm-compressor's default 128. Each setting runs in a fresh process (load times as a server
sees them). ``PAGELLM_NUM_THREADS`` sets the threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# PAGELLM_BENCH_TREE: a baseline revision's exported tree (--baseline-rev) to import pagellm from, else this one.
sys.path.insert(0, os.environ.get("PAGELLM_BENCH_TREE") or str(Path(__file__).resolve().parents[1]))
import pagellm  # noqa: E402  (first: the chosen tree's, before quality.py puts this checkout first on the path)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import perplexity  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.bench import latency  # noqa: E402
from pagellm.bench.datasets import load_humaneval_prompts  # noqa: E402
from startup import export  # noqa: E402

from pagellm.model import compressed_tensors  # noqa: E402
from pagellm.model.compressed_tensors import write_w4a16  # noqa: E402
from pagellm.model.loader import iter_weights, resolve_model_dir  # noqa: E402
from pagellm.ops import gemm  # noqa: E402


def measure(model: Path, quantization: str | None, args: argparse.Namespace, prompts: list[str]) -> dict:
    start = time.perf_counter()
    llm = LLM(str(model), dtype="bfloat16", kv_cache_memory=1 << 30, quantization=quantization)
    loaded = time.perf_counter() - start
    timing = argparse.Namespace(input_len=args.input_len, output_len=args.output_len, num_iters=args.num_iters,
                                num_warmup=1, vocab_size=args.vocab_size, dataset_seed=0, profile=False)
    per_token = {b: latency.measure(llm, b, timing)["decode_ms_per_token"] for b in args.batch_size}
    qkv = llm.engine.core.executor.worker.runner.model.model.layers[0].self_attn.qkv_proj.weight
    return {"load_s": loaded, "ms_per_token": per_token, "perplexity": perplexity(llm, prompts) if prompts else None,
            "format": gemm.weight_format(qkv) or "plain", "package": str(Path(pagellm.__file__).parent)}


def in_own_process(model: Path, quantization: str | None, argv: list[str], tree: Path | None = None) -> dict:
    """``measure`` in a fresh interpreter (with ``tree``'s pagellm where given): a load after another model's in the
    same process runs slower (its freed memory is faulted in again), which would not be the load a server sees."""
    cmd = [sys.executable, __file__, *argv, "--measure", str(model), quantization or "none"]
    env = {**os.environ, "PAGELLM_BENCH_TREE": str(tree)} if tree else None
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


_SAME_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # matrices that read one input


def write_gptq(src: Path, out: Path, group_size: int, act_order: bool) -> Path:
    """A 4-bit GPTQ checkpoint of ``src`` (symmetric, ``checkpoint_format: gptq``: zero points stored minus one),
    round to nearest; with ``act_order`` each group takes the inputs of the next ``group_size`` largest summed
    squares of their columns over the matrices that read the same input (one order for q, k and v, one for gate and
    up), as GPTQ's act-order takes them by its Hessian's diagonal."""
    def reader(name: str) -> str:  # the first matrix that reads this one's input
        base, _, part = name.removesuffix(".weight").rpartition(".")
        return f"{base}.{_SAME_INPUT.get(part, part)}"

    energy: dict[str, torch.Tensor] = {}
    for name, t in iter_weights(src):
        if compressed_tensors.is_linear(name):
            energy[reader(name)] = energy.get(reader(name), 0) + t.to(torch.bfloat16).float().square().sum(0)

    def layer(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        w = weight.float()
        n, k = w.shape
        order = torch.argsort(energy[reader(name)], descending=True, stable=True) if act_order else torch.arange(k)
        g = torch.empty(k, dtype=torch.int64)
        g[order] = torch.arange(k) // group_size
        top = w[:, order].view(n, k // group_size, group_size).abs().amax(2)  # group i: inputs order[i·size ...]
        s = (2 * top / 15).to(torch.float16)
        q = (torch.round(w / torch.where(s > 0, s.float(), 1.0)[:, g]) + 8).clamp(0, 15).to(torch.int64)
        base = name.removesuffix(".weight")
        return {f"{base}.qweight": compressed_tensors.pack_int32(q.t().contiguous().view(k // 8, 8, n).transpose(1, 2)),
                f"{base}.qzeros": compressed_tensors.pack_int32(torch.full((k // group_size, n // 8, 8), 7)),
                f"{base}.scales": s.t().contiguous(), f"{base}.g_idx": g.to(torch.int32)}

    return compressed_tensors.write_quantized(src, out, {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                                         "desc_act": act_order, "sym": True,
                                                         "checkpoint_format": "gptq"}, layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a float Hugging Face directory (default: the built-in model)")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--format", choices=["compressed-tensors", "gptq-act-order"], default="compressed-tensors")
    parser.add_argument("--baseline-rev", default=None, help="with gptq-act-order: also serve the act-order "
                        "checkpoint from this git revision's tree")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds of the settings (medians)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=8192, help="random prompts' token ids lie below this")
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    prompts = load_humaneval_prompts()[:args.num_prompts]
    if args.measure:
        model, quantization = args.measure
        print(json.dumps(measure(Path(model), None if quantization == "none" else quantization, args, prompts)))
        return
    src = resolve_model_dir(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        if args.format == "gptq-act-order":
            ckpt = write_gptq(src, Path(tmp) / "act-order", args.group_size, act_order=True)
            settings = {"float": (src, None), "act-order": (ckpt, None),
                        "act-order+w4a8_int4": (ckpt, "w4a8_int4"),
                        "gptq-in-order": (write_gptq(src, Path(tmp) / "in-order", args.group_size, False), None)}
            if args.baseline_rev:
                (Path(tmp) / "baseline").mkdir()
                tree = export(args.baseline_rev, Path(tmp) / "baseline")
                settings[f"act-order@{args.baseline_rev}"] = (ckpt, None, tree)
        else:
            ckpt = write_w4a16(src, Path(tmp) / "w4a16", group_size=args.group_size)
            settings = {"float": (src, None), "w4a16": (ckpt, None), "w4a16+w4a8_int4": (ckpt, "w4a8_int4"),
                        "w4a16+w8a8_int8": (ckpt, "w8a8_int8"), "float+w4a8_int4": (src, "w4a8_int4"),
                        "float+w4a16_int4": (src, "w4a16_int4")}
        print(f"wrote the {args.format} checkpoint (groups of {args.group_size}) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        results = run_settings(settings, _measure_args(args), args.rounds)
    print_table(results, args.batch_size)


def run_settings(settings: dict[str, tuple], argv: list[str], rounds: int = 1) -> dict[str, dict]:
    """Each setting's ``measure`` (a model, its ``--quantization`` and optionally the tree to run) in its own
    process, printed as it comes; over ``rounds`` alternated rounds, the medians of the times."""
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for round_ in range(rounds):
        for name, setting in (list(settings.items()) if round_ % 2 == 0 else list(settings.items())[::-1]):
            runs[name].append(in_own_process(*setting[:2], argv, *setting[2:]))
            print(f"{name}: {runs[name][-1]}", flush=True)
    return {name: {**r[0], "load_s": statistics.median(x["load_s"] for x in r),
                   "ms_per_token": {b: statistics.median(x["ms_per_token"][b] for x in r)
                                    for b in r[0]["ms_per_token"]}}
            for name, r in runs.items()}


def _measure_args(args: argparse.Namespace) -> list[str]:
    """The arguments a setting's process measures with."""
    return ["--batch-size", *map(str, args.batch_size), "--input-len", str(args.input_len), "--output-len",
            str(args.output_len), "--num-iters", str(args.num_iters), "--num-prompts", str(args.num_prompts),
            "--vocab-size", str(args.vocab_size)]


def print_table(results: dict[str, dict], batch_sizes: list[int]) -> None:
    """The settings side by side, each ratio against the first setting's."""
    base = next(iter(results.values()))
    width = max(len(name) for name in results)
    header = " ".join(f"{'b=' + str(b) + ' ms/tok':>14}" for b in batch_sizes)
    print(f"\n{'setting':>{width}} {'format':>10} {'load s':>7} {header} {'perplexity':>11}")
    for name, r in results.items():
        per_token = {int(b): v for b, v in r["ms_per_token"].items()}
        cells = " ".join(f"{per_token[b]:>6.2f} ({per_token[b] / base['ms_per_token'][str(b)]:.2f}×)"
                         for b in batch_sizes)
        quality = f"{r['perplexity']:>7.4f} ({r['perplexity'] / base['perplexity'] - 1:+.2%})" \
            if r["perplexity"] is not None else "-"
        print(f"{name:>{width}} {r['format']:>10} {r['load_s']:>7.2f} {cells} {quality}")


if __name__ == "__main__":
    main()
