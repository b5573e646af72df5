"""Source-level checks: what docstrings point at exists, no private imports from transformers,
and pyproject.toml uses the non-deprecated license form."""

from __future__ import annotations

import ast
import glob
import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("paxpage", "models", "pallas_kernels", "scripts")


def _sources() -> list[str]:
    return sorted(p for pkg in PACKAGES for p in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True))


def test_no_private_transformers_imports():
    # transformers renames or removes its underscore names between releases without notice.
    bad = []
    for path in _sources():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                bad += [f"{os.path.relpath(path, ROOT)}: {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_referenced_documents_exist():
    # Absolute paths and *.md / *.txt files named in the code must be part of the repository.
    missing = []
    for path in _sources():
        text = open(path).read()
        for ref in re.findall(r"(/work/\S+|\b[\w./-]+\.(?:md|txt|rst)\b)", text):
            if ref.startswith("/work/") or not os.path.exists(os.path.join(ROOT, ref)):
                missing.append(f"{os.path.relpath(path, ROOT)}: {ref}")
    assert not missing, missing


def test_pyproject_license_is_an_spdx_string():
    # The {text = ...} table form makes setuptools >= 77 warn on every install (PEP 639).
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert isinstance(project["license"], str), project["license"]
