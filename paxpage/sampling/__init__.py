"""Sampling: the per-row device fields of a request's SamplingParams (fields.py)."""
