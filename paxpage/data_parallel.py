"""Data parallelism: `data_parallel_size` engine replicas behind one front door.

Replica i is a whole LLMEngine (scheduler, KV pool, weights) on row i of the ("data", "model")
mesh (paxpage/mesh.py), driven by its own EngineLoop thread. `DataParallelLoop` has the
EngineLoop interface that `paxpage.generate` / `stream` / `AsyncEngine` / the server use, and
sends each request to one replica (`PrefixRouter`: longest cached prefix, else least loaded).
Requests never span replicas, so a request's tokens are those one engine alone would give
(greedy, and seeded sampling, whose draws depend only on the request's seed and step).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

from paxpage.dp_router import PrefixRouter
from paxpage.engine import LLMEngine
from paxpage.engine_loop import FINAL_OUTPUTS, EngineLoop, EngineSnapshot, Submission


def build_replicas(model_cfg, params, tokenizer, config, loras=None) -> list[LLMEngine]:
    """One LLMEngine per data-parallel replica, each on its own devices."""
    import jax

    from paxpage.mesh import replica_meshes

    if jax.process_count() > 1:  # the followers mirror one engine's device calls (multihost.py)
        raise ValueError(f"data_parallel_size {config.data_parallel_size} > 1 is not supported across "
                         f"{jax.process_count()} processes yet; use tensor parallelism over the hosts")
    meshes = replica_meshes(config.tensor_parallel_size, config.data_parallel_size, config.mesh)
    return [LLMEngine(model_cfg, params, tokenizer, config, mesh=mesh, loras=loras) for mesh in meshes]


class DataParallelLoop:
    """EngineLoop's interface over one EngineLoop per replica."""

    def __init__(self, engines: list[LLMEngine], *, max_waiting_requests: int | None = None,
                 **restart):
        """restart: EngineLoop's restart_on_error / max_restarts_per_minute, for each replica."""
        # max_waiting_requests applies per replica (each has its own waiting queue)
        self.loops = [EngineLoop(e, max_waiting_requests=max_waiting_requests, **restart) for e in engines]
        self.router = PrefixRouter(len(engines), engines[0].config.page_size)
        self._lock = threading.Lock()
        self._replica_of: dict[str, int] = {}  # live request id -> replica, guarded by _lock
        self._loads = [0] * len(engines)  # live requests per replica, guarded by _lock
        self._ids = iter(range(1 << 62))

    @property
    def engines(self) -> list[LLMEngine]:
        return [loop.engine for loop in self.loops]  # each loop's current one (rebuilt after a failure)

    @property
    def engine(self) -> LLMEngine:
        """Replica 0's: config, eos ids, precompile facts are the same on every replica."""
        return self.loops[0].engine

    def new_request_id(self) -> str:
        with self._lock:
            return f"dp-{next(self._ids)}"

    def submit(self, submissions: list[Submission]) -> Future:
        """Routes each request, then queues each replica's share; all or none: when a replica
        rejects its share, the others' are aborted and the future fails with that error."""
        groups: dict[int, list[Submission]] = {}
        with self._lock:
            for sub in submissions:
                replica = self.router.route(sub.prompt_token_ids, self._loads)
                self._loads[replica] += 1
                self._replica_of[sub.request_id] = replica
                groups.setdefault(replica, []).append(dataclasses.replace(sub, sink=self._sink(sub)))
        done: Future = Future()
        futures = []
        try:
            for replica, subs in groups.items():
                futures.append(self.loops[replica].submit(subs))
        except BaseException:
            self._forget([s.request_id for s in submissions], abort=True)
            raise
        remaining = [len(futures)]

        def finished(future: Future) -> None:
            error = future.exception()
            with self._lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if error is not None and not done.done():
                self._forget([s.request_id for s in submissions], abort=True)
                done.set_exception(error)
            elif last and not done.done():
                done.set_result(None)

        for future in futures:
            future.add_done_callback(finished)
        return done

    def _sink(self, sub: Submission):
        def sink(item):
            if isinstance(item, (*FINAL_OUTPUTS, BaseException)):
                self._forget([sub.request_id])
            sub.sink(item)
        return sink

    def _forget(self, request_ids, abort: bool = False) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                replica = self._replica_of.pop(rid, None)
                if replica is not None:
                    self._loads[replica] -= 1
                    by_replica.setdefault(replica, []).append(rid)
        if abort:
            for replica, ids in by_replica.items():
                self.loops[replica].abort(ids)

    def abort(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            by_replica: dict[int, list[str]] = {}
            for rid in ids:
                if rid in self._replica_of:
                    by_replica.setdefault(self._replica_of[rid], []).append(rid)
        for replica, rids in by_replica.items():
            self.loops[replica].abort(rids)

    @property
    def loads(self) -> list[int]:
        with self._lock:
            return list(self._loads)

    def snapshot(self) -> EngineSnapshot:
        """The replicas' counters summed (KV usage averaged; errors: the first)."""
        snaps = [loop.snapshot() for loop in self.loops]
        errors = [s.error for s in snaps if s.error is not None]
        recovering = [s.recovering for s in snaps if s.recovering is not None]
        return EngineSnapshot(
            num_running=sum(s.num_running for s in snaps), num_waiting=sum(s.num_waiting for s in snaps),
            kv_cache_usage=sum(s.kv_cache_usage for s in snaps) / len(snaps),
            prompt_tokens=sum(s.prompt_tokens for s in snaps),
            generation_tokens=sum(s.generation_tokens for s in snaps),
            num_preemptions=sum(s.num_preemptions for s in snaps),
            num_steps=sum(s.num_steps for s in snaps), alive=all(s.alive for s in snaps),
            error=errors[0] if errors else None,
            seconds_since_progress=max(s.seconds_since_progress for s in snaps),
            recovering=recovering[0] if recovering else None,
            **{name: sum(getattr(s, name) for s in snaps)
               for name in ("num_restarts", "num_received", "num_finished", "num_aborted", "num_failed")})

    @property
    def alive(self) -> bool:
        return all(loop.alive for loop in self.loops)

    @property
    def idle(self) -> bool:
        return all(loop.idle for loop in self.loops)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        for loop in self.loops:
            loop.shutdown(timeout)


def make_engine(model_cfg, params, tokenizer, config, loras=None):
    """An LLMEngine, or the list of replicas when config.data_parallel_size > 1. `loras`: the
    model's LoRA adapters by name (LLMEngine's)."""
    if config is not None and config.data_parallel_size > 1:
        return build_replicas(model_cfg, params, tokenizer, config, loras)
    return LLMEngine(model_cfg, params, tokenizer, config, loras=loras)


def make_loop(engine, *, max_waiting_requests: int | None = None, **restart):
    """The loop that owns what `make_engine` built (restart: EngineLoop's restart options)."""
    if isinstance(engine, list):
        return DataParallelLoop(engine, max_waiting_requests=max_waiting_requests, **restart)
    return EngineLoop(engine, max_waiting_requests=max_waiting_requests, **restart)
