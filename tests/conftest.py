"""Shared fixtures: the real default model (paxpage and HF transformers on the same GGUF),
and tiny random-weight HF models saved to disk for fast checks."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the extended tier (tests marked `extended`): long workloads, the "
                          "full kernel matrices; PAXPAGE_EXTENDED_TESTS=1 does the same")


@pytest.hookimpl(trylast=True)  # after the folders' conftests have marked their items
def pytest_collection_modifyitems(config, items):
    """The default run (CI's) skips the extended tier, saying so; `--extended` runs everything."""
    if config.getoption("--extended") or os.environ.get("PAXPAGE_EXTENDED_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="extended tier: run with --extended")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache(tmp_path_factory):
    """One jax persistent compilation cache for the whole test run, in a temporary directory: many
    modules and servers compile the same step shapes of the same tiny models, and each module ends
    by clearing jax's in-memory caches (below), so without it they would compile them again.
    Subprocesses (CLI, multi-process and worker tests) inherit it through the environment.
    `PAXPAGE_TEST_XLA_CACHE=0` runs without it. The CLI's own `xla_cache.enable()` keeps a cache
    that is already configured, so nothing is written into the user's cache either way."""
    import jax

    from paxpage import xla_cache

    patch = pytest.MonkeyPatch()
    patch.setattr(xla_cache, "enable", lambda directory=None: jax.config.jax_compilation_cache_dir or None)
    if os.environ.get("PAXPAGE_TEST_XLA_CACHE", "1") != "0":
        directory = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        if not directory:  # pytest-xdist workers (and their subprocesses) share one cache
            root = tmp_path_factory.getbasetemp()
            directory = str((root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "xla_cache")
        settings = {"jax_compilation_cache_dir": directory, "jax_persistent_cache_min_compile_time_secs": 0.0}
        for name, value in settings.items():
            patch.setenv(name.upper(), str(value))
            jax.config.update(name, value)
        _lock_without_eviction(patch, jax)
    yield
    patch.undo()


def _lock_without_eviction(patch, jax) -> None:
    """The two workers write the same entries, so their cache takes jax's file lock, which comes
    only with a size limit. Under a limit jax's LRU cache lists, stats and reads the access time of
    every entry on each write (`_evict_if_needed`): O(entries) per compile, ~0.3 s a write once the
    run holds ~6,000 entries, all under the lock. A test run's cache is temporary and never needs
    evicting, so the workers keep the lock and skip the scan. Subprocesses get no limit (no scan, no
    lock): an entry read while another process writes it is a warning and a recompile in jax."""
    from jax._src import lru_cache

    if hasattr(lru_cache.LRUCache, "_evict_if_needed"):
        patch.setattr(lru_cache.LRUCache, "_evict_if_needed", lambda self, *, additional_size=0: None)
        jax.config.update("jax_compilation_cache_max_size", 8 << 30)


@contextlib.contextmanager
def jax_persistent_cache_off():
    """jax's persistent compilation cache (on for the test run, above) off inside: for tests that
    count what paxpage's executable cache compiles and stores, which an executable served by jax's
    cache is neither."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_executables():
    """After each test module: collect dropped models and clear jax's caches, so the process does not
    keep every executable the whole test run compiled. The CI run (~900 tests in one process)
    segfaulted inside XLA CPU's compiler late in the run, in tests that pass on their own:
    the live JIT-compiled code only grows otherwise."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2():
    import paxpage

    return paxpage.load()


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """A private PAXPAGE_CACHE_DIR for tests that load the default model through a cold cache; shared
    by them so the ~10 s conversion happens once a test run, never in the user's own cache."""
    return tmp_path_factory.mktemp("paxpage_cache")


@pytest.fixture(scope="session")
def hf_smollm2():
    """The same GGUF loaded by transformers: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from models.loading import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=GGUF_NAME,
                                                 dtype=torch.float32)
    return model.eval()


def save_tiny_hf(path, kind: str = "llama", seed: int = 0, **overrides):
    """Saves a tiny random-weight HF model of `kind` (llama | mistral | qwen2 | qwen3 | qwen3_moe |
    mixtral | gemma2 | gemma3 | gpt_oss) to `path`. Gemma and gpt-oss models run HF's eager attention
    (the one with soft-capping and sinks); gpt-oss's sinks and biases, which HF starts near 0, are drawn
    large enough to change the outputs."""
    import torch
    import transformers as tf

    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    base.update(overrides)
    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    if kind in ("qwen3", "qwen3_moe", "gemma2", "gemma3"):
        base.setdefault("head_dim", 16)
    if kind in ("gemma2", "gemma3", "gpt_oss"):
        base.setdefault("attn_implementation", "eager")
    if kind == "qwen3_moe":
        base = dict(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), **base)
    if kind in ("mixtral", "gpt_oss"):
        base = dict(dict(num_local_experts=4, num_experts_per_tok=2), **base)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base)).eval()
    # Random init gives near-uniform logits; sharper weights make greedy choices well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: the experts of MoE models
                p.mul_(4.0)
            elif kind.startswith("gemma"):  # Gemma norms start at w = 0 ((1 + w) = 1): make w matter
                p.normal_(0.0, 0.5)
            elif kind == "gpt_oss" and name.endswith(("sinks", "bias")):
                p.normal_(0.0, 1.5 if name.endswith("sinks") else 0.3)
    model.save_pretrained(path)
    return model


def to_mxfp4_checkpoint(path, hf) -> None:
    """Rewrites the gpt-oss checkpoint saved in `path` (save_tiny_hf) as released checkpoints
    store experts: `<name>_blocks` / `<name>_scales` (MXFP4: 4-bit e2m1 codes, one power-of-two
    exponent per 32 inputs, each block's scale the smallest that holds its largest value, codes
    rounded to the nearest value), and sets HF `hf`'s experts to transformers' own decoding of
    them (transformers.integrations.mxfp4), so that `hf` is the reference for the new file."""
    import glob

    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    values = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    params = dict(hf.named_parameters())
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        tensors = load_file(file)
        out = {}
        for name, w in tensors.items():
            if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                out[name] = w
                continue
            w = np.swapaxes(w, -1, -2).astype(np.float64)  # [E, I, O] -> stored as [E, O, I]
            blocks = w.reshape(*w.shape[:-1], -1, 32)
            amax = np.abs(blocks).max(axis=-1)
            exponent = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int32)
            v = blocks / np.ldexp(1.0, exponent)[..., None]
            codes = (np.abs(np.abs(v)[..., None] - values).argmin(axis=-1) + 8 * (v < 0)).astype(np.uint8)
            codes = codes.reshape(*codes.shape[:-1], 16, 2)
            # safetensors writes an array's buffer as it lies: contiguous arrays only
            packed = np.ascontiguousarray(codes[..., 0] | (codes[..., 1] << 4))
            scales = np.ascontiguousarray((exponent + 127).astype(np.uint8))
            out[name + "_blocks"], out[name + "_scales"] = packed, scales
            with torch.no_grad():  # the converter may change its inputs: give it copies
                params[name].copy_(convert_moe_packed_tensors(torch.from_numpy(packed.copy()),
                                                              torch.from_numpy(scales.copy()), dtype=torch.float32))
        save_file(out, file, metadata={"format": "pt"})


def round_to_int8_per_channel(hf, keep=("mlp.gate.weight",)) -> None:
    """Sets every weight matrix of HF model `hf` (2-D and 3-D, HF layout: rows are output channels)
    to its symmetric int8 rounding per output row, f32: scale = max|w| / 127, q = round(w / scale),
    |q| <= 127 (the rule `quantization="int8"` states); names ending in `keep` (the MoE router),
    norms and biases stay as they are. `hf` is then the reference for an int8-loaded model."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() < 2 or name.endswith(keep):
                continue
            w = p.numpy().astype(np.float32)
            amax = np.max(np.abs(w), axis=-1, keepdims=True)
            scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
            p.copy_(torch.from_numpy(np.clip(np.rint(w / scale), -127, 127) * scale))


# A tiny DeepSeek-V3: latent attention (q_lora_rank, kv_lora_rank 32, RoPE 8), a dense first layer, then
# 8 routed experts in 2 groups (top 2 from the best group) beside one shared expert.
TINY_DEEPSEEK = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1,
    num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def tiny_deepseek_models(tmp_path_factory, kinds: dict, version: int = 3):
    """kind -> (HF model, paxpage model) of save_tiny_deepseek(version, **kinds[kind]), each saved
    and loaded on first use (a module fixture returns it)."""
    import paxpage

    cache = {}

    def get(kind):
        if kind not in cache:
            path = tmp_path_factory.mktemp(f"deepseek_v{version}_{kind}")
            hf = save_tiny_deepseek(path, version=version, **kinds[kind])
            cache[kind] = (hf, paxpage.load(path))
        return cache[kind]

    return get


def save_tiny_deepseek(path, seed: int = 0, version: int = 3, **overrides):
    """A tiny random DeepseekV3ForCausalLM (version 3) or DeepseekV2ForCausalLM (version 2) of
    TINY_DEEPSEEK with `overrides`, saved to `path`, weights sharpened as save_tiny_hf does and V3's
    router correction biases random (HF starts them at 0), so the bias steers the choice."""
    import torch
    import transformers as tf

    classes = {3: (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM), 2: (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM)}
    config_cls, model_cls = classes[version]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**dict(TINY_DEEPSEEK, **overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf(path, "llama")
    return path


def check_prompt_logprobs(hf, prompt, out, atol=1e-4):
    """Every prompt token's logprob in `out` (generated with prompt_logprobs=0) against HF's."""
    import numpy as np
    import torch

    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()  # [S, V]
    got = np.array([out.prompt_logprobs[p][prompt[p]] for p in range(1, len(prompt))])
    np.testing.assert_allclose(got, ref[np.arange(len(prompt) - 1), prompt[1:]], atol=atol)


def check_prefill_and_decode(hf, model, prompts, max_tokens: int = 12):
    """The prompts prefilled in one step, then decoded: every prompt token's logprob and the
    greedy continuation equal HF's."""
    import paxpage

    outs = paxpage.generate(model, prompts, max_tokens=max_tokens, temperature=0, prompt_logprobs=0,
                            ignore_eos=True, page_size=8, num_pages=64, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, max_tokens)


def check_chunked_prefill_beside_decode(hf, model, prompts, max_tokens: int = 10):
    """An 8-token step budget, so the long prompt prefills in chunks of 4-token rows while the
    short one decodes: every prompt token's logprob and the greedy continuation equal HF's."""
    import paxpage

    outs = paxpage.generate(model, prompts, max_tokens=max_tokens, temperature=0, prompt_logprobs=0,
                            ignore_eos=True, page_size=4, num_pages=128, max_num_batched_tokens=8,
                            prefill_row_len=4, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check_prompt_logprobs(hf, prompt, out)
        assert out.token_ids == hf_greedy(hf, prompt, max_tokens)


def check_prefix_hit_and_preemption(hf, model, vocab):
    """Greedy tokens equal HF's when a second request reuses the first's cached pages, and when
    four sequences share a pool too small for all of them (some are preempted and recomputed)."""
    import paxpage

    shared = random_prompts(1, vocab, [29], seed=3)[0]
    config = paxpage.EngineConfig(page_size=4, num_pages=128, enable_prefix_caching=True)
    first = paxpage.generate(model, [shared + [5, 6]], max_tokens=8, temperature=0, ignore_eos=True,
                             engine_config=config, use_tqdm=False)[0]
    engine = model.engine(config)
    hits_before = engine.scheduler.page_manager.prefix_hit_tokens
    second = paxpage.generate(model, [shared + [9]], max_tokens=8, temperature=0, ignore_eos=True,
                              engine_config=config, use_tqdm=False)[0]
    assert engine.scheduler.page_manager.prefix_hit_tokens > hits_before
    assert first.token_ids == hf_greedy(hf, shared + [5, 6], 8)
    assert second.token_ids == hf_greedy(hf, shared + [9], 8)

    prompts = random_prompts(4, vocab, [22, 18, 25, 14], seed=4)
    small = paxpage.EngineConfig(page_size=4, num_pages=18, max_num_seqs=4)
    outs = paxpage.generate(model, prompts, max_tokens=16, temperature=0, ignore_eos=True,
                            engine_config=small, use_tqdm=False)
    assert model.engine(small).scheduler.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 16)


def hf_greedy(model, prompt_ids, max_new_tokens):
    """HF transformers greedy continuation (token ids after the prompt)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def random_prompts(n, vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(length)).tolist() for length in lengths[:n]]


def save_tiny_text_model(path, vocab_size: int = 320, seed: int = 0):
    """A tiny random llama with a real byte-level BPE tokenizer (id 0 = `<eos>`, the model's EOS),
    trained here on a few lines of JSON-like text: for checks that need text (structured outputs)
    without the cost of the default model. Random weights, so any text comes out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ['{"name": "Ada", "age": 36, "tags": ["math", "code"]}', "yes no maybe 2024-01-31",
              "The quick brown fox jumps over the lazy dog. 0123456789 true false null"] * 4
    tk.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>").save_pretrained(path)
    return save_tiny_hf(path, "llama", seed=seed, vocab_size=vocab_size, eos_token_id=0)


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_text")
    save_tiny_text_model(path)
    return path
