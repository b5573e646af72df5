"""Compiles a C++ XLA FFI source into a shared library once, cached on disk.

The library's file name is a hash of everything that can change the binary: the source bytes,
the compiler flags, the compiler's version, jaxlib's version (its FFI headers) and the CPU
(`-march=native` code runs only where it was built). A build writes a temp file in the cache
directory and renames it into place, so processes building at once never load half a file
(the last rename wins; both files are the same build).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
COMPILE_TIMEOUT_S = 300


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

    with open(source, "rb") as f:
        code = f.read()
    h = hashlib.sha256(code)
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
    try:
        subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), source, "-o", tmp],
                       capture_output=True, text=True, check=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
