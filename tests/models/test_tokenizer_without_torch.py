"""Without torch (a plain install), paxpage's tokenizer loading prints no "PyTorch was not found"
notice, and leaves transformers' other logging alone. Each check runs in a fresh interpreter where
`import torch` fails, as it does when the test extras are not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.models.test_loading import tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTICE = "PyTorch was not found"
BLOCK_TORCH = "import sys; sys.modules['torch'] = None  # `import torch` now raises ImportError\n"


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_transformers_prints_the_notice_without_torch():
    """The control: the shim does hide torch, and transformers still words its notice this way."""
    proc = run_without_torch("import transformers")
    assert proc.returncode == 0, proc.stderr
    assert NOTICE in proc.stderr


def test_tokenizer_loading_without_torch_is_quiet(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    proc = run_without_torch(f"""
        import logging
        from models.tokenizer import load_tokenizer
        auto = load_tokenizer({str(tmp_path)!r})  # AutoTokenizer
        fast = load_tokenizer({str(tmp_path)!r}, fast_class=True)
        print(auto.encode("hello world"), fast.encode("hello world"))
        assert not logging.getLogger("transformers").filters
        from transformers.utils import logging as hf_logging
        hf_logging.get_logger("transformers").warning("other warnings still show")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[3,", "4]", "[3,", "4]"]
    assert NOTICE not in proc.stderr
    assert "other warnings still show" in proc.stderr
