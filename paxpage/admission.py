"""Admission: prompts become queued requests, checked against what the engine can ever run.

`Admission.add_request` applies the model's sampling defaults to the fields a request leaves
unset, validates it (vocabulary, lengths, n against the step's rows and the pool's pages, the
LoRA adapter it names, its grammar), draws its seed, sets up beam search, and queues its first
sequence with the scheduler and its sample with the output processor; `add_embedding` queues an
embedding request. A request that can never be served raises ValueError (TypeError for a value
of the wrong type) before anything is queued. Ids of requests and sequences are handed out
here. Pure Python on the host.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Mapping

from models.config import ModelConfig
from paxpage import beam as beam_lib
from paxpage.config import ResolvedConfig
from paxpage.embedding import EmbeddingRequest, Pooling
from paxpage.engine_stats import EngineStats
from paxpage.output_processor import OutputProcessor, Request
from paxpage.sampling.params import SamplingParams
from paxpage.scheduler import Scheduler
from paxpage.sequence import Sequence
from paxpage.structured_backend import GrammarBackend


class Admission:
    def __init__(self, model_cfg: ModelConfig, config: ResolvedConfig, tokenizer, eos_token_ids: tuple[int, ...],
                 scheduler: Scheduler, outputs: OutputProcessor, stats: EngineStats,
                 embeds: dict[int, EmbeddingRequest], loras: Mapping[str, Any]):
        """`embeds`: the engine's live embedding requests by request id (this adds to it);
        `loras`: name -> models.lora.LoraAdapter, read at each request (adapters loaded later
        are seen)."""
        self.model_cfg = model_cfg
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.outputs = outputs
        self.stats = stats
        self.embeds = embeds
        self.loras = loras
        # the model's recommended sampling fields, for requests that leave them unset (as vLLM)
        self.sampling_defaults = model_cfg.generation.sampling_defaults()
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()
        self._grammars: GrammarBackend | None = None  # built by the first structured request
        self._grammars_lock = threading.Lock()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, index: int = 0,
                    prompt: str | None = None, stream: bool = True, lora: str | None = None) -> int:
        """Queues a prompt; raises ValueError at once if it can never be served. Sampling fields
        that `params` leaves unset take the model's defaults (`sampling_defaults`).
        stream=False: `step` makes no deltas for it and lists it only in the step it finishes
        (with none); read its result with `output` (vLLM's FINAL_ONLY). `lora`: the name of a
        loaded LoRA adapter the request runs (None: the base model)."""
        adapter = self.lora_adapter(lora)
        params = params.with_defaults(self.sampling_defaults)
        params.validate_for(self.model_cfg.vocab_size, self.config.max_model_len, len(prompt_ids),
                            prompt_token_ids=prompt_ids)
        self._check_num_samples(params)
        matcher = self._matcher(params) if params.structured_outputs is not None else None
        request_id = next(self._request_ids)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        request = Request(request_id, index, prompt, list(prompt_ids), params, [], stream=stream)
        if params.beam_width > 1:  # rows of its beams sample greedily with top-K logprobs
            request.beam = beam_lib.BeamSearch(params, len(prompt_ids), self.eos_token_ids,
                                               self.model_cfg.vocab_size, self.config)
            request.params = request.beam.row_params
        seq = self.new_sequence(prompt_ids, request.params.max_tokens, request_id)
        seq.lora = adapter  # its children (n > 1, beams) inherit it when forked
        sample = self.outputs.new_sample(request, seq, seed)
        sample.matcher = matcher
        try:
            self.scheduler.add(seq)  # raises ValueError for a request that can never fit
        except ValueError:
            self.outputs.drop_sample(seq.seq_id)
            raise
        request.samples.append(sample)
        request.forked = params.n == 1
        self.outputs.add(request)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def add_embedding(self, prompt_ids: list[int], pooling: Pooling | str = "last", *, index: int = 0) -> int:
        """Queues an embedding request (paxpage/embedding.py): the prompt is prefilled like any
        other, never samples, and once its last chunk ran its pages are freed and the step that
        ran it lists it, finished; read the vector with `output`. ValueError at once if the
        prompt can never be served."""
        pooling = Pooling.parse(pooling)
        prompt_ids = [int(t) for t in prompt_ids]
        vocab, max_len = self.model_cfg.vocab_size, self.config.max_model_len
        if not 1 <= len(prompt_ids) < max_len:
            raise ValueError(f"input has {len(prompt_ids)} tokens; an embedding input needs 1 to "
                             f"{max_len - 1} (max_model_len {max_len} less one)")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is out of range; the vocabulary has {vocab} tokens")
        request_id = next(self._request_ids)
        seq = self.new_sequence(prompt_ids, 1, request_id)
        # mean pooling needs every token's state: no prefix-cache hit may skip one
        seq.use_prefix_cache = pooling.kind != "mean"
        self.scheduler.add(seq)  # raises ValueError for a request that can never fit
        self.embeds[request_id] = EmbeddingRequest(request_id, index, prompt_ids, pooling, seq)
        self.stats.prompt_tokens += len(prompt_ids)
        return request_id

    def lora_adapter(self, name: str | None):
        """The loaded adapter `name` (None for None); ValueError naming the name and the limit
        when this engine cannot run it."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise TypeError(f"lora must be an adapter name (str) or None, got {type(name).__name__}")
        adapter = self.loras.get(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded adapters: {sorted(self.loras)}")
        if not self.config.max_loras:
            raise ValueError(f"request names LoRA adapter {name!r} but this engine's max_loras is 0; "
                             "build it with max_loras >= 1")
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {adapter.rank}; max_lora_rank is "
                             f"{self.config.max_lora_rank}")
        return adapter

    def _check_num_samples(self, params: SamplingParams) -> None:
        """The n samples' first tokens are drawn in one step (n rows from the prompt's logits row)
        and each sample then holds a KV page of its own: n beyond either bound could never run."""
        limit = min(self.config.max_num_batched_tokens, self.config.num_pages)
        if params.n > limit:
            raise ValueError(f"n is {params.n}; this engine runs at most {limit} samples of one prompt "
                             f"(max_num_batched_tokens {self.config.max_num_batched_tokens}, "
                             f"num_pages {self.config.num_pages})")

    def _matcher(self, params: SamplingParams):
        """A fresh llguidance matcher for the request's structured_outputs (ValueError when the
        model has no usable tokenizer or the grammar does not compile against it)."""
        return self.grammars().matcher(params.structured_outputs)

    def grammars(self) -> GrammarBackend:
        """The engine's grammar backend, built on first use; any thread may call it (and its
        `compile`), e.g. to compile a request's grammar before submitting it."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
                self._grammars = GrammarBackend(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
            return self._grammars

    def new_sequence(self, prompt_ids: list[int], max_tokens: int, request_id: int) -> Sequence:
        return Sequence(prompt_ids, max_tokens, seq_id=next(self._seq_ids), group_id=request_id)
