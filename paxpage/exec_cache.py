"""A disk cache of compiled executables that skips tracing and lowering on a warm start.

jax's persistent compilation cache (xla_cache.py) saves only XLA's compile: every shape is
still traced and lowered to MLIR before the cache is looked up (its key is the lowered module),
which for the scanned SmolLM2 step is ~0.3-0.5 s of a ~0.5 s warm start per shape. This cache
is keyed by what determines the computation before any tracing, so a hit is one file read
and `deserialize_and_load`:
    - the source of paxpage/, models/ and pallas_kernels/ (any edit misses; .py files and the
      native kernels' .cc and .h files, whose compiled custom calls the executables call),
    - jax and jaxlib versions, the backend, its platform version and device kinds, XLA_FLAGS
      and the jax flags that change a lowering,
    - a caller-given context (the model config and the resolved engine config fields that
      shape a step; see ModelRunner),
    - the function's name, its static arguments, and every argument leaf's shape, dtype,
      weak type and sharding (so a changed parameter tree or pool misses).
Anything that goes wrong on the cache's side (an unreadable or stale file, a serialisation the
backend does not support) logs one line and falls back to the normal jit path: the cache can
make a start slower, never wrong. Files are written atomically (temp file + rename), so
processes sharing a directory never read half a file.

Deserialising runs code the file describes: point the cache only at a directory you trust
(as jax's persistent cache).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np

log = logging.getLogger("paxpage")

_PACKAGES = ("paxpage", "models", "pallas_kernels")
FORMAT = 1  # bump when the file layout changes


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over the .py, .cc and .h files of paxpage/, models/ and pallas_kernels/ (path and bytes)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for package in _PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".py", ".cc", ".h")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def environment_fingerprint() -> str:
    """Versions, backend and flags: what makes the same source lower or compile differently."""
    import jaxlib

    devices = jax.devices()
    flags = {name: getattr(jax.config, name, None) for name in (
        "jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")}
    parts = [f"format={FORMAT}", f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}",
             f"backend={jax.default_backend()}", f"platform_version={devices[0].client.platform_version}",
             f"devices={sorted({d.device_kind for d in devices})}x{len(devices)}",
             f"processes={jax.process_count()}", f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
             f"flags={sorted(flags.items())}"]
    return "\n".join(parts)


_hits = threading.local()  # set when jax's persistent cache serves a compile on this thread
_listening = False
_listen_lock = threading.Lock()


def _on_event(event: str, *args, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.seen = True


def _listen() -> None:
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True


def _leaf_signature(x) -> tuple:
    """(shape, dtype, weak type, sharding) of one argument leaf; called for every leaf on every
    call, so it keeps to attributes that cost well under a microsecond (str(dtype) costs ~8)."""
    if type(x) is np.ndarray:
        return (x.shape, x.dtype, False, None)
    if isinstance(x, jax.Array):
        # An uncommitted array (jax.device_put without a device: the runner's cached decode
        # constants) runs where a host array would: the same executable serves both.
        return (x.shape, x.dtype, x.weak_type, x.sharding if getattr(x, "committed", True) else None)
    # Python scalars and other leaves jit accepts: their type decides the traced dtype
    return (np.shape(x), type(x).__name__, True, None)


def _describe_sharding(s) -> str:
    if s is None:
        return "host"
    return f"{type(s).__name__}:{s}"


_MAGIC = b"paxpage-exe-1\n"  # then the sha256 of the pickled (blob, in_tree, out_tree), then those bytes


def default_directory() -> str:
    """paxpage's cache directory + /executables (`paxpage cache` shows and empties it)."""
    from models.cache import EXECUTABLES_DIR, cache_dir

    return os.path.join(cache_dir(), EXECUTABLES_DIR)


class ExecutableCache:
    """Compiled executables on disk under `directory`, keyed by `context` (a string the caller
    builds from everything besides the arguments that shapes the computation) and the
    environment and source fingerprints."""

    def __init__(self, directory: str, context: str):
        self.directory = os.fspath(directory)
        self.base = hashlib.sha256("\n".join(
            [environment_fingerprint(), source_fingerprint(), context]).encode()).hexdigest()
        self._lock = threading.Lock()
        # loaded: read from disk; compiled: compiled here (and stored); failed: fell back to jit
        # skipped: compiled, but served by jax's persistent cache, so not stored (see _executable)
        self.stats = {"loaded": 0, "compiled": 0, "stored": 0, "skipped": 0, "failed": 0, "load_s": 0.0,
                      "compile_s": 0.0}

    def wrap(self, name: str, jitted: Callable, static_argnums: Sequence[int] = ()) -> "CachedFunction":
        """`jitted` (a jax.jit function called with positional arguments only) behind this cache."""
        return CachedFunction(self, name, jitted, tuple(static_argnums))

    def path(self, name: str, signature: str) -> str:
        key = hashlib.sha256(f"{self.base}\n{name}\n{signature}".encode()).hexdigest()[:40]
        return os.path.join(self.directory, f"{name}-{key}.jaxexe")

    def load(self, path: str):
        """The executable stored at `path`, or None (no file, or one that cannot be used)."""
        import time

        from jax.experimental import serialize_executable

        if not os.path.exists(path):
            return None
        t = time.perf_counter()
        try:
            with open(path, "rb") as f:
                data = f.read()
            # A damaged file never reaches pickle or XLA's deserialiser, which can abort the
            # process on bytes it cannot parse: its digest is checked first.
            start = len(_MAGIC) + 32
            digest, body = data[len(_MAGIC):start], data[start:]
            if not data.startswith(_MAGIC) or hashlib.sha256(body).digest() != digest:
                raise ValueError("the file's digest does not match its contents")
            blob, in_tree, out_tree = pickle.loads(body)
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except Exception as e:  # a stale or damaged file: compile as if it were not there
            log.warning("paxpage: executable cache: cannot load %s (%s: %s); compiling instead",
                        os.path.basename(path), type(e).__name__, e)
            self._count("failed")
            return None
        self._count("loaded", time.perf_counter() - t, "load_s")
        return compiled

    def store(self, path: str, compiled) -> None:
        from jax.experimental import serialize_executable

        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            body = pickle.dumps((blob, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
            data = _MAGIC + hashlib.sha256(body).digest() + body
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # a backend or executable that cannot be serialised: just not cached
            log.warning("paxpage: executable cache: cannot store %s (%s: %s)", os.path.basename(path),
                        type(e).__name__, e)
            self._count("failed")
            return
        self._count("stored")

    def _count(self, what: str, seconds: float = 0.0, seconds_key: str | None = None) -> None:
        with self._lock:
            self.stats[what] += 1
            if seconds_key:
                self.stats[seconds_key] += seconds


class CachedFunction:
    """Calls a jitted function through executables compiled once per argument signature (in
    memory), each read from the disk cache when there, else compiled and stored."""

    def __init__(self, cache: ExecutableCache, name: str, jitted: Callable, static_argnums: tuple[int, ...]):
        self.cache, self.name, self.jitted, self.static_argnums = cache, name, jitted, static_argnums
        self._executables: dict[Any, Callable] = {}

    def _split(self, args):
        statics = tuple(args[i] for i in self.static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
        return statics, dynamic

    def _lookup(self, args):
        """(executable, key, dynamic args) for these arguments: from memory, else loaded or compiled."""
        statics, dynamic = self._split(args)
        leaves, tree = jax.tree.flatten(dynamic)
        key = (statics, tree, tuple(_leaf_signature(x) for x in leaves))
        executable = self._executables.get(key)
        if executable is None:
            executable = self._executables[key] = self._executable(args, key)
        return executable, key, dynamic

    def __call__(self, *args):
        executable, key, dynamic = self._lookup(args)
        if type(executable) is _Loaded:
            return self._first_call(executable, args, key, dynamic)
        return executable(*dynamic)

    def prepare(self, *args):
        """Loads (or compiles and stores) the executable for these arguments without running it
        (precompile). Returns its jax.stages.Compiled, or None where the jit path is used."""
        executable = self._lookup(args)[0]
        executable = getattr(executable, "compiled", executable)
        return executable if hasattr(executable, "out_info") else None

    def _first_call(self, loaded: "_Loaded", args, key, dynamic):
        """A loaded executable's first run; if it fails (a file that deserialised but cannot run),
        the file is dropped and the function compiled afresh. Arguments are donated only once a
        run starts, and a run that cannot start has not consumed them."""
        try:
            out = loaded.compiled(*dynamic)
        except Exception as e:
            log.warning("paxpage: executable cache: %s from %s failed to run (%s: %s); compiling instead",
                        self.name, os.path.basename(loaded.path), type(e).__name__, e)
            self.cache._count("failed")
            try:
                os.unlink(loaded.path)
            except OSError:
                pass
            executable = self._executables[key] = self._compile(args, key, loaded.path)
            return executable(*dynamic)
        self._executables[key] = loaded.compiled
        return out

    def ensure_stored(self, *args) -> bool:
        """Makes sure the executable for these arguments is on disk, compiling and storing it if
        not, but does not load a stored one (its first call will): precompile's way with
        executables a run may never need. False where the jit path is used."""
        statics, dynamic = self._split(args)
        leaves, tree = jax.tree.flatten(dynamic)
        key = (statics, tree, tuple(_leaf_signature(x) for x in leaves))
        if key in self._executables or os.path.exists(self._path(key)):
            return True
        return self.prepare(*args) is not None

    def _path(self, key) -> str:
        statics, tree, leaves = key
        signature = repr((statics, str(tree), [(s, str(d), w, _describe_sharding(sh)) for s, d, w, sh in leaves]))
        return self.cache.path(self.name, signature)

    def _executable(self, args, key) -> Callable:
        path = self._path(key)
        compiled = self.cache.load(path)
        if compiled is not None:
            return _Loaded(compiled, path)
        return self._compile(args, key, path)

    def _compile(self, args, key, path: str) -> Callable:
        import time

        statics = key[0]
        t = time.perf_counter()
        _listen()
        _hits.seen = False
        try:
            compiled = self.jitted.lower(*args).compile()
        except Exception as e:  # let the plain jit path raise (or succeed) as it always did
            log.warning("paxpage: executable cache: cannot compile %s ahead of time (%s: %s); using jit",
                        self.name, type(e).__name__, e)
            self.cache._count("failed")
            return functools.partial(_call_jitted, self.jitted, self.static_argnums, statics)
        self.cache._count("compiled", time.perf_counter() - t, "compile_s")
        if getattr(_hits, "seen", False):
            # jax's persistent cache served it: an executable XLA deserialised does not serialise
            # again intact on CPU (jax 0.10.2: the reloaded copy fails at its first run with
            # "Function ... not found"), so only fresh compiles are stored.
            log.info("paxpage: executable cache: %s came from jax's compilation cache; not stored", self.name)
            self.cache._count("skipped")
            return compiled
        self.cache.store(path, compiled)
        return compiled


class _Loaded:
    """An executable read from disk that has not run yet (CachedFunction._first_call)."""

    def __init__(self, compiled, path: str):
        self.compiled, self.path = compiled, path

    def __call__(self, *dynamic):
        return self.compiled(*dynamic)


def _call_jitted(jitted, static_argnums, statics, *dynamic):
    """The fallback: calls `jitted` with the static arguments put back in their places."""
    args = list(dynamic)
    for i, value in sorted(zip(static_argnums, statics)):
        args.insert(i, value)
    return jitted(*args)
