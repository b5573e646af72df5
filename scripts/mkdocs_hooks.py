"""MkDocs hook (mkdocs.yml): beside every figure table and plot (scripts/docs_figures.py) the built
site says when the code the figure measures has changed since the commit it was measured at."""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_figures  # noqa: E402
from docs_figures import staleness  # noqa: E402,F401  (what the note says)

_BLOCK_END = re.compile(r"(<!-- (figures|chart): (\S+) \S+ -->\n.*?<!-- /\2 -->)", re.S)


def on_page_markdown(markdown: str, page, config, files) -> str:
    def note(m: re.Match) -> str:
        text = staleness(docs_figures.load_record(m.group(3)))
        return m.group(1) + (f"\n\n!!! note\n    {text}\n" if text else "")

    return _BLOCK_END.sub(note, markdown)
