"""Packer.pack's prefill layout against a token-by-token reference: each prefill row holds up to
prefill_row_len consecutive tokens of one sequence, rows back to back after the decode rows;
a token's KV slot is its page (from the sequence's page table) * page_size + offset."""

from __future__ import annotations

import types

import numpy as np

from paxpage.packing import Packer, RowPlan, bucket


def _reference(plans, num_dec: int, row_len: int, page_size: int):
    """Per token and per row, as the step's kernels read them: (token id, position, slot) at
    each flat index, (length so far, tokens) per prefill row, the flat index of each sampled row,
    of each verified position and of each scored prompt token."""
    tokens, rows_out, last, verify, prompt = {}, [], {}, {}, []
    row = 0
    for i, plan in plans:
        for a in range(plan.start, plan.start + plan.num_new, row_len):
            b = min(a + row_len, plan.start + plan.num_new)
            for p in range(a, b):
                flat = num_dec + row * row_len + p - a
                page = plan.page_table[p // page_size]
                tokens[flat] = (plan.token_ids[p], p, page * page_size + p % page_size)
                if p < plan.num_prompt_tokens - 1:
                    prompt.append(flat)
                if plan.num_drafts and p >= plan.start + plan.num_new - 1 - plan.num_drafts:
                    verify.setdefault(i, []).append(flat)
                last[i] = flat
            rows_out.append((list(plan.page_table), b, b - a))
            row += 1
    return tokens, rows_out, last, verify, prompt


def test_prefill_rows_laid_out_as_token_by_token():
    page_size, row_len, pages_per_seq = 4, 8, 12
    cfg = types.SimpleNamespace(page_size=page_size, prefill_row_len=row_len, pages_per_seq=pages_per_seq)
    packer = Packer(cfg, with_lora=False, single_row_decode=False, keep_on_device=False)
    rng = np.random.default_rng(0)

    def plan(key, length, start, num_new, **kw):
        table = rng.permutation(100)[:pages_per_seq].tolist()
        return RowPlan(token_ids=rng.integers(0, 1000, length).tolist(), page_table=table, start=start,
                       num_new=num_new, num_samples=kw.pop("num_samples", 1), table_key=key, **kw)

    plans = [
        plan("a", 30, 0, 1),  # a decode row (a 1-token chunk)
        plan("b", 40, 0, 19),  # 19 tokens from position 0: rows of 8, 8, 3
        plan("c", 45, 13, 16, num_samples=0),  # a mid-prompt chunk from position 13: two full rows
        plan("d", 50, 40, 5, num_samples=3, num_drafts=2),  # speculative verify: 3 logits rows
        plan("e", 20, 2, 9, num_prompt_tokens=8),  # scores its prompt tokens 2..6
    ]
    batch, logits_plan, prompt_rows, _ = packer.pack(plans)
    num_dec = batch.num_decode_rows
    prefill = [(i, p) for i, p in enumerate(plans) if p.num_new > 1]
    tokens, rows_out, last, verify, prompt = _reference(prefill, num_dec, row_len, page_size)
    for flat, (token, pos, slot) in tokens.items():
        assert (batch.token_ids[flat], batch.positions[flat], batch.slot_mapping[flat]) == (token, pos, slot), flat
    padding = set(range(num_dec, len(batch.slot_mapping))) - set(tokens)
    assert all(batch.slot_mapping[f] == -1 for f in padding)
    assert batch.num_prefill_rows == bucket(len(rows_out))
    for r, (table, length, q) in enumerate(rows_out):
        assert batch.pre_page_indices[r].tolist() == table and (batch.pre_kv_lens[r], batch.pre_q_lens[r]) == (length, q)
    assert not batch.pre_kv_lens[len(rows_out):].any() and not batch.pre_q_lens[len(rows_out):].any()
    # logits rows: the decode row, b's last token, d's three verified positions, e's last token
    want = [0, last[1], *verify[3], last[4]]
    assert logits_plan == [0, 1, 3, 3, 3, 4]
    assert batch.logits_indices[:len(want)].tolist() == want
    assert [p for p, _ in prompt_rows] == [4] * 5 and batch.prompt_logits_indices[:5].tolist() == prompt
