"""Predicted outputs (OpenAI's ``prediction``): the same requests with and without a prediction, on one engine with
n-gram speculation, greedy, in two cases: an edit (the text to repeat is in the prompt too) and a regeneration (the
prediction is an earlier reply to the same question, which the prompt does not hold). Prints output tokens/s and
steps of each, the share of drafted tokens accepted, and how many outputs are identical (in float32 all are; in
bfloat16 a near tie can flip where the verified batch's shape differs, as with any speculation).

    .venv/bin/python benchmarks/predicted_outputs.py [--model PATH] [--num-requests 8] [--output-len 128] [--dtype auto]
"""

from __future__ import annotations

import argparse
import time

TEXT = ("The quick brown fox jumps over the lazy dog. It was a sunny day in the small village, and the children "
        "played by the river while their parents worked in the fields. In the evening, everyone gathered in the "
        "square to share stories, eat bread and cheese, and watch the sun go down behind the hills.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from pagellm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 8,
                                              "disable_by_batch_size": None})
    words = ["fox", "dog", "river", "bread", "hills", "village", "children", "square"] * (args.num_requests // 8 + 1)
    words = words[:args.num_requests]
    chats = [[{"role": "user", "content": f"Repeat this text exactly, but replace the word '{w}' with 'cat':\n\n"
                                          f"{TEXT}"}] for w in words]
    llm.chat(chats[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len)
    # An edit: the text is in the prompt too (prompt lookup drafts from it without a prediction).
    edit = [llm.tokenizer.encode(TEXT, add_special_tokens=False)] * len(chats)
    # A regeneration: the prompt does not hold the reply; the prediction is an earlier reply to the same question.
    questions = [[{"role": "user", "content": f"Tell me a story about {w}."}] for w in words]
    earlier = [o.outputs[0].token_ids for o in llm.chat(questions, greedy, use_tqdm=False)]
    for case, prompts, predictions in (("edit", chats, edit), ("regenerate", questions, earlier)):
        results = {}
        for name, predicted in (("without", [None] * len(prompts)), ("with", predictions)):
            params = [SamplingParams(temperature=0, max_tokens=args.output_len, prediction_token_ids=p)
                      for p in predicted]
            start = time.perf_counter()
            outputs = llm.chat(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            drafts = [s.spec_decoding for s in llm.last_stats if s.spec_decoding is not None]
            drafted, accepted = sum(d.num_draft_tokens for d in drafts), sum(d.num_accepted_tokens for d in drafts)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            results[name] = [o.outputs[0].token_ids for o in outputs]
            print(f"{case:10s} {name:8s} prediction: {tokens / seconds:7.1f} out tok/s, {len(llm.last_stats):4d} "
                  f"steps, {accepted}/{drafted} drafted tokens accepted")
        _compare(results)


def _compare(results: dict[str, list[list[int]]]) -> None:
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
              for x, y in zip(results["with"], results["without"])]
    same = sum(f is None for f in firsts)
    print(f"identical outputs: {same}/{len(firsts)}; first differing token of the others: "
          f"{[f for f in firsts if f is not None]}")


if __name__ == "__main__":
    main()
