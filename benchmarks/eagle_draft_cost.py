"""EAGLE drafting cost per step: milliseconds in ``EagleProposer.propose`` for chain, static and dynamic trees,
with the head's draft vocabulary and with the full vocabulary, at batch 1 and 8, against one target decode
step (batch 1, one token) measured in the same run. Windows are the head's full window of true pairs (the
steady state); one new accepted row per request per step. Usage:

    .venv/bin/python benchmarks/eagle_draft_cost.py [--eagle FILE] [--dtype bfloat16] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from pagellm.spec.base import ProposalRequest
from pagellm.spec.eagle import EagleProposer

SHAPES = {
    "chain k=4": {"num_speculative_tokens": 4},
    "tree [3,2,1,1]": {"num_speculative_tokens": 4, "tree": [3, 2, 1, 1]},
    "dynamic 5/4/12": {"num_speculative_tokens": 5, "eagle_topk": 4, "num_draft_tokens": 12},
}


def decode_step_ms(llm: LLM, repeats: int) -> float:
    """One target decode step at batch 1: (64 tokens - 1 token) / 63, prefill excluded."""
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    best = float("inf")
    for _ in range(max(repeats // 10, 2)):
        start = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], params(1), use_tqdm=False)
        one = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([[1, 2, 3, 4]], params(64), use_tqdm=False)
        best = min(best, (time.perf_counter() - start - one) / 63)
    return 1000 * best


def propose_ms(proposer: EagleProposer, hidden_size: int, batch: int, repeats: int, dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    WINDOW = proposer.head.window  # noqa: N806
    tokens = [torch.randint(0, 2000, (WINDOW + repeats + 2,), generator=gen).tolist() for _ in range(batch)]
    hidden = torch.randn(WINDOW + repeats + 2, hidden_size, generator=gen).to(dtype)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    asks = [ProposalRequest(f"r{b}", tokens[b][:WINDOW + 1], params, 0, 64, hidden[:WINDOW]) for b in range(batch)]
    proposer.propose(asks)  # fill the windows
    times = []
    for step in range(repeats):
        n = WINDOW + 2 + step
        asks = [ProposalRequest(f"r{b}", tokens[b][:n], params, 0, 64, hidden[n - 2:n - 1]) for b in range(batch)]
        start = time.perf_counter()
        proposer.propose(asks)
        times.append(time.perf_counter() - start)
    proposer.release([f"r{b}" for b in range(batch)])
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eagle", default=None, help="head file (default: the shipped one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    step = decode_step_ms(llm, args.repeats)
    target = llm.engine.core.executor.worker.runner.model
    dtype = next(target.parameters()).dtype
    print(f"target decode step, batch 1: {step:.1f} ms")
    print(f"{'shape':<16}{'vocab':>7}{'batch':>6}{'propose ms':>12}{'x decode step':>15}")
    for name, shape in SHAPES.items():
        for vocab in (None, 0):
            config = SpeculativeConfig(method="eagle", model=args.eagle, draft_vocab_size=vocab, **shape)
            proposer = EagleProposer.from_config(config, target, dtype)
            width = len(proposer.vocab_rows) if proposer.vocab_rows is not None else proposer.vocab
            for batch in (1, 8):
                ms = propose_ms(proposer, target.cfg.hidden_size, batch, args.repeats, dtype)
                print(f"{name:<16}{width:>7}{batch:>6}{ms:>12.2f}{ms / step:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
