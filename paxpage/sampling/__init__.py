"""Sampling: a request's parameters and how each logits row draws its token.

  params.py          SamplingParams, validated at construction (pure Python)
  fields.py          the one table of per-row fields the packers read (name, dtype, neutral value)
  sampler.py         SamplingTensors (the per-row arrays) and the jitted `sample`
  batch.py           SamplingBatch: the running sequences' fields kept in per-slot arrays
  penalty_counts.py  running token counts of penalised rows (pure numpy)
  draw.py            the exact Gumbel-max draw and argmax over the vocabulary
  noise.py           the draw's Gumbel noise as a counter hash of (row key, stream, index)
"""
