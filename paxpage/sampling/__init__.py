"""Sampling: a request's parameters and how each logits row draws its token.

  params.py          SamplingParams, validated at construction (pure Python)
  fields.py          the one table of per-row fields the packers read (name, dtype, neutral value)
  tensors.py         SamplingTensors (a step's per-row host arrays) and the row keys of the draws
  sampler.py         the jitted `sample`: penalties, filters, the draw, logprobs
  batch.py           SamplingBatch: the running sequences' fields kept in per-slot arrays
  penalty_counts.py  running token counts of penalised rows (pure numpy)
  draw.py            the exact Gumbel-max draw and argmax over the vocabulary
  noise.py           the draw's Gumbel noise as a counter hash of (row key, stream, index)
"""
