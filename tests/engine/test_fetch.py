"""paxpage/launched.fetch: a step's results read back in one round trip on an accelerator (every
device-to-host copy started before the first is waited for), and on the CPU read in place."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from paxpage.launched import fetch


class _DeviceArray:
    """Stands for a jax.Array on a device of `platform`, logging copies started and reads."""

    def __init__(self, log: list, name: str, platform: str):
        self.log, self.name, self.platform = log, name, platform

    def devices(self):
        return [types.SimpleNamespace(platform=self.platform)]  # jax's is a set of Devices

    def copy_to_host_async(self):
        self.log.append(("copy", self.name))

    def __array__(self, dtype=None, copy=None):
        self.log.append(("read", self.name))
        return np.full(2, len(self.name), np.int32)


def test_accelerator_results_start_every_copy_before_reading_any():
    log = []
    results = (_DeviceArray(log, "tokens", "gpu"), None, {"logprobs": _DeviceArray(log, "lp", "gpu")})
    tokens, missing, rest = fetch(results)
    assert missing is None
    np.testing.assert_array_equal(tokens, [6, 6])
    np.testing.assert_array_equal(rest["logprobs"], [2, 2])
    assert sorted(log[:2]) == [("copy", "lp"), ("copy", "tokens")]  # both started ...
    assert {entry[0] for entry in log[2:]} == {"read"}  # ... before either is read


def test_host_memory_results_are_read_in_place():
    log = []
    (tokens,) = fetch((_DeviceArray(log, "tokens", "cpu"),))
    np.testing.assert_array_equal(tokens, [6, 6])
    assert log == [("read", "tokens")]  # no asynchronous copy of memory the host has


def test_real_arrays_and_none_leaves():
    got = fetch((jnp.arange(3), None))
    assert isinstance(got[0], np.ndarray) and got[1] is None
    np.testing.assert_array_equal(got[0], [0, 1, 2])
