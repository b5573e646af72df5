"""Compiles a C++ XLA FFI source into a shared library once, cached on disk.

The library's file name is a hash of everything that can change the binary: the source bytes
and those of the headers beside it (parallel.h, simd.h), the compiler flags, the compiler's
version, jaxlib's version (its FFI headers) and the CPU (`-march=native` code runs only where it
was built). A build writes a temp file in the cache
directory and renames it into place, so processes building at once never load half a file
(the last rename wins; both files are the same build).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import time
import warnings

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
COMPILE_TIMEOUT_S = 300
log = logging.getLogger("paxpage")


def _cpu_description() -> str:
    """The CPU model and feature flags (what -march=native reads), from /proc/cpuinfo when it exists."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def library_path(source: str, build_dir: str, compiler: str = "g++") -> str:
    """Where the library built from `source` with this compiler, jaxlib and CPU lives."""
    import jaxlib

    folder = os.path.dirname(os.path.abspath(source))
    headers = sorted(n for n in os.listdir(folder) if n.endswith(".h"))
    h = hashlib.sha256()
    for path in [source] + [os.path.join(folder, n) for n in headers]:
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    for part in (" ".join(FLAGS), _compiler_version(compiler), jaxlib.__version__, _cpu_description()):
        h.update(b"\0" + part.encode())
    stem = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(build_dir, f"{stem}-{h.hexdigest()[:20]}.so")


def build(source: str, build_dir: str, compiler: str = "g++") -> str:
    """The path of the compiled library, compiling it first when the cache lacks it. Raises
    OSError (no compiler), subprocess.CalledProcessError (a failed compile, its stderr attached)
    or subprocess.TimeoutExpired."""
    import jax

    path = library_path(source, build_dir, compiler)
    if os.path.exists(path):
        return path
    os.makedirs(build_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=build_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    log.info("paxpage: compiling %s with %s (once per source, compiler, jaxlib and CPU)",
             os.path.basename(source), compiler)
    start = time.perf_counter()
    try:
        subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), source, "-o", tmp],
                       capture_output=True, text=True, check=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("paxpage: built %s in %.1f s", path, time.perf_counter() - start)
    return path


class NativeLibrary:
    """A native source built (cached), loaded and its FFI targets registered for the CPU platform
    once per process. `load` is False, with one warning per process, when that fails (no
    compiler, a failed build or load); callers then take their XLA path."""

    def __init__(self, source: str, targets: dict[str, str], what: str):
        self.source = source
        self.targets = dict(targets)  # FFI target name -> the library's handler symbol
        self.what = what  # for the warning: "the native CPU attention kernel"
        self.library = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self, build_dir: str, compiler: str = "g++") -> bool:
        import ctypes

        import jax

        with self._lock:
            if self.library is not None:
                return True
            if self.error is not None:
                return False
            try:
                library = ctypes.cdll.LoadLibrary(build(self.source, build_dir, compiler))
                for target, symbol in self.targets.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
            except Exception as e:  # any failure: the caller's XLA path
                detail = getattr(e, "stderr", None) or str(e)
                self.error = f"{type(e).__name__}: {detail}"[-2000:]
                warnings.warn(f"paxpage: {self.what} is unavailable, using the XLA-ops path ({self.error})",
                              RuntimeWarning, stacklevel=3)
                return False
            self.library = library
            log.info("paxpage: loaded %s from %s", self.what, library._name)
            return True

    def loaded(self) -> bool:
        return self.library is not None
