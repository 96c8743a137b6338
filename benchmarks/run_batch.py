"""``pagellm run-batch`` against the offline ``LLM.chat`` on the same chat requests, each end to end in a fresh
process (engine start included, as a user runs them). Prints the wall time and output tokens/s of each and their
ratio: what answering a Batch API file through the server's handlers costs over the in-process API.

    .venv/bin/python benchmarks/run_batch.py [--model PATH] [--num-requests 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OFFLINE = """
import json, sys
from pagellm import LLM, SamplingParams
lines = [json.loads(l) for l in open(sys.argv[1])]
llm = LLM(sys.argv[2] if len(sys.argv) > 2 else None)
params = [SamplingParams(max_tokens=l["body"]["max_tokens"], temperature=0, ignore_eos=True) for l in lines]
outs = llm.chat([l["body"]["messages"] for l in lines], params, use_tqdm=False)
print(sum(len(o.outputs[0].token_ids) for o in outs))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    topics = ["the sea", "a city at night", "winter", "an old library", "a train journey", "bees", "rain", "maps"]
    with open(folder / "in.jsonl", "w") as out:
        for i in range(args.num_requests):
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Write a short poem about {topics[i % 8]} (#{i})."}]}
            out.write(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")
    model = [args.model] if args.model else []
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pagellm.cli", "run-batch", "-i", str(folder / "in.jsonl"), "-o",
                    str(folder / "out.jsonl"), *model, "--served-model-name", "SmolLM2-135M-Instruct"],
                   check=True, capture_output=True)
    batch_s = time.perf_counter() - start
    answers = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    batch_tokens = sum(a["response"]["body"]["usage"]["completion_tokens"] for a in answers)
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", OFFLINE, str(folder / "in.jsonl"), *model], check=True,
                         capture_output=True, text=True)
    offline_s = time.perf_counter() - start
    offline_tokens = int(run.stdout.split()[-1])
    print(f"run-batch  {batch_s:6.1f} s  {batch_tokens / batch_s:7.1f} out tok/s ({batch_tokens} tokens)")
    print(f"LLM.chat   {offline_s:6.1f} s  {offline_tokens / offline_s:7.1f} out tok/s ({offline_tokens} tokens)")
    print(f"run-batch / LLM.chat throughput: {batch_tokens / batch_s / (offline_tokens / offline_s):.2f}x")


if __name__ == "__main__":
    main()
