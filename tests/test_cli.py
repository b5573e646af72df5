"""The command line's error paths: a user's mistake is one line `paxpage: error: <message>` on stderr
and exit status 2; `--debug` shows the traceback; programming errors are not hidden."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import paxpage
from paxpage.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """No jax compilation cache switched on for the rest of the test run, no user cache touched."""
    from paxpage import xla_cache

    monkeypatch.setenv("PAXPAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(xla_cache, "enable", lambda directory=None: None)


@pytest.fixture
def no_model_load(monkeypatch):
    """Bad sampling values must fail before the model loads (seconds on a cold cache)."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(paxpage, "load", load)


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("paxpage: error: ")
    return lines[0]


@pytest.mark.parametrize("argv,message", [
    (["--max-tokens", "-1"], "paxpage: error: max_tokens must be >= 1, got -1"),
    (["--max-tokens", "0"], "paxpage: error: max_tokens must be >= 1, got 0"),
    (["--temperature", "-1"], "paxpage: error: temperature must be in [0, inf), got -1.0"),
    (["--top-p", "2"], "paxpage: error: top_p must be in (0, 1], got 2.0"),
    (["--top-k", "-5"], "paxpage: error: top_k must be -1 or 0 (disabled) or >= 1, got -5"),
    (["--seed", "-3"], "paxpage: error: seed must be >= 0, got -3"),
])
def test_bad_sampling_values(capsys, no_model_load, argv, message):
    assert main(["generate", "hi", *argv]) == 2
    assert one_error_line(capsys) == message


def test_bad_model_paths(capsys, tmp_path):
    assert main(["generate", "hi", "--model", "/nonexistent.gguf"]) == 2
    assert one_error_line(capsys) == "paxpage: error: model path '/nonexistent.gguf' does not exist"
    readme = os.path.join(ROOT, "README.md")
    assert main(["generate", "hi", "--model", readme]) == 2
    assert one_error_line(capsys) == (f"paxpage: error: model file {readme!r} is not a .gguf file; "
                                      "pass a .gguf file or a model directory")
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    assert "is not a model" in one_error_line(capsys)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF but not really")
    assert main(["generate", "hi", "--model", str(tmp_path / "bad.gguf")]) == 2
    assert "bad.gguf" in one_error_line(capsys)


def test_file_not_found_and_own_errors(capsys, monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "/gone/tokenizer.json")

    monkeypatch.setattr(paxpage, "load", missing)
    assert main(["generate", "hi"]) == 2
    assert one_error_line(capsys) == "paxpage: error: No such file or directory: /gone/tokenizer.json"

    class EngineDeadError(RuntimeError):  # as paxpage's engine loop defines its own errors
        pass

    EngineDeadError.__module__ = "paxpage.async_engine"

    def dead(*args, **kwargs):
        raise EngineDeadError("the engine loop died:\n  step 3 failed")

    monkeypatch.setattr(paxpage, "load", dead)
    assert main(["generate", "hi"]) == 2
    assert one_error_line(capsys) == "paxpage: error: the engine loop died: step 3 failed"


def test_bugs_and_debug_keep_the_traceback(capsys, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("not a user error")

    monkeypatch.setattr(paxpage, "load", bug)
    with pytest.raises(KeyError):
        main(["generate", "hi"])
    with pytest.raises(ValueError, match="top_p"):
        main(["--debug", "generate", "hi", "--top-p", "2"])


def test_exit_status_and_debug_in_a_process():
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "paxpage.cli", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)

    proc = run("generate", "hi", "--top-p", "2")
    assert proc.returncode == 2
    assert proc.stderr == "paxpage: error: top_p must be in (0, 1], got 2.0\n" and proc.stdout == ""
    proc = run("--debug", "generate", "hi", "--top-p", "2")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "sampling/params.py" in proc.stderr


def test_bench_without_a_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: which" in err and "rest" not in err.splitlines()[-1]


@pytest.mark.parametrize("argv,model_temperature,want", [
    ([], None, (0.0, -1)),  # greedy unless the model recommends a temperature
    ([], 0.7, (0.7, 20)),  # the model's defaults
    (["--temperature", "1.0"], 0.7, (1.0, 20)),  # a flag wins, even at SamplingParams' default value
    (["--top-k", "-1"], 0.7, (0.7, -1)),
])
def test_generate_leaves_unset_options_to_the_model(monkeypatch, capsys, argv, model_temperature, want):
    import types

    from models.generation_config import GenerationConfig

    generation = GenerationConfig(temperature=model_temperature, top_k=20 if model_temperature else None)
    model = types.SimpleNamespace(config=types.SimpleNamespace(generation=generation))
    monkeypatch.setattr(paxpage, "load", lambda source=None, quantization=None: model)
    seen = []

    def generate(model, inputs, sampling_params, engine_config=None, lora=None):  # what the engine does with the params
        seen.append(sampling_params.with_defaults(generation.sampling_defaults()))
        return []

    monkeypatch.setattr(paxpage, "generate", generate)
    assert main(["generate", "hi", *argv]) == 0
    assert (seen[0].temperature, seen[0].top_k) == want


def test_kv_cache_dtype_and_expert_parallel_flags_reach_the_engine_config(monkeypatch):
    import types

    from models.generation_config import GenerationConfig
    from paxpage.server.cli import engine_config_from_args

    model = types.SimpleNamespace(config=types.SimpleNamespace(generation=GenerationConfig()))
    monkeypatch.setattr(paxpage, "load", lambda source=None, quantization=None: model)
    seen = []
    monkeypatch.setattr(paxpage, "generate", lambda model, inputs, sampling_params, engine_config=None, lora=None:
                        seen.append(engine_config) or [])
    assert main(["generate", "hi", "--kv-cache-dtype", "fp8"]) == 0
    assert seen[0].kv_cache_dtype == "fp8" and seen[0].enable_expert_parallel is False
    assert main(["generate", "hi", "--tensor-parallel-size", "2", "--enable-expert-parallel"]) == 0
    assert seen[1].enable_expert_parallel is True and seen[1].tensor_parallel_size == 2
    args = types.SimpleNamespace(kv_cache_dtype="int8", no_prefix_caching=False, no_chunked_prefill=False)
    assert engine_config_from_args(args).kv_cache_dtype == "int8"  # paxpage serve's engine options


def test_serve_precompiles_on_one_host_unless_told_not_to():
    import argparse

    from paxpage.server.cli import add_serve_parser, engine_config_from_args, serving_precompile

    def build_parser():
        parser = argparse.ArgumentParser()
        add_serve_parser(parser.add_subparsers())
        return parser

    def config(*flags, processes=1):
        args = build_parser().parse_args(["serve", *flags])
        return serving_precompile(engine_config_from_args(args), processes).precompile

    assert config() is True and config("--precompile") is True
    assert config("--no-precompile") is False and config("--no-precompile", processes=2) is False
    assert config(processes=2) is None  # across processes: not supported, the backend's default
    with pytest.raises(SystemExit):  # one or the other
        build_parser().parse_args(["serve", "--precompile", "--no-precompile"])
    args = build_parser().parse_args(["serve", "--no-async-scheduling"])
    assert engine_config_from_args(args).async_scheduling is False
    assert engine_config_from_args(build_parser().parse_args(["serve"])).async_scheduling is True
    assert engine_config_from_args(build_parser().parse_args(["serve", "--enable-expert-parallel"])).enable_expert_parallel
    assert not engine_config_from_args(build_parser().parse_args(["serve"])).enable_expert_parallel


def test_lora_flag_runs_every_prompt_with_the_adapter(monkeypatch, tmp_path):
    import types

    from models.generation_config import GenerationConfig

    loaded = {}

    def load_lora(name, path):
        loaded[name] = types.SimpleNamespace(rank=6, path=path)

    model = types.SimpleNamespace(config=types.SimpleNamespace(generation=GenerationConfig()), loras=loaded,
                                  load_lora=load_lora)
    monkeypatch.setattr(paxpage, "load", lambda source=None, quantization=None: model)
    seen = []
    monkeypatch.setattr(paxpage, "generate", lambda model, inputs, sampling_params, engine_config=None, lora=None:
                        seen.append((engine_config, lora)) or [])
    assert main(["generate", "hi", "there", "--lora", str(tmp_path)]) == 0
    (config, lora), = seen
    assert loaded[lora].path == str(tmp_path)
    assert (config.max_loras, config.max_lora_rank) == (1, 6)  # one slot, the adapter's own rank
    seen.clear()
    assert main(["generate", "hi"]) == 0
    assert seen[0][1] is None and seen[0][0].max_loras == 0
