"""Source-level checks: what docstrings point at exists, no private imports from transformers,
pyproject.toml uses the non-deprecated license form, and no text tells how the code was built."""

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


def _text_files() -> list[str]:
    patterns = ["README.md", "mkdocs.yml", "pyproject.toml", ".ci/*", "docs/**/*.md", "docs/**/*.json",
                *(f"{pkg}/**/*.{ext}" for pkg in (*PACKAGES, "tests") for ext in ("py", "sh", "cc", "h"))]
    return sorted({p for pattern in patterns for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)})


# Words of a diary, not of a manual: the repository describes what the code does today, and git
# holds how it got there. pytest's scope="session" is an API name, not such a word.
HISTORY_WORDS = re.compile(r"\bsessions?\b|\bissues? ?#?\d+|\bthe issue'?s?\b|\bround of work\b", re.I)


def test_no_history_of_how_it_was_built():
    found = []
    for path in _text_files():
        if os.path.samefile(path, __file__):  # its examples below must name the words
            continue
        for number, line in enumerate(open(path, encoding="utf-8"), 1):
            match = HISTORY_WORDS.search(line.replace('scope="session"', ""))
            if match:
                found.append(f"{os.path.relpath(path, ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_history_words_are_caught():
    # The check above must be able to fail.
    for line in ("Measured in the ninth session", "see issue 11's goal", "as in issue #38", "The issue's targets"):
        assert HISTORY_WORDS.search(line), line
    assert not HISTORY_WORDS.search('@pytest.fixture(scope="session")'.replace('scope="session"', ""))
