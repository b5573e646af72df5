"""Quantised KV cache error on SmolLM2's real K/V: which scale granularity, and what it costs.

1. Scale granularity. HF transformers runs the GGUF (the independent reference) on a text; every
   layer's queries and keys (after RoPE) and values are recorded. Causal attention over the
   exact K/V is compared with attention over K/V quantised and dequantised (symmetric absmax)
   with one scale per (token, kv head) (f32 or bf16 scales) or one per (page, kv head) (the
   page's tokens share a scale). Printed: mean and max |error| of the attention output over all
   layers, query tokens and heads, relative to the output's mean |value|.
2. End to end. The engine scores the same text with kv_cache_dtype auto / int8 / fp8 (f32 model):
   perplexity and the largest per-token log-prob change.

Usage:
    python scripts/kv_quant_error.py [--page-size 16] [--json /tmp/kv_quant_error.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Our own words, long enough for several pages of keys.
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small tin of "
    "oil and a cloth for the lens. For thirty years the routine had not changed: wind the clockwork, "
    "trim the wick, polish the glass until the beam cut cleanly across the bay. Ships no longer "
    "needed him, the harbour master said; satellites and radio beacons did the work now. Still, the "
    "fishermen who came home late liked to see the slow white sweep over the water, and the keeper "
    "liked to know that somebody was looking. In the winter storms the waves reached halfway up the "
    "tower, and the whole building hummed like a struck bell. He kept a logbook of every night: the "
    "wind's direction, the height of the swell, the names of the boats he could read through his "
    "binoculars. When the council finally voted to automate the light, they asked him for the "
    "logbooks. There were forty-one of them, stacked in a cupboard under the stairs, and together "
    "they were the only continuous record of the weather on that coast for three decades."
)
QMAX = {"int8": 127.0, "fp8": 448.0}


def qdq(x: np.ndarray, name: str, group_axis: int | None = None, group: int = 1, bf16_scale=False) -> np.ndarray:
    """Quantise-dequantise x [S, K, D] with one scale per (token, head), or per (block of `group`
    tokens along axis 0, head) when group > 1."""
    import ml_dtypes

    amax = np.abs(x).max(-1, keepdims=True)  # [S, K, 1]
    if group > 1:
        s = x.shape[0]
        pad = -s % group
        blocks = np.pad(amax, ((0, pad), (0, 0), (0, 0))).reshape(-1, group, *amax.shape[1:])
        amax = np.repeat(blocks.max(1), group, axis=0)[:s]
    scale = amax / QMAX[name]
    if bf16_scale:
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
    y = np.where(scale > 0, x / np.where(scale > 0, scale, 1), 0).clip(-QMAX[name], QMAX[name])
    y = np.round(y) if name == "int8" else y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (y * scale).astype(np.float32)


def attention(q, k, v):  # q [S, N, D], k / v [S, K, D] -> [S, N, D], causal
    n, kh = q.shape[1], k.shape[1]
    k = np.repeat(k, n // kh, axis=1)
    v = np.repeat(v, n // kh, axis=1)
    s = np.einsum("tnd,snd->nts", q, k) / math.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((q.shape[0], q.shape[0]), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nts,snd->tnd", p, v)


def record_hf(text: str):
    """Per layer (q [S, N, D], k [S, K, D], v [S, K, D]) from HF transformers on the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    from models.loading import default_model_path

    path = default_model_path()
    name = os.path.basename(path)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=name)
    ids = tok(text, return_tensors="pt").input_ids
    qs, ks, vs = [], [], []
    rope = modeling_llama.apply_rotary_pos_emb

    def record(q, k, *a, **kw):
        q, k = rope(q, k, *a, **kw)
        qs.append(q[0].transpose(0, 1).numpy().copy())  # [S, N, D]
        ks.append(k[0].transpose(0, 1).numpy().copy())
        return q, k

    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, out: vs.append(out[0].reshape(out.shape[1], -1, head_dim).numpy().copy()))
        for layer in hf.model.layers]
    modeling_llama.apply_rotary_pos_emb = record
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()
    return list(zip(qs, ks, vs)), ids.shape[1]


def granularity(layers, page_size: int) -> dict:
    variants = {
        "int8 per token (f32 scale)": dict(name="int8"),
        "int8 per token (bf16 scale)": dict(name="int8", bf16_scale=True),
        f"int8 per page ({page_size} tokens)": dict(name="int8", group=page_size),
        "fp8 per token (f32 scale)": dict(name="fp8"),
        "fp8 per token (bf16 scale)": dict(name="fp8", bf16_scale=True),
        f"fp8 per page ({page_size} tokens)": dict(name="fp8", group=page_size),
    }
    errs = {v: [] for v in variants}
    mags = []
    for q, k, v in layers:
        want = attention(q, k, v)
        mags.append(np.abs(want).mean())
        for label, kw in variants.items():
            got = attention(q, qdq(k, **kw), qdq(v, **kw))
            errs[label].append(np.abs(got - want))
    mag = float(np.mean(mags))
    return {label: {"mean_abs": float(np.mean([e.mean() for e in es])),
                    "max_abs": float(max(e.max() for e in es)),
                    "mean_rel": float(np.mean([e.mean() for e in es]) / mag)} for label, es in errs.items()}


def end_to_end(text: str) -> dict:
    import paxpage

    model = paxpage.load()
    out = {}
    lps = {}
    for name in ("auto", "int8", "fp8"):
        res = paxpage.generate(model, [text], max_tokens=1, temperature=0, prompt_logprobs=0, kv_cache_dtype=name,
                               dtype="float32", page_size=16, num_pages=64, use_tqdm=False)[0]
        ids = res.prompt_token_ids
        lp = np.array([res.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))])
        lps[name] = lp
        out[name] = {"perplexity": float(np.exp(-lp.mean())), "tokens": len(ids)}
        assert np.isfinite(lp).all(), name
    for name in ("int8", "fp8"):
        out[name]["ppl_change"] = out[name]["perplexity"] / out["auto"]["perplexity"] - 1
        out[name]["max_abs_logprob_change"] = float(np.abs(lps[name] - lps["auto"]).max())
    model.close()
    return out


def doc_tables(data: dict) -> dict:
    """The docs' table (docs/quantisation.md): one row per cache dtype."""
    gran, e2e, page = data["granularity"], data["end_to_end"], data["page_size"]

    def cell(label):
        r = gran[label]
        return f"{r['mean_rel']:.2%} ({r['max_abs']:.2f})"

    rows = [[shown, cell(f"{name} per token (f32 scale)"), cell(f"{name} per token (bf16 scale)"),
             cell(f"{name} per page ({page} tokens)"),
             f"{e2e[name]['perplexity']:.2f} ({e2e[name]['ppl_change']:+.2%})"]
            for name, shown in (("int8", "int8"), ("fp8", "fp8 e4m3"))]
    caption = ("Mean |error| of the attention output against exact K/V, as a share of its mean |value| "
               f"(max |error| in brackets), over every layer of HF transformers' SmolLM2 on a {e2e['auto']['tokens']}-"
               f"token text; engine perplexity of the f32 model on it, {e2e['auto']['perplexity']:.2f} with an "
               "unquantised cache")
    return {"kv_quant_error": {"caption": caption, "columns": ["cache", "per (token, kv head), f32 scale", "same, bf16 scale",
                                           f"per ({page}-token page, kv head)", "engine perplexity"],
                               "rows": rows}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    layers, num_tokens = record_hf(TEXT)
    print(f"SmolLM2 via HF transformers: {len(layers)} layers, {num_tokens} tokens", flush=True)
    gran = granularity(layers, args.page_size)
    print("attention output error vs exact K/V (mean |out| over layers as the unit):")
    for label, r in gran.items():
        print(f"  {label:<28} mean {r['mean_abs']:.2e} ({r['mean_rel']:.2%} of mean |out|), max {r['max_abs']:.2e}")
    e2e = end_to_end(TEXT)
    print(f"engine, {e2e['auto']['tokens']} tokens: perplexity auto {e2e['auto']['perplexity']:.4f}")
    for name in ("int8", "fp8"):
        r = e2e[name]
        print(f"  {name}: perplexity {r['perplexity']:.4f} ({r['ppl_change']:+.3%}), "
              f"largest log-prob change {r['max_abs_logprob_change']:.4f}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from provenance import write_record  # the figures with machine, versions, date, command, commit

        data = {"granularity": gran, "end_to_end": e2e, "page_size": args.page_size}
        write_record(args.json, data, doc_tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
