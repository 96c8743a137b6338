"""benchmarks/report.py's target table over several rounds of benchmarks/compare.py: each ratio is taken between
pagellm and the peer of the same round (the machine drifts between rounds), and the verdict is on their median."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import report  # noqa: E402


def _record(system: str, round_: int, tok_s: float, ttft_p95: float, tpot_p95: float, conc: int = 32,
            tpot_p50: float = 1.0) -> dict:
    metrics = {"output_throughput": tok_s, "p95_ttft_ms": ttft_p95, "p95_tpot_ms": tpot_p95,
               "median_tpot_ms": tpot_p50}
    return {"system": system, "round": round_, "runs": [{"max_concurrency": conc, "metrics": metrics}]}


def _row(rows: list[str], what: str) -> list[str]:
    return [cell.strip() for cell in next(r for r in rows if what in r).strip("|").split("|")]


def test_each_round_pairs_with_its_own_peer_and_the_verdict_is_on_the_median_ratio():
    served = [_record("pagellm", 1, 500, 2000, 55), _record("vLLM", 1, 400, 2000, 70),   # 1.25x, 0.79x
              _record("pagellm", 2, 480, 2000, 50), _record("vLLM", 2, 300, 2000, 90),   # 1.60x, 0.56x
              _record("pagellm", 3, 520, 2000, 52), _record("vLLM", 3, 330, 2000, 76)]   # 1.58x, 0.68x
    rows = report._target_rows(served, {}, 32)
    output = _row(rows, "c=32 output")
    assert output[3].startswith("1.58×") and "rounds: 1.25, 1.60, 1.58" in output[3] and output[4] == "yes"
    assert output[1:3] == ["500.0", "330.0"]  # the medians of each system's rounds
    tpot = _row(rows, "TPOT p95")
    assert tpot[3].startswith("0.68×") and tpot[4] == "yes"
    assert _row(rows, "TTFT p95")[4] == "NO"  # 1.00x against a 0.5x goal
    assert _row(rows, "offline")[4] == "not measured" and _row(rows, "c=1 TPOT")[4] == "not measured"


def test_a_round_without_the_peer_is_left_out_of_the_ratios():
    served = [_record("pagellm", 1, 500, 2000, 55), _record("vLLM", 1, 400, 2000, 70),
              _record("pagellm", 2, 900, 2000, 10)]  # the peer failed in round 2: no ratio from that round
    output = _row(report._target_rows(served, {}, 32), "c=32 output")
    assert output[3] == "1.25×" and output[4] == "NO"


def test_a_single_round_reads_as_before():
    served = [_record("pagellm", 1, 600, 1000, 49), _record("vLLM", 1, 400, 2500, 70)]
    rows = report._target_rows(served, {"pagellm": {"output_throughput": 900.0},
                                        "vLLM": {"output_throughput": 450.0}}, 32)
    assert _row(rows, "offline") == ["offline output tok/s ≥ 2× vLLM", "900.0", "450.0", "2.00×", "yes"]
    assert _row(rows, "output tok/s ≥ 1.5") == ["c=32 output tok/s ≥ 1.5× vLLM", "600.0", "400.0", "1.50×", "yes"]
    assert _row(rows, "TTFT p95")[3:] == ["0.40×", "yes"]
    assert not any("median of the rounds" in r for r in rows)


def test_a_sweep_without_concurrency_32_leaves_the_vllm_serving_targets_unmeasured():
    served = [_record("pagellm", 1, 100, 90, 10, conc=1, tpot_p50=8.0), _record("vLLM", 1, 60, 200, 20, conc=1),
              _record("llama.cpp (bf16)", 1, 80, 150, 12, conc=1, tpot_p50=11.0)]
    rows = report._target_rows(served, {})
    for what in ("c=32 output", "c=32 TTFT p95", "c=32 TPOT p95"):  # a c=1 ratio is not the c=32 target's
        assert _row(rows, what)[1:] == ["n/a", "n/a", "–", "not measured"]
    assert not any("c=1 output" in r for r in rows)
    assert _row(rows, "c=1 TPOT p50 ≤ llama.cpp (bf16)")[1:] == ["8.0", "11.0", "0.73×", "yes"]


def test_offline_rounds_pair_within_a_round_and_a_failed_round_is_left_out():
    offline = {"pagellm": {"output_throughput": 570.0, "rounds": [560.0, 580.0, 900.0]},
               "vLLM": {"output_throughput": 455.0, "rounds": [460.0, 290.0, None]}}  # vLLM failed in round 3
    row = _row(report._target_rows([], offline, 32), "offline")
    assert row[3] == "1.61× (rounds: 1.22, 2.00)" and row[4] == "NO"  # median of 1.22 and 2.00
    assert row[1:3] == ["570.0", "375.0"]  # medians of the paired rounds only


def test_an_offline_only_report_says_serving_was_not_run_and_lists_each_round(tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(offline_num_prompts=256, input_len=128, output_len=128, concurrency=[32], notes="")
    ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype="auto")
    offline = {"pagellm": {"command": "pagellm bench throughput", "env": {"PAGELLM_NUM_THREADS": "2"},
                           "rounds": [551.0, 540.1, None], "output_throughput": 545.55, "error": "exit code 1"},
               "vLLM": {"command": "vllm bench throughput", "env": {}, "rounds": [415.2, 429.3, 440.0],
                        "output_throughput": 429.3}}
    md = report.write_report(tmp_path / "r.md", tmp_path / "r", args, ctx, [], offline, {}, command="compare.py")
    text = md.read_text()
    assert "Not run in this invocation (`--offline-only`)." in text
    assert "command and environment columns are each system's flags" in text  # the flags section is not empty
    assert "| pagellm | 545.5 (rounds: 551.0, 540.1, failed) |" in text and "`PAGELLM_NUM_THREADS=2` |" in text
    assert "| offline output tok/s ≥ 2× vLLM | 545.5 | 422.2 | 1.29× (rounds: 1.33, 1.26) | NO |" in text
    assert (tmp_path / "r" / "offline.png").exists()


def test_a_report_names_a_float8_kv_cache_both_systems_had(tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(offline_num_prompts=256, input_len=128, output_len=128, concurrency=[32], notes="")
    offline = {"pagellm": {"command": "pagellm bench throughput", "env": {}, "rounds": [560.0],
                           "output_throughput": 560.0}}
    headers = {}
    for kv in ("auto", "fp8"):
        ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype=kv)
        md = report.write_report(tmp_path / f"{kv}.md", tmp_path / kv, args, ctx, [], offline, {}, command="x")
        headers[kv] = next(line for line in md.read_text().splitlines() if line.startswith("Machine:"))
    assert "dtype bfloat16, 2 threads" in headers["auto"] and "KV cache" not in headers["auto"]
    assert "dtype bfloat16, KV cache fp8, 2 threads" in headers["fp8"]


def test_a_serving_only_report_says_offline_was_not_run_instead_of_an_empty_table(tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(offline_num_prompts=0, input_len=128, output_len=128, concurrency=[32], notes="")
    ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype="auto")
    served = [{"system": "pagellm", "round": 1, "runs": [], "error": "exited with code 1", "note": "serve --x"}]
    text = report.write_report(tmp_path / "r.md", tmp_path / "r", args, ctx, served, {}, {}, command="c").read_text()
    offline_section = text.split("## Offline throughput")[1].split("## Targets")[0]
    assert "Not run in this invocation (`--offline-num-prompts 0`)." in offline_section
    assert "| system | output tok/s |" not in offline_section
    assert "| pagellm | – | – | failed: exited with code 1 |" in text and "- **pagellm**: serve --x" in text


def test_another_workload_shows_its_ratios_without_a_verdict():
    served = [_record("pagellm", 1, 600, 1000, 49), _record("vLLM", 1, 300, 2500, 90)]
    rows = report._target_rows(served, {}, 32, other_workload="input len 1024")
    assert _row(rows, "c=32 output") == ["c=32 output tok/s ≥ 1.5× vLLM", "600.0", "300.0", "2.00×",
                                         "n/a (other workload)"]
    assert _row(rows, "TPOT p95")[4] == "n/a (other workload)" and _row(rows, "offline")[4] == "not measured"
    assert any("differs (input len 1024)" in r for r in rows)


def test_a_report_on_another_workload_gives_no_verdict(tmp_path):
    args = SimpleNamespace(offline_num_prompts=64, input_len=1024, output_len=128, concurrency=[32], notes="")
    ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype="auto")
    offline = {"pagellm": {"output_throughput": 112.0, "command": "a"},
               "vLLM": {"output_throughput": 85.8, "command": "b"}}
    text = report.write_report(tmp_path / "r.md", tmp_path / "r", args, ctx, [], offline, {}, command="c").read_text()
    targets = text.split("## Targets (issue 4)")[1].split("## Flags")[0]
    assert "| offline output tok/s ≥ 2× vLLM | 112.0 | 85.8 | 1.31× | n/a (other workload) |" in targets
    assert "| yes |" not in targets and "| NO |" not in targets


def test_the_targets_workload_gets_a_verdict_and_a_float32_run_does_not():
    same = SimpleNamespace(input_len=128, output_len=128)
    assert report._other_workload(same, SimpleNamespace(dtype="bfloat16")) is None
    assert report._other_workload(same, SimpleNamespace(dtype="float32")) == "dtype float32"


def test_a_settled_run_says_each_server_idled_before_its_load(tmp_path):
    ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype="auto")
    served = [{"system": "pagellm", "round": 1, "runs": [], "error": "exited with code 1", "note": "serve"}]
    for settle, said in ((15.0, True), (0.0, False)):
        args = SimpleNamespace(offline_num_prompts=0, input_len=128, output_len=128, concurrency=[32], notes="",
                               settle=settle)
        text = report.write_report(tmp_path / "r.md", tmp_path / "r", args, ctx, served, {}, {}, "c").read_text()
        assert ("Every server idled 15 s after it was ready before its load" in text) == said


def test_a_report_on_a_dataset_names_it_and_says_why_offline_did_not_run(tmp_path):
    args = SimpleNamespace(offline_num_prompts=0, input_len=128, output_len=128, concurrency=[32], notes="",
                           dataset="sharegpt", dataset_path="/data/sharegpt.json")
    ctx = SimpleNamespace(model_dir=tmp_path / "model", dtype="bfloat16", threads=2, kv_cache_dtype="auto")
    text = report.write_report(tmp_path / "r.md", tmp_path / "r", args, ctx, [], {}, {}, command="c").read_text()
    assert "ShareGPT conversations in `/data/sharegpt.json`" in text
    assert "the offline runs take random prompts only, and this run serves `--dataset sharegpt`" in text
    other = report._other_workload(args, ctx)
    assert other == "the sharegpt dataset"  # its lengths are its own: --input-len 128 says nothing
    served = [_record("pagellm", 1, 600, 1000, 49), _record("vLLM", 1, 300, 2500, 90)]
    rows = report._target_rows(served, {}, 32, other_workload=other)
    assert _row(rows, "c=32 output")[3:] == ["2.00×", "n/a (other workload)"]
    assert report._other_workload(args, SimpleNamespace(dtype="float32")) == "the sharegpt dataset, dtype float32"


def _compare_args(monkeypatch: pytest.MonkeyPatch, *argv: str):
    import compare

    monkeypatch.setattr(sys, "argv", ["compare.py", *argv])
    return compare, compare.parse_args()


def test_machine_is_a_name_not_a_path(monkeypatch, capsys) -> None:
    for machine in ("/tmp/check", "../up", ""):
        with pytest.raises(SystemExit):
            _compare_args(monkeypatch, "--machine", machine)
        assert "give a name, not a path" in capsys.readouterr().err
    assert _compare_args(monkeypatch, "--machine", "vm-2threads")[1].machine == "vm-2threads"


def test_compare_serves_the_dataset_to_every_system_and_sizes_llama_cpp_for_it(tmp_path, tiny_llama, monkeypatch):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt": [101, 102, 103, 104, 105], "max_tokens": 7}\n'
                    '{"prompt": "Hello there, how are you today?", "max_tokens": 3}\n'
                    '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}\n')
    compare, args = _compare_args(monkeypatch, "--dataset", "custom", "--dataset-path", str(path),
                                  "--concurrency", "1", "4", "--num-prompts", "3")
    assert args.offline_num_prompts == 0  # offline takes random prompts only
    system = compare.systems.System("pagellm", [])
    ctx = compare.systems.Context(tiny_llama, tiny_llama)
    load = compare.serve_args("http://127.0.0.1:1", args, 4, 3, 0, system, ctx)
    assert (load.dataset, load.dataset_path, load.num_prompts, load.max_concurrency) == ("custom", str(path), 3, [4])
    tokenizer = compare._tokenizer(tiny_llama)
    text = len(tokenizer.encode("Hello there, how are you today?")) + 3
    chat = len(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)) + 2
    assert compare.context_per_stream(args, tiny_llama) == max(5 + 7, text, chat) + 64
    _, random_args = _compare_args(monkeypatch, "--input-len", "100", "--output-len", "20")
    assert compare.context_per_stream(random_args, tiny_llama) == 184 and random_args.offline_num_prompts == 256


def test_compare_gives_vllm_the_context_of_the_sweeps_longest_request(tmp_path):
    """A chat sweep's longest history can pass vLLM's usual 2,048 tokens: vLLM is then given the sweep's context, so
    it serves the requests pagellm serves instead of answering them 400 (and being timed on fewer)."""
    from peers import systems

    for per_stream, expected in ((320, "2048"), (4673, "4673")):
        argv = systems.vllm(systems.Context(tmp_path, tmp_path / "m.gguf", context_per_stream=per_stream), 8000).argv
        assert argv[argv.index("--max-model-len") + 1] == expected


def test_compare_gives_sharegpt_runs_the_tokenizer_for_the_replies_lengths(tmp_path, tiny_llama, monkeypatch):
    compare, args = _compare_args(monkeypatch, "--dataset", "sharegpt", "--dataset-path", str(tmp_path / "s.json"))
    load = compare.serve_args("http://127.0.0.1:1", args, 32, 200, 0, compare.systems.System("vLLM", []),
                              compare.systems.Context(tiny_llama, tiny_llama))
    assert load.tokenizer == str(tiny_llama)
    with pytest.raises(ValueError, match="cannot read the sharegpt dataset"):
        compare.context_per_stream(args, tiny_llama)


def test_compare_gives_a_float8_cache_to_pagellm_and_vllm_and_skips_the_others(tmp_path):
    """``compare.py --kv-cache-dtype fp8``: the same flag for the two systems that have the format; llama.cpp (q8_0
    caches, another format) and the transformers baseline (none) are skipped with the reason."""
    from peers import systems

    for kv in ("auto", "fp8"):
        ctx = systems.Context(tmp_path, tmp_path / "m.gguf", kv_cache_dtype=kv)
        built = {name: build(ctx, 8000) for name, build in systems.BUILDERS.items()}
        for name in ("pagellm", "vllm"):
            assert ("--kv-cache-dtype" in built[name].argv) == (kv != "auto")
            assert built[name].argv[-2:] == ["--kv-cache-dtype", "fp8"] or kv == "auto"
        assert (built["transformers"].missing_reason is None) == (kv == "auto")
        assert kv == "auto" or built["llama.cpp"].missing_reason == "no float8 KV cache (--kv-cache-dtype fp8)"


def test_compare_serves_one_w8a8_checkpoint_on_pagellm_and_vllm(tmp_path, monkeypatch):
    """``compare.py --quantization w8a8_int8``: pagellm and vLLM serve the same checkpoint folder, llama.cpp its
    Q8_0 GGUF (or is skipped saying how to make it), the transformers baseline is skipped."""
    from peers import systems

    checkpoint = tmp_path / "w8a8"
    ctx = systems.Context(checkpoint, tmp_path / "m.gguf", quantization="w8a8_int8")
    monkeypatch.setattr(systems, "PEERS", tmp_path)  # an installed llama-server, whatever this machine has
    (tmp_path / "llama.cpp" / "build" / "bin").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "build" / "bin" / "llama-server").write_bytes(b"")
    monkeypatch.setattr(systems, "Q8_GGUF", tmp_path / "q8.gguf")
    for present in (False, True):
        if present:
            (tmp_path / "q8.gguf").write_bytes(b"GGUF")
        built = {name: build(ctx, 8000) for name, build in systems.BUILDERS.items()}
        assert str(checkpoint) in built["pagellm"].argv and str(checkpoint) in built["vllm"].argv
        assert built["transformers"].missing_reason == "no W8A8 int8 compressed-tensors checkpoint " \
                                                       "(--quantization w8a8_int8)"
        llama = built["llama.cpp"]
        if present:
            assert llama.missing_reason is None and llama.name == "llama.cpp (Q8_0)"
            assert str(tmp_path / "q8.gguf") in llama.argv
        else:
            assert "q8.gguf not found (run `make peers`)" in llama.missing_reason


def test_compare_gives_pagellm_its_own_flags_served_and_offline(tmp_path, monkeypatch):
    """``--pagellm-flags``: pagellm's own engine settings ride on its server and its offline run, and the report's
    flags note names them; the peers' commands do not change."""
    compare, args = _compare_args(monkeypatch, "--pagellm-flags", "--max-num-batched-tokens 768")
    ctx = compare.systems.Context(tmp_path, tmp_path / "m.gguf", pagellm_flags=tuple(args.pagellm_flags.split()))
    plain = compare.systems.Context(tmp_path, tmp_path / "m.gguf")
    served = compare.systems.pagellm(ctx, 8000)
    assert served.argv[-2:] == ["--max-num-batched-tokens", "768"] and "--max-num-batched-tokens 768" in served.note
    assert "--max-num-batched-tokens" not in compare.systems.pagellm(plain, 8000).argv
    offline, _ = compare.pagellm_offline(args, ctx, tmp_path / "r.json")
    assert offline[-2:] == ["--max-num-batched-tokens", "768"]
    assert compare.systems.vllm(ctx, 8000).argv == compare.systems.vllm(plain, 8000).argv


def test_compare_gives_vllm_its_own_flags_served_and_offline(tmp_path, monkeypatch):
    """``--vllm-flags``: the same setting given to pagellm can be given to vLLM (its budget, say), on its server and
    its offline run, named in the report's flags note; pagellm's commands do not change."""
    compare, args = _compare_args(monkeypatch, "--vllm-flags", "--max-num-batched-tokens 512",
                                  "--offline-num-prompts", "8")
    ctx = compare.systems.Context(tmp_path, tmp_path / "m.gguf", vllm_flags=tuple(args.vllm_flags.split()))
    plain = compare.systems.Context(tmp_path, tmp_path / "m.gguf")
    served = compare.systems.vllm(ctx, 8000)
    assert served.argv[-2:] == ["--max-num-batched-tokens", "512"] and "--max-num-batched-tokens 512" in served.note
    assert "--max-num-batched-tokens" not in compare.systems.vllm(plain, 8000).argv
    monkeypatch.setattr(compare.systems, "PEERS", tmp_path)
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    (tmp_path / "vllm" / "bin" / "vllm").write_text("")
    offline, _ = compare.offline_commands(args, ctx, tmp_path)["vLLM"]
    assert offline[-2:] == ["--max-num-batched-tokens", "512"]
    assert compare.systems.pagellm(ctx, 8000).argv == compare.systems.pagellm(plain, 8000).argv


@pytest.mark.parametrize("fmt", ["w4a8_int4", "w4a16_int4"])
@pytest.mark.parametrize("types", [{"Q4_1": 210}, {"Q4_0": 20, "Q4_K": 150, "Q6_K": 40}])
def test_compare_sets_4bit_pagellm_beside_llama_cpp_on_the_same_gguf(tmp_path, monkeypatch, fmt: str,
                                                                      types: dict) -> None:
    """``compare.py --quantization w4a8_int4`` (or ``w4a16_int4``, with ``--gguf``): pagellm serves the 4-bit GGUF
    with the flag, served and offline; llama.cpp serves the same file, named by its block types; vLLM and the
    transformers baseline sit out, saying why."""
    compare, args = _compare_args(monkeypatch, "--quantization", fmt)
    monkeypatch.setattr(compare.systems, "PEERS", tmp_path)
    (tmp_path / "llama.cpp" / "build" / "bin").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "build" / "bin" / "llama-server").write_bytes(b"")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gguf_weight_types.json").write_text(json.dumps(types))
    assert compare.quantized_dir(tmp_path / "model", fmt) == tmp_path / "model"  # no checkpoint written
    gguf = str(tmp_path / "m.gguf")
    ctx = compare.systems.Context(tmp_path / "model", tmp_path / "m.gguf", quantization=fmt)
    built = {name: build(ctx, 8000) for name, build in compare.systems.BUILDERS.items()}
    assert built["pagellm"].argv[4:7] == [gguf, "--quantization", fmt] and built["pagellm"].missing_reason is None
    assert f"--quantization {fmt}" in built["pagellm"].note
    kind = "Q4_1" if len(types) == 1 else "Q4_K/Q6_K/Q4_0"  # the most common first
    assert built["llama.cpp"].missing_reason is None and built["llama.cpp"].name == f"llama.cpp ({kind})"
    assert gguf in built["llama.cpp"].argv
    assert built["vllm"].missing_reason == f"no Q4_1 path on CPU (--quantization {fmt})"
    assert built["transformers"].missing_reason == f"no Q4_1 weights (--quantization {fmt})"
    offline = compare.offline_commands(args, ctx, tmp_path)
    assert list(offline) == ["pagellm"]
    assert offline["pagellm"][0][-4:] == ["--model", gguf, "--quantization", fmt]
    assert "groups of 32" in report._weights_note(fmt)


def test_compare_on_a_gguf_alone_serves_that_file_on_pagellm_and_llama_cpp(tmp_path, monkeypatch) -> None:
    """``compare.py --gguf FILE`` without --quantization (a gpt-oss file, say): pagellm and llama.cpp serve the file
    as it is, served and offline; vLLM and the transformers baseline sit out, saying why; not with W8A8."""
    compare, args = _compare_args(monkeypatch, "--gguf", str(tmp_path / "m.gguf"))
    assert args.gguf == str(tmp_path / "m.gguf") and args.quantization is None
    monkeypatch.setattr(compare.systems, "PEERS", tmp_path)
    (tmp_path / "llama.cpp" / "build" / "bin").mkdir(parents=True)
    (tmp_path / "llama.cpp" / "build" / "bin" / "llama-server").write_bytes(b"")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "gguf_weight_types.json").write_text(json.dumps({"BF16": 16, "MXFP4": 12}))
    gguf = str(tmp_path / "m.gguf")
    ctx = compare.systems.Context(tmp_path / "model", tmp_path / "m.gguf", gguf_only=True)
    built = {name: build(ctx, 8000) for name, build in compare.systems.BUILDERS.items()}
    assert built["pagellm"].argv[4] == gguf and built["pagellm"].argv[5] == "--port"
    assert built["llama.cpp"].name == "llama.cpp (BF16/MXFP4)" and gguf in built["llama.cpp"].argv
    assert built["llama.cpp"].missing_reason is None and built["pagellm"].missing_reason is None
    assert built["vllm"].missing_reason == built["transformers"].missing_reason == compare.systems.GGUF_ONLY
    offline = compare.offline_commands(args, ctx, tmp_path)
    assert list(offline) == ["pagellm"] and offline["pagellm"][0][-2:] == ["--model", gguf]
    with pytest.raises(SystemExit):
        _compare_args(monkeypatch, "--gguf", "m.gguf", "--quantization", "w8a8_int8")
