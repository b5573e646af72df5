"""The kernel matrices' default tier: in the Pallas interpreter (CPU) a case costs seconds, so the
default run checks every kernel on two configurations that hold both dtypes, both head dims, GQA
and MHA (kernel_cases.CORE_CONFIGS), and quantised pools in int8 and fp8 on one each. The other
configurations belong to the extended tier (`--extended`; scripts/device_check.sh runs them all
compiled on the accelerator); single parameters of a file's own are marked there."""

from __future__ import annotations

import pytest

from kernel_cases import CORE_CONFIGS, QUANT_CASES, config_id, quant_case_id

CORE_IDS = {config_id(cfg) for cfg in CORE_CONFIGS}
CORE_QUANT_IDS = {quant_case_id(qc) for qc in QUANT_CASES[:2]}  # int8 and fp8, one configuration each


def _outside_the_core(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "qc" in params:
        return quant_case_id(params["qc"]) not in CORE_QUANT_IDS
    return "cfg" in params and config_id(params["cfg"]) not in CORE_IDS


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _outside_the_core(item):
            item.add_marker(pytest.mark.extended)
