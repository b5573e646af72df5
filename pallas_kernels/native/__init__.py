"""Native CPU kernels (C++ XLA FFI custom calls), built on first use: see build.py."""
