"""Structured outputs (xgrammar) on a tiny random model: whatever the weights, the grammar mask must force output
that parses and validates. A suite of JSON schemas, regexes, choices and an EBNF grammar, in one mixed batch
with unconstrained requests, under n > 1, preemption and prefix-cache hits; one compile per distinct schema."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
     "required": ["score"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": -5, "maximum": 5}, {"type": "integer", "minimum": -5, "maximum": 5}],
        "items": False}}, "required": ["point"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"type": "integer", "enum": [1, 2, 3]},
                                      "msg": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
     "required": ["kind", "level", "msg"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 3},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "string", "maxLength": 3}]},
]
REGEXES = [r"\d{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)", r"#[0-9a-f]{6}"]
CHOICES = [["alpha", "beta", "gamma"], ["true", "false"]]
GRAMMAR = 'root ::= expr\nexpr ::= term ("+" term)?\nterm ::= [1-9] | "(" expr ")"'
GRAMMAR_RE = re.compile(r"^[1-9()+]+$")
MAX_TOKENS = 200


def _params(so: StructuredOutputsParams, seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS, "structured_outputs": so,
                             **kw})


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=512, kv_cache_memory=16_000_000)


def test_schema_suite_regexes_choices_and_grammar_in_one_mixed_batch(llm: LLM) -> None:
    params = [_params(StructuredOutputsParams(json=s), seed=i) for i, s in enumerate(SCHEMAS)]
    params += [_params(StructuredOutputsParams(regex=r), seed=100 + i) for i, r in enumerate(REGEXES)]
    params += [_params(StructuredOutputsParams(choice=c), seed=200 + i) for i, c in enumerate(CHOICES)]
    params += [_params(StructuredOutputsParams(grammar=GRAMMAR), seed=300),
               _params(StructuredOutputsParams(json_object=True), seed=301)]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params.insert(3, free)  # an unconstrained request in the middle of the batch pays nothing and is unchanged
    prompts = [f"Answer {i}:" for i in range(len(params))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    unconstrained = outs.pop(3)
    alone = llm.generate([prompts[3]], free, use_tqdm=False)[0].outputs[0]
    assert unconstrained.token_ids == alone.token_ids
    for out in outs:
        assert out.finish_reason == "stop", out.text
    for out, schema in zip(outs, SCHEMAS):
        _check_json(out.text, schema)
    outs = outs[len(SCHEMAS):]
    for out, regex in zip(outs, REGEXES):
        assert re.fullmatch(regex, out.text), (regex, out.text)
    outs = outs[len(REGEXES):]
    for out, choice in zip(outs, CHOICES):
        assert out.text in choice
    assert GRAMMAR_RE.match(outs[-2].text) and outs[-2].text.count("(") == outs[-2].text.count(")")
    assert isinstance(json.loads(outs[-1].text), dict)
    grammars = llm.engine.core.executor.worker.runner.processing._grammars
    assert grammars is not None
    compiled = grammars.num_compiled
    llm.generate(prompts[:3], [_params(StructuredOutputsParams(json=s), seed=9) for s in SCHEMAS[:3]],
                 use_tqdm=False)
    assert grammars.num_compiled == compiled  # the same schemas again: no new compile


def test_n_siblings_preemption_and_prefix_hits_stay_valid(tiny_llama: Path) -> None:
    # A KV pool this small (about 12 blocks of 16 tokens) makes 6 requests preempt each other.
    small = LLM(str(tiny_llama), dtype="float32", max_model_len=192, kv_cache_memory=100_000, max_num_seqs=6)
    schema = SCHEMAS[10]
    so = StructuredOutputsParams(json=schema)
    prompt = "A shared prompt that fills a few KV blocks with text! " + "x" * 6
    outs = small.generate([prompt] * 3, [_params(so, seed=s, n=2, max_tokens=120) for s in (1, 2, 3)],
                          use_tqdm=False)
    assert sum(s.num_preemptions for s in small.last_stats) > 0
    for out in outs:
        assert len(out.outputs) == 2
        for completion in out.outputs:
            _check_json(completion.text, schema)
    again = small.generate([prompt], _params(so, seed=1, n=2, max_tokens=120), use_tqdm=False)[0]  # prefix hit
    assert again.num_cached_tokens > 0
    assert [c.text for c in again.outputs] == [c.text for c in outs[0].outputs]


def test_greedy_constrained_is_deterministic_and_bans_still_apply(llm: LLM) -> None:
    so = StructuredOutputsParams(choice=["cat", "dog", "cow"])
    (d,) = llm.tokenizer.encode("d", add_special_tokens=False)
    first = llm.generate(["Pick:"], SamplingParams(temperature=0, structured_outputs=so, max_tokens=10,
                                                    logit_bias={d: -100.0}), use_tqdm=False)
    text = first[0].outputs[0].text
    assert text in ("cat", "cow")  # the bias removes "dog"'s first byte; the grammar still completes a choice


def test_grammar_end_with_ignore_eos_or_min_tokens(llm: LLM) -> None:
    so = StructuredOutputsParams(choice=["yes", "no"])
    kept = llm.generate(["Q:"], SamplingParams(temperature=0, structured_outputs=so, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = len(kept.text)
    assert kept.text in ("yes", "no") and kept.token_ids[words:] == [257] * (8 - words)  # only EOS after the end
    early = llm.generate(["Q:"], SamplingParams(temperature=0, structured_outputs=so, max_tokens=8, min_tokens=6),
                         use_tqdm=False)[0].outputs[0]
    assert early.text == kept.text and early.finish_reason == "stop"  # the grammar, not min_tokens, ends it


def test_constraints_that_leave_no_token_end_the_request(llm: LLM) -> None:
    """A grammar and an ``allowed_token_ids`` (or bad words) that share no token leave nothing to sample: the request
    ends with its EOS rather than taking some token outside every constraint (greedy took token 0, to max_tokens)."""
    so = StructuredOutputsParams(choice=["yes", "no"])
    x, z = llm.tokenizer.encode("qz", add_special_tokens=False)  # neither begins "yes" or "no"
    cases = [SamplingParams(temperature=0, structured_outputs=so, max_tokens=8, allowed_token_ids=[x, z]),
             SamplingParams(temperature=1.0, seed=3, structured_outputs=so, max_tokens=8, allowed_token_ids=[x, z]),
             SamplingParams(temperature=0, structured_outputs=so, max_tokens=8, bad_words=["y", "n"])]
    for out in llm.generate(["Q:"] * 3, cases, use_tqdm=False):
        assert out.outputs[0].token_ids == [257] and out.outputs[0].finish_reason == "stop"
    partly = llm.generate(["Q:"], SamplingParams(temperature=0, structured_outputs=so, max_tokens=8,
                                                 allowed_token_ids=[x, *llm.tokenizer.encode("yes", False)]),
                          use_tqdm=False)[0].outputs[0]
    assert partly.text == "yes" and partly.finish_reason == "stop"  # what the two share is still followed
    kv = llm.engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_a_constraint_waits_for_its_begin_after_tokens(llm: LLM) -> None:
    """A reasoning model's constraint starts after ``</think>``: here the bias makes the model write "ok" first (the
    bad word stops a second "o"), and the digits the regex asks for follow it; without ``begin_after`` the same
    request is all digits."""
    o, k = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ok")
    free_first = dict(temperature=0, max_tokens=12, logit_bias={o: 60.0, k: 50.0}, bad_words=["oo"])
    waits = StructuredOutputsParams(regex="[0-9]{4}", begin_after=[o, k])
    text = llm.generate(["Q:"], SamplingParams(structured_outputs=waits, **free_first), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("ok[0-9]{4}", text.text) and text.finish_reason == "stop"
    at_once = StructuredOutputsParams(regex="[0-9]{4}")
    text = llm.generate(["Q:"], SamplingParams(structured_outputs=at_once, **free_first), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", text.text)


def test_a_waiting_grammar_allows_all_until_the_marker_even_across_steps_and_replays(tiny_llama: Path) -> None:
    from pagellm.sample.structured import GrammarCache

    from pagellm.tokenizer import Tokenizer

    cache = GrammarCache.from_model_dir(tiny_llama, 320)
    ids = Tokenizer.from_dir(tiny_llama).encode
    o, k, seven, a = (ids(c, add_special_tokens=False)[0] for c in "ok7a")
    so = StructuredOutputsParams(regex="[0-9]{3}", begin_after=[o, k])

    def allowed(grammar) -> set[int]:
        mask = cache.allocate_bitmask(1)
        mask.zero_()
        grammar.fill(mask, 0)
        return {t for t in (o, k, seven, a) if int(mask[0, t // 32]) >> (t % 32) & 1}

    grammar = cache.matcher(so, [])
    assert not grammar.constraining and allowed(grammar) == {o, k, seven, a}
    grammar.accept([a, o])  # the marker's first token ends this step ...
    assert not grammar.constraining and allowed(grammar) == {o, k, seven, a}
    grammar.accept([k, seven])  # ... and its last begins the next: the tokens after it follow the regex
    assert grammar.constraining and allowed(grammar) == {seven}
    replayed = cache.matcher(so, [a, o, k, seven])  # a request rebuilt after preemption
    assert replayed.constraining and allowed(replayed) == {seven}
    grammar.accept([seven, seven])  # the regex is complete: only EOS (257) may follow, and it ends the grammar
    assert allowed(grammar) == set() and not grammar.is_terminated
    grammar.accept([257])
    assert grammar.is_terminated and not cache.matcher(so, [seven, seven, seven, 257]).is_terminated


STRUCTURAL_TAG = {"structures": [{"begin": "<f>", "end": "</f>", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}],
    "triggers": ["<f>"]}


def test_a_structural_tag_constrains_only_between_its_tags(tiny_llama: Path) -> None:
    """vLLM's ``structural_tag``: free text until a trigger, then the structure's begin, a JSON value of its schema
    and its end, then free text again; xgrammar's own format too; a malformed tag is refused by name."""
    import xgrammar as xgr

    from pagellm.sample.structured import GrammarCache, validate
    from pagellm.tokenizer import Tokenizer

    cache = GrammarCache.from_model_dir(tiny_llama, 320)
    encode = Tokenizer.from_dir(tiny_llama).encode

    def accepts(so: StructuredOutputsParams, text: str) -> bool:
        matcher = xgr.GrammarMatcher(cache.compile(so))
        return all(matcher.accept_token(t) for t in encode(text, add_special_tokens=False))

    vllm_form = StructuredOutputsParams(structural_tag=STRUCTURAL_TAG)
    assert accepts(vllm_form, 'Sure: <f>{"a": 12}</f> and more text')
    assert not accepts(vllm_form, 'Sure: <f>{"b": 12}</f>') and not accepts(vllm_form, '<f>{"a": "x"}</f>')
    own = StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f>"], "tags": [{"type": "tag", "begin": "<f>", "end": "</f>",
                                                                  "content": {"type": "json_schema", "json_schema": {
                                                                      "type": "integer"}}}]}})
    assert accepts(own, "x <f>42</f> y") and not accepts(own, "x <f>4.5</f>")
    with pytest.raises(ValueError, match="structural_tag"):
        validate(StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}))
    with pytest.raises(ValueError, match="structural_tag is not valid JSON"):
        validate(StructuredOutputsParams(structural_tag="{nope"))
