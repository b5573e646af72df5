"""The benchmark scripts' record-writing path on canned results: each script's doc_tables (and
doc_charts) turns a result into the rows its docs page shows, with the committed record's columns,
and write_record stores them with the provenance the pages print. Inputs are the figures of the
transcribed records where a script reproduces them, so the expected rows are the committed ones;
the rest are worked by hand. No model runs here (the smoke runs are the other tests/scripts/ files)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from tests.scripts.conftest import SCRIPTS, _load_script

sys.path.insert(0, SCRIPTS)

import docs_figures  # noqa: E402
import provenance  # noqa: E402

MB, MIB = 1e6, 2**20


def _committed(name: str, table: str) -> dict:
    return docs_figures.load_record(name)["tables"][table]


def _renders(tables: dict, charts: dict | None = None) -> None:
    """Every table renders as the pages would (rows as long as the columns), every chart is well formed."""
    record = {"provenance": {"machine": "m", "jax": "j", "jaxlib": "j", "date": "2026-01-01", "command": "c",
                             "commit": None}, "tables": tables, "charts": charts or {}}
    for table_id in tables:
        text = docs_figures.render_record("x", record, table_id, docs_figures.ROOT)
        assert sum(line.startswith("| ") for line in text.splitlines()) == len(tables[table_id]["rows"]) + 1, text
    for chart in (charts or {}).values():
        assert chart["kind"] in ("line", "bar") and chart["panels"]
        for panel in chart["panels"]:
            assert all(len(s["x"]) == len(s["y"]) for s in panel.get("series", []))


def test_write_record_keeps_tables_charts_and_provenance(tmp_path):
    path = tmp_path / "r.json"
    provenance.write_record(str(path), {"x": 1}, {"t": {"columns": ["a"], "rows": [[1]]}}, measures=("paxpage",),
                            argv=["scripts/bench_x.py", "--json", "out.json"],
                            charts={"c": {"kind": "bar", "panels": [{"bars": [{"label": "a", "value": 1}]}]}})
    record = json.loads(path.read_text())
    assert record["x"] == 1 and record["measures"] == ["paxpage"] and record["charts"]["c"]["kind"] == "bar"
    p = record["provenance"]
    assert p["command"] == "python scripts/bench_x.py --json out.json" and p["source"] == "measured"
    assert p["machine"] and p["jax"] and p["jaxlib"] and len(p["date"]) == 10
    with pytest.raises(ValueError, match=r"record's own keys \['charts'\]"):
        provenance.write_record(str(path), {"charts": 1})


def test_bench_step_rows_and_case_names():
    bench = _load_script("bench_step")
    case = dataclasses.asdict(bench.CASES[0])  # tiny-32x128, as measured for the committed record
    ms = 1e-3
    row = dict(case, case=case["key"], host_s=0.4 * ms, host_cpu_s=0.4 * ms, device_s=2.0 * ms, busy_s=2.0 * ms,
               wall_s=2.5 * ms, overlap=0.0, attention_share=0.08, attention_gb_per_s=28.2,
               host_cpu_max_s=0.64 * ms, host_cpu_max_warm_s=0.64 * ms, measured_steps=16, decode_batch_steps=15,
               step_rows=[32] * 16)
    # a case with arrivals: 4 steps with a prefill chunk, 12 without
    arrivals = dict(row, **dataclasses.asdict(bench.Case("x", "tiny", 256, 1536, arrivals_every=4)),
                    host_cpu_max_s=180.0 * ms, host_cpu_max_warm_s=3.04 * ms, decode_batch_steps=8,
                    step_rows=[256] + [257] * 14 + [260],
                    decode_steps=12, decode_host_cpu_s=1.21 * ms, decode_host_cpu_max_s=1.5 * ms,
                    arrival_steps=4, arrival_host_cpu_s=2.5 * ms, arrival_host_cpu_max_s=3.04 * ms)
    tables = bench.doc_tables({"cases": [row, arrivals], "steps": 16, "read_bandwidth_gb_per_s": 70.4})
    committed = _committed("step", "step")
    assert tables["step"]["columns"] == committed["columns"]
    # wall / max(host CPU, busy) = 2.5 / 2.0; overlap, shares and GB/s as given
    assert tables["step"]["rows"][0] == ["tiny 32 x 128", 0.4, 0.4, 2.0, 2.0, 2.5, 1.25, "0%", "8%", 28.2]
    assert "read bandwidth 70.4 GB/s" in tables["step"]["caption"]
    assert tables["step_every"]["rows"] == [
        ["tiny 32 x 128", 0.4, 0.6, 0.6, "15 / 16", "32 to 32", "", ""],
        ["tiny 256 x 1536, a request arriving every 4 steps", 0.4, 180.0, 3.0, "8 / 16", "256 to 260", "1.2 / 1.5",
         "2.5 / 3.0"]]
    # The committed record holds every case; the cases off the steady state name what they add to it.
    labels = [bench.case_label(dataclasses.asdict(c)) for c in bench.CASES]
    assert len(set(labels)) == len(labels) and set(labels) == {r[0] for r in committed["rows"]}
    assert bench.case_label(dataclasses.asdict(bench.QUICK_CASES[-1])) == (
        "tiny 8 x 32, temperature 0.7, prefix caching off, prompts of 24 to 32 tokens, 50% of rows ending in "
        'the window, a request arriving every step, n 2, logprobs 2, stop ["xyz"], 1 request following a regex')
    _renders(tables)


def test_bench_moe_row():
    bench = _load_script("bench_moe")
    result = {"grouped_impl": "tiled", "identical_greedy_outputs": "32/32", "compiles_after_warmup": 0,
              "model": dict(num_layers=4, hidden_size=256, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=512, vocab_size=2048),
              "workload": dict(num_requests=32, prompt_len=64, output_len=32, max_num_seqs=32),
              "systems": {"tiled": {"output_tok_s": 840.2}, "dense": {"output_tok_s": 270.0}},
              "ratio_output_tok_s": 840.2 / 270.0,
              "moe_layer_ms": {"512": {"tiled": 10.0, "dense": 41.0}, "32": {"tiled": 1.0, "dense": 5.4}}}
    tables = bench.doc_tables(result)
    committed = _committed("moe", "moe")
    assert tables["moe"]["columns"] == committed["columns"]
    assert tables["moe"]["rows"] == [committed["rows"][1]]  # 840 / 270 = 3.1x; layer 5.4x at 32, 4.1x at 512
    assert "32 requests of 64 prompt + 32 output tokens" in tables["moe"]["caption"]
    _renders(tables)


def test_bench_parallel_tables_and_the_paper_table_from_the_rules():
    bench = _load_script("bench_parallel")
    results = {"model": "SmolLM2-135M-Instruct", "device": "cpu x 4 (cpu)", "num_heads": 9, "num_kv_heads": 3,
               "num_pages": 64, "page_size": 16, "num_seqs": 8, "dp_requests": 8, "dp_tokens": 8,
               "budget_bytes": 2**30,
               "memory": [{"tp": 2, "dp": 1, "plan": "p", "weights_bytes_per_device": 5 * 2**20 + 2**19,
                           "kv_bytes_per_device": 45 * 2**20, "page_bytes_per_device": 720 * 2**10,
                           "max_pages_in_budget": 1019, "max_tokens_in_budget": 16304}],
               "step": [{"tp": 1, "decode_step_ms": 20.04}, {"tp": 2, "decode_step_ms": 31.96},
                        {"tp": 4, "decode_step_ms": 40.0}],
               "dp": [{"dp": 1, "output_tok_s": 86.81}, {"dp": 2, "output_tok_s": 54.5}],
               "paper": bench.paper_table(page_size=16)}
    tables = bench.doc_tables(results)
    for table in ("memory", "step", "dp", "paper"):
        assert tables[table]["columns"] == _committed("parallel", table)["columns"], table
    assert tables["memory"]["rows"] == [[2, 1, "p", "5.50 MiB", "45.00 MiB", "720.00 KiB", "1,019 / 16,304"]]
    assert tables["step"]["rows"] == [["one steady decode step, 8 sequences", "20.0 ms", "32.0 ms", "40.0 ms"]]
    assert tables["dp"]["rows"][0][1:] == [86.8, 54.5]
    # The committed on-paper table is what today's sharding rules give.
    assert tables["paper"]["rows"] == _committed("parallel", "paper")["rows"]
    _renders(tables)


def test_bench_structured_quality_and_kv_error_rows():
    structured = _load_script("bench_structured").doc_tables(
        {"tok_s": {"none": 327.4, "quarter": 320.1, "all": 302.2}, "num_requests": 64, "output_len": 64,
         "repeats": 3, "model": None})
    assert structured["structured"]["rows"] == _committed("structured", "structured")["rows"]
    assert structured["structured"]["caption"].startswith("SmolLM2-135M-Instruct, 64 requests x 64 tokens")

    quality = _load_script("eval_quality").doc_tables(
        {"model": "m", "prompts": 4, "tokens": 8, "ppl_tokens": 31, "python": "3.11.7", "speed_seqs": 4,
         "rows": {"f32": dict(agree=1.0, prefix=1.0, kl=0.0, ppl=16.7581, ppl_change=0.0, finite=True,
                              weights_bytes=538.1e6, kv_bytes_per_token=46080, tok_s=482.68)},
         "skipped": {"GGUF-native": "n/a: not a GGUF"}})
    committed = _committed("quality", "quality")
    assert quality["quality"]["columns"] == committed["columns"]
    assert quality["quality"]["rows"] == [committed["rows"][0], ["GGUF-native", "n/a: not a GGUF", *[""] * 7]]

    def err(rel, mx):
        return {"mean_rel": rel, "max_abs": mx, "mean_abs": 0.0}
    kv = _load_script("kv_quant_error").doc_tables({"page_size": 16, "granularity": {
        "int8 per token (f32 scale)": err(0.0195, 0.31), "int8 per token (bf16 scale)": err(0.0195, 0.33),
        "int8 per page (16 tokens)": err(0.0353, 0.38), "fp8 per token (f32 scale)": err(0.0418, 0.74),
        "fp8 per token (bf16 scale)": err(0.0422, 0.74), "fp8 per page (16 tokens)": err(0.0508, 1.07)},
        "end_to_end": {"auto": {"perplexity": 45.44, "tokens": 300},
                       "int8": {"perplexity": 45.59, "ppl_change": 0.0032},
                       "fp8": {"perplexity": 45.51, "ppl_change": 0.0016}}})
    assert kv["kv_quant_error"]["columns"] == _committed("kv_quant_error", "kv_quant_error")["columns"]
    assert kv["kv_quant_error"]["rows"] == [
        ["int8", "1.95% (0.31)", "1.95% (0.33)", "3.53% (0.38)", "45.59 (+0.32%)"],
        ["fp8 e4m3", "4.18% (0.74)", "4.22% (0.74)", "5.08% (1.07)", "45.51 (+0.16%)"]]
    _renders({**structured, **quality, **kv})


def test_bench_warm_start_weight_copies_step_compile_rows():
    warm = _load_script("bench_warm_start").doc_tables(
        {"pass1_s": 16.2, "pass2_s": 9.9, "overhead_s": 6.3, "compiles": 30, "cache_hits": 0, "xla_cache": False,
         "precompile": False, "workload": {"num_requests": 64},
         "executable_cache": {"loaded": 0, "compiled": 21, "compile_s": 8.4, "load_s": 0.0}})
    assert warm["warm_start"]["rows"] == [_committed("warm_start", "warm_start")["rows"][0]]
    assert warm["warm_start"]["columns"] == _committed("warm_start", "warm_start")["columns"]

    copies = _load_script("bench_weight_copies").doc_tables({"model": "SmolLM2-135M-Instruct", "dtype": "float32", "rows": [
        {"mode": "unrolled", "loaded": 538.1 * MB, "engine_1": 962.9 * MB, "engine_2": 962.9 * MB, "weights": 538.1 * MB},
        {"mode": "held", "loaded": 538.1 * MB, "engine_1": 538.1 * MB, "engine_2": 538.1 * MB, "weights": 538.1 * MB}]})
    assert copies["weight_copies"]["rows"] == _committed("weight_copies", "weight_copies")["rows"]

    compile_ = _load_script("bench_step_compile").doc_tables({"model": "SmolLM2-135M-Instruct", "sampler": [], "steps": [
        dict(decode_rows=64, prefill_rows=0, lower_s=2.7, compile_s=5.6, bare_lower_s=0.4, bare_compile_s=2.1),
        dict(decode_rows=4, prefill_rows=16, lower_s=3.6, compile_s=8.2, bare_lower_s=0.6, bare_compile_s=2.5)]})
    committed = _committed("step_compile", "step_compile")
    assert compile_["step_compile"]["rows"] == committed["rows"]
    # attention's share: 1 - 0.6 / 3.6 .. 1 - 0.4 / 2.7 of lowering, 3.5 / 5.6 .. 5.7 / 8.2 of compiling
    assert compile_["step_compile"]["caption"].endswith("83%-85% of lowering and 62%-70% of the compile")
    _renders({**warm, **copies, **compile_})


def test_bench_serving_rows_and_latency_chart():
    bench = _load_script("bench_serving")

    def points(rps, ttft, tpot, norm, stall):
        return [dict(rate=rate, requests_per_s=a, ttft_s={"p50": b}, tpot_s={"p50": c / 1e3}, normalised_latency_s=d,
                     max_token_gap_s=e, num_finished=24, num_requests=24)
                for rate, a, b, c, d, e in zip((1, 2, 4, 8), rps, ttft, tpot, norm, stall)]
    results = {"natural": {
        "paxpage": points((0.52, 0.62, 0.68, 1.09), (0.38, 0.61, 5.6, 3.5), (83, 153, 351, 184),
                          (0.11, 0.30, 0.49, 0.26), (0.5, 6.6, 7.5, 2.5)),
        "hf": points((0.43, 0.46, 0.51, 0.51), (0.85, 1.2, 6.0, 5.2), (283, 536, 548, 504),
                     (0.31, 0.55, 0.67, 0.59), (1.5, 2.3, 4.8, 3.5))}, "forced": {
        "paxpage": points((0.49, 0.66, 0.72, 0.60), (1.3, 0.61, 1.8, 10.1), (207, 203, 320, 360),
                          (0.25, 0.19, 0.35, 0.56), (2.3, 0.7, 2.0, 6.5)),
        "hf": points((0.29, 0.43, 0.38, 0.42), (2.7, 1.7, 6.7, 10.8), (674, 579, 673, 609),
                     (0.69, 0.60, 0.78, 0.77), (4.2, 2.2, 5.7, 5.9))}}
    data = {"systems": ["paxpage", "hf"], "results": results, "workload": {"num_requests": 24},
            "latency_limit_s_per_token": {"natural": 0.4, "forced": 0.4},
            "capacity": {m: {s: bench.capacity(results[m][s], 0.4) for s in ("paxpage", "hf")} for m in results}}
    tables = bench.doc_tables(data)
    committed = _committed("serving", "serving")
    assert tables["serving"]["columns"] == committed["columns"]
    assert tables["serving"]["rows"] == committed["rows"]
    assert tables["sustained"]["columns"] == _committed("serving", "sustained")["columns"]
    # natural: paxpage crosses 0.4 between 2 (0.30) and 4 (0.49), HF between 1 (0.31) and 2 (0.55),
    # on a log-rate axis; forced: paxpage between 4 (0.35) and 8 (0.56), HF is over it at every rate
    pax, hf, forced = 2 * 2 ** (0.10 / 0.19), 2 ** (0.09 / 0.24), 4 * 2 ** (0.05 / 0.21)
    assert tables["sustained"]["rows"] == [["0.4 s/token", f"{pax:.3g} / {hf:.3g} req/s ({pax / hf:.1f}x)",
                                            f"{forced:.3g} / none req/s"]]
    charts = bench.doc_charts(data, "title")
    assert charts["latency"]["panels"] == docs_figures.load_record("serving")["charts"]["latency"]["panels"]
    _renders(tables, charts)


def test_bench_kernels_tables_and_bandwidth_chart():
    bench = _load_script("bench_kernels")
    results = [dict(batch=b, context=s, kernel=k, ms=1.0, gb_s=g, frac_copy_bw=g / 4000)
               for b, s, k, g in ((64, 4096, "shipped", 1800.0), (64, 32768, "shipped", 2169.0),
                                  (64, 4096, "decode", 900.0), (64, 32768, "decode", 1156.0))]
    data = {"device": "NVIDIA H200", "interpret": False, "copy_bw_gb_s": 4000.0, "results": results,
            "config": dict(dtype="bfloat16", num_heads=32, num_kv_heads=8, head_dim=128, page_size=16)}
    tables, charts = bench.doc_tables(data), bench.doc_charts(data)
    assert tables["kernels"]["rows"][1] == [64, 32768, "shipped", 1.0, 2169.0, "54.2%"]
    panel = charts["bandwidth"]["panels"][0]
    assert panel["title"] == "B = 64" and panel["hline"]["y"] == 4000.0
    assert panel["series"] == [{"label": "shipped", "x": [4096, 32768], "y": [1800.0, 2169.0]},
                               {"label": "decode", "x": [4096, 32768], "y": [900.0, 1156.0]}]
    _renders(tables, charts)


def test_diagnostic_scripts_rows():
    compile_ = _load_script("bench_compile").doc_tables(
        {"4,1,unrolled": dict(lower_s=1.234, compile_s=2.0, temp_mib=None, step_ms=3.04),
         "4,1,scan": dict(lower_s=0.5, compile_s=1.0, temp_mib=12.34, step_ms=3.5)})
    assert compile_["compile"]["rows"] == [["(4, 1)", "unrolled", 1.23, 2.0, "", 3.0],
                                           ["(4, 1)", "scan", 0.5, 1.0, 12.3, 3.5]]
    malloc = _load_script("bench_malloc").doc_tables(
        {"settings": ["default", "mallopt"], "rounds": 3,
         "runs": {"default": {"f": [10.0, 12.0, 11.0]}, "mallopt": {"f": [9.0, 8.0, 8.8]}}})
    assert malloc["malloc"]["columns"] == ["figure", "default", "mallopt", "mallopt / default"]
    assert malloc["malloc"]["rows"] == [["f", 11.0, 8.8, "0.80x"]]  # medians 11 and 8.8
    sampler = _load_script("bench_sampler").doc_tables(
        {"rows_per_call": 8, "vocab": 64, "context": 16, "iters": 3, "samplers": ["xla"],
         "rows": [{"logits": "flat", "case": "greedy", "xla": {"device_ms": 1.26, "host_ms": 0.31}}]})
    assert sampler["sampler"]["rows"] == [["flat", "greedy", 1.3, 0.3]]
    detok = _load_script("bench_detokenizer").doc_tables(
        {"rows": [{"variant": "stream", "stops": 2, "first_us": 3.14, "last_us": 3.26}]})
    assert detok["detokenizer"]["rows"] == [["stream", 2, 3.1, 3.3]]
    stall = _load_script("bench_grammar_stall").doc_tables(
        {"args": {"streams": 4}, "schema_bytes": 65 * 1024,
         "results": {"alone": dict(p50_tpot_ms=20.04, p99_tpot_ms=30.0, max_tpot_ms=31.0)}})
    assert stall["grammar_stall"]["rows"] == [["alone", 20.0, 30.0, 31.0]]
    assert "a 65 KiB JSON schema" in stall["grammar_stall"]["caption"]
    _renders({**compile_, **malloc, **sampler, **detok, **stall})


def test_tpu_compile_check_step_and_roofline_rows():
    check = _load_script("tpu_compile_check")
    step = {"step": "llama8b tp8", "topology": "v5e:2x4", "decode_rows": 64, "prefill_rows": 0,
            "argument_bytes": 3963 * MIB, "output_bytes": 2079 * MIB, "temp_bytes": 0, "alias_bytes": 2048 * MIB,
            "layer_pool_bytes": 64 * MIB, "pool_copies": 0, "pool_staging": 1, "weight_copies": 1,
            "weight_copy_bytes": 54 * MIB, "working_bytes": 31 * MIB,
            "bound_bytes": 40.4 * MIB}
    roof = {"step": "llama8b tp8", "chip": "v5e", "batch": 64, "context": 1024, "weight_bytes": 2.01e9,
            "kv_bytes": 1.074e9, "compiled_bytes": 3.5e9, "flops": 1e12, "tokens_per_second_bound": 17008,
            "tokens_per_second_as_compiled": 14966}
    tables = check.doc_tables({"steps": [step], "roofline": [roof]})
    assert tables["steps"]["rows"] == [["llama8b tp8", "v5e:2x4", 64, 0, "3,963", "2,079", "0", "64", 0, 1, "1 (54)",
                                              "31 / 40"]]
    assert tables["roofline"]["rows"] == [["llama8b tp8", "v5e", 64, 1024, "2.01", "1.07", "17,008", "3.50", "14,966"]]
    assert "pool_layout" not in tables
    _renders(tables)


def test_tpu_compile_check_counts_copies_of_params_only():
    _load_script("tpu_compile_check")  # puts scripts/ on the path its parts import from
    hlo_reader = _load_script("tpu_hlo")
    hlo = "\n".join([
        '%param.283 = bf16[6144,576]{0,1:T(8,128)(2,1)} parameter(0), metadata={op_name="params[\'embed\']"}',
        '%param.7 = s32[64]{0} parameter(7), metadata={op_name="batch.token_ids"}',
        '%copy.994 = bf16[6144,576]{1,0:T(8,128)(2,1)S(1)} copy(%param.283), sharding={devices=[8,1]<=[8]}',
        '%copy.995 = s32[64]{0} copy(%param.7)',
        '%copy.996 = bf16[64,576]{1,0} copy(%fusion.3)',
        '%copy-start = (bf16[6144,576]{0,1:T(8,128)(2,1)S(1)}, u32[]) copy-start(%param.283)'])
    assert hlo_reader.weight_copies(hlo) == [("bf16[6144, 576]", 6144 * 576 * 2)]


def test_tpu_compile_check_counts_stagings_of_every_pool_leaf():
    """An int8 pool's scales staged through VMEM and back (flattened, as XLA's memory-space
    assignment moves them) count beside its values; other copies, and arrays of other sizes, do not."""
    import jax

    from pallas_kernels.kv_quant import QuantizedKV

    _load_script("tpu_compile_check")
    hlo_reader = _load_script("tpu_hlo")
    cache = QuantizedKV(jax.ShapeDtypeStruct((4096, 3, 16, 128), "int8"),
                        jax.ShapeDtypeStruct((3, 1024, 1, 128), "float32"))
    hlo = "\n".join([
        '%copy-start.2 = (f32[393216]{0:T(1024)}, f32[393216]{0:T(1024)S(1)}, u32[]{:S(2)}) copy-start(%scatter_fusion.3)',
        '%copy-start.5 = (s8[4096,3,16,128]{3,2,1,0:T(8,128)(4,1)S(1)}, u32[]) copy-start(%kv_cache_0__values)',
        '%copy-start.6 = (f32[1024,128]{1,0:T(8,128)}, u32[]) copy-start(%fusion.4)',
        '%copy.7 = f32[393216]{0:T(1024)} copy(%fusion.5)',
        '%copy-start.8 = (bf16[393216]{0:T(1024)}, u32[]) copy-start(%fusion.6)'])
    assert hlo_reader.pool_staging(hlo, cache) == 2


def test_every_committed_measured_record_holds_what_its_script_renders():
    # A record a script wrote (not a transcription) keeps the tables that script's doc_tables
    # makes from the record's own figures, so the pages' rows are the measured ones.
    scripts = {"step": "bench_step", "moe": "bench_moe", "parallel": "bench_parallel",
               "structured": "bench_structured", "quality": "eval_quality", "kv_quant_error": "kv_quant_error",
               "warm_start": "bench_warm_start", "weight_copies": "bench_weight_copies",
               "step_compile": "bench_step_compile", "serving": "bench_serving", "serving_vllm": "bench_serving",
               "serving_vllm_load": "bench_serving",
               "window": "bench_window",
               "memory": "bench_memory", "memory_mla": "bench_memory", "throughput": "bench_throughput", "sharing": "bench_sharing",
               "speculative": "bench_speculative", "kernels_h200": "bench_kernels",
               "latency_breakdown": "latency_breakdown", "soak": "soak", "lora": "bench_lora", "grammar_stall": "bench_grammar_stall",
               "batch_invariant": "bench_throughput", "tpu_pool_layout": "tpu_compile_check",
               "tpu_steps": "tpu_compile_check", "tpu_moe": "tpu_compile_check"}
    for path in sorted(os.listdir(docs_figures.RECORDS)):
        name = path[:-len(".json")]
        record = docs_figures.load_record(name)
        if record["provenance"]["source"] != "measured":
            continue
        assert name in scripts, f"docs/benchmarks/{path} was measured by a script this test does not know"
        data = {k: v for k, v in record.items() if k not in ("provenance", "measures", "tables", "charts")}
        bench = _load_script(scripts[name])
        tables = bench.doc_tables(data["rows"] if name == "speculative" else data)
        assert record["tables"] == json.loads(json.dumps(tables)), name
