"""The user documentation stays true: it builds strictly (broken links and anchors fail), its option
tables name every EngineConfig / SamplingParams field and CLI flag and nothing that is gone, its
runnable examples run, and its figure tables are what docs/benchmarks/*.json renders to."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import docs_figures  # noqa: E402
import mkdocs_hooks  # noqa: E402

OPTIONS_BLOCK = re.compile(r"<!-- options: (.+?) -->\n(.*?)<!-- /options -->", re.S)
RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)^```", re.S | re.M)


def _pages() -> list[str]:
    return sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


# ------------------------------------------------------------------------------------ strict build
def _build(config_dir: str, site_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           os.path.join(config_dir, "mkdocs.yml"), "-d", site_dir],
                          cwd=config_dir, capture_output=True, text=True, timeout=120)


def test_docs_build_strictly(tmp_path):
    proc = _build(ROOT, str(tmp_path / "site"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "engine-options" / "index.html").exists()
    # The hook (scripts/mkdocs_hooks.py) marks figures measured before their code last changed.
    if _has_history():
        assert "Older than the code it measures" in (tmp_path / "site" / "benchmarks" / "index.html").read_text()


def _has_history() -> bool:
    old = "36a1557b52b30f081f56db902e51c0b5c05104ce"  # the commit the H200 kernel figures measured
    return subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{old}^{{commit}}"],
                          capture_output=True).returncode == 0


def test_a_broken_link_fails_the_build(tmp_path):
    # The strict build above must be able to fail: the same docs with one link to a missing page.
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), copy / "mkdocs.yml")
    shutil.copytree(os.path.join(ROOT, "scripts"), copy / "scripts",
                    ignore=shutil.ignore_patterns("figures", "__pycache__"))
    with open(copy / "docs" / "index.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md#nowhere).\n")
    proc = _build(str(copy), str(tmp_path / "site"))
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stdout + proc.stderr


def test_paxpage_docs_command(tmp_path):
    from paxpage.docs_cli import mkdocs_command

    build = mkdocs_command(argparse.Namespace(build=True, port=8000))
    assert build[1:4] == ["-m", "mkdocs", "build"] and "--strict" in build
    serve = mkdocs_command(argparse.Namespace(build=False, port=8123))
    assert serve[-2:] == ["-a", "127.0.0.1:8123"]
    with pytest.raises(ValueError, match="--port must be in 1..65535, got 0"):
        mkdocs_command(argparse.Namespace(build=False, port=0))


# ----------------------------------------------------------------------------------- option tables
def _cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """{"paxpage": the top-level parser, "paxpage generate": ..., ...}, as paxpage.cli builds them."""
    from paxpage import cli

    class Built(Exception):
        pass

    def capture(self, args=None, namespace=None):
        raise Built(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        cli.main([])
    except Built as built:
        top = built.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    parsers = {"paxpage": top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update({f"paxpage {name}": sub for name, sub in action.choices.items()})
    return parsers


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            for s in a.option_strings if s.startswith("--")}


def documented_options() -> dict[str, tuple[str, list[str]]]:
    """{table name: (page, the first cell's `name` of every row)} over every docs page."""
    tables = {}
    for path in _pages():
        for name, body in OPTIONS_BLOCK.findall(_read(path)):
            assert name not in tables, f"two option tables named {name!r}: {tables[name][0]} and {path}"
            rows = [line for line in body.splitlines() if line.startswith("|")][2:]
            names = [re.match(r"\|\s*`([^`]+)`", row).group(1) for row in rows]
            tables[name] = (os.path.relpath(path, ROOT), names)
    return tables


def expected_options() -> dict[str, set[str]]:
    from paxpage import EngineConfig, SamplingParams

    expected = {"EngineConfig": set(EngineConfig.field_names()),
                "SamplingParams": {f.name for f in dataclasses.fields(SamplingParams)}}
    expected.update({name: _flags(p) for name, p in _cli_parsers().items()})
    return expected


def option_table_problems(expected: dict[str, set[str]], documented: dict[str, tuple[str, list[str]]]) -> list[str]:
    problems = []
    for table, names in sorted(expected.items()):
        if table not in documented:
            if names:
                problems.append(f"no option table for {table!r} (it has {sorted(names)}): add a table between "
                                f"<!-- options: {table} --> and <!-- /options --> to a docs page")
            continue
        page, rows = documented[table]
        for name in sorted(names - set(rows)):
            problems.append(f"{table} option {name!r} has no row in the options table {table!r} of {page}: "
                            f"add | `{name}` | default | meaning |")
        for name in sorted(set(rows) - names):
            problems.append(f"the options table {table!r} of {page} has a row for {name!r}, which {table} no "
                            "longer has: remove it")
        duplicates = sorted({n for n in rows if rows.count(n) > 1})
        if duplicates:
            problems.append(f"the options table {table!r} of {page} lists {duplicates} twice")
    for table in sorted(set(documented) - set(expected)):
        problems.append(f"the options table {table!r} of {documented[table][0]} documents nothing that exists")
    return problems


def test_option_tables_name_every_option_and_no_removed_one():
    problems = option_table_problems(expected_options(), documented_options())
    assert not problems, "\n".join(problems)


def test_option_table_check_names_what_is_missing_or_gone():
    # The check above must fail, and say which option, when a field is added or a row outlives one.
    documented = documented_options()
    expected = expected_options()
    expected["EngineConfig"] = expected["EngineConfig"] | {"an_unlisted_field"}
    expected["paxpage serve"] = expected["paxpage serve"] - {"--precompile"}
    problems = option_table_problems(expected, documented)
    assert any("'an_unlisted_field' has no row" in p and "docs/engine-options.md" in p for p in problems), problems
    assert any("row for '--precompile', which paxpage serve no longer has" in p for p in problems), problems
    assert len(problems) == 2, problems


# -------------------------------------------------------------------------------- runnable examples
def runnable_blocks() -> list[tuple[str, str]]:
    return [(os.path.relpath(path, ROOT), code) for path in _pages() for code in RUNNABLE.findall(_read(path))]


def test_runnable_blocks_are_marked():
    # The examples the docs promise to run: at least the engine-options and structured-outputs ones.
    pages = {page for page, _ in runnable_blocks()}
    assert {"docs/engine-options.md", "docs/structured-outputs.md"} <= pages, pages


@pytest.mark.slow
def test_runnable_blocks_run(smollm2, monkeypatch):
    import paxpage

    load = paxpage.load
    # One loaded default model for every block (a block's own `paxpage.load()` gets it).
    monkeypatch.setattr(paxpage, "load", lambda *a, **kw: smollm2 if not a and not kw else load(*a, **kw))
    for page, code in runnable_blocks():
        try:
            exec(compile(code, f"<runnable block of {page}>", "exec"), {"__name__": "__docs__"})
        except Exception as e:
            raise AssertionError(f"a runnable block of {page} failed: {type(e).__name__}: {e}\n{code}") from e


# ---------------------------------------------------------------------------------------- figures
def test_figure_tables_equal_their_records():
    stale = docs_figures.differing_pages()
    assert not stale, f"{stale}: the figure tables differ from docs/benchmarks/ (run python scripts/docs_figures.py)"
    stale = docs_figures.stale_charts()
    assert not stale, f"{stale}: plots not drawn from docs/benchmarks/ (run python scripts/docs_figures.py)"
    assert docs_figures.charts_shown(), "no page shows a plot"


def test_a_plot_is_redrawn_when_its_record_changes(tmp_path, monkeypatch):
    name, chart_id = docs_figures.charts_shown()[0]
    path = tmp_path / "plot.svg"
    docs_figures.draw_chart(name, chart_id, str(path))
    assert docs_figures.svg_digest(str(path)) == docs_figures.chart_digest(name, chart_id)
    text = path.read_text()
    assert "<svg" in text and docs_figures.load_record(name)["provenance"]["date"] in text  # the footer
    # The same record with one value changed: the committed SVG no longer matches.
    record = docs_figures.load_record(name)
    record["charts"][chart_id]["panels"][0].setdefault("title", "")
    record["charts"][chart_id]["panels"][0]["title"] += " changed"
    load = docs_figures.load_record
    monkeypatch.setattr(docs_figures, "load_record", lambda n: record if n == name else load(n))
    assert os.path.relpath(docs_figures.chart_path(name, chart_id), ROOT) in docs_figures.stale_charts()


def test_every_record_names_its_provenance_and_is_shown():
    shown = set()
    for path in docs_figures.pages():
        shown |= {name for name in re.findall(r"<!-- (?:figures|chart): (\S+) \S+ -->", _read(path))}
    for path in sorted(glob.glob(os.path.join(DOCS, "benchmarks", "*.json"))):
        name = os.path.basename(path)[:-len(".json")]
        with open(path) as f:
            record = json.load(f)
        p = record["provenance"]
        for key in ("machine", "jax", "jaxlib", "date", "command", "commit", "source"):
            assert key in p, f"{name}.json: provenance has no {key!r}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", p["date"]), (name, p["date"])
        assert p["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", p["commit"]), (name, p["commit"])
        assert p["source"] in ("measured", "transcribed"), (name, p["source"])
        assert record.get("measures"), f"{name}.json names no measured code"
        assert name in shown, f"docs/benchmarks/{name}.json is shown on no page"


def test_rendered_figures_name_machine_versions_date_and_commit():
    text = docs_figures.render("kernels_h200", "kernels", DOCS)
    assert "NVIDIA H200" in text and "jax 0.11.2" in text and "2026-11-30" in text
    assert "at commit `36a1557`" in text and "| 64 | 32768 | decode (Triton lowering) | 1156 |" in text
    with pytest.raises(ValueError, match="no table 'nope'"):
        docs_figures.render("kernels_h200", "nope", DOCS)


def test_a_figure_older_than_its_code_says_so():
    if not _has_history():
        pytest.skip("needs the repository's git history")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    old = "36a1557b52b30f081f56db902e51c0b5c05104ce"
    record = {"provenance": {"commit": old}, "measures": ["pallas_kernels"]}
    note = mkdocs_hooks.staleness(record)
    assert note and note.startswith("Older than the code it measures") and "`36a1557`" in note
    assert mkdocs_hooks.staleness({"provenance": {"commit": head.stdout.strip()}, "measures": ["README.md"]}) is None
    assert "not recorded" in mkdocs_hooks.staleness({"provenance": {"commit": None}, "measures": ["paxpage"]})
    # The built page puts the note under the table and under the plot of such a record.
    page = ("<!-- figures: kernels_h200 kernels -->\nT\n<!-- /figures -->\n\n"
            "<!-- chart: kernels_h200 bandwidth -->\nP\n<!-- /chart -->\n")
    built = mkdocs_hooks.on_page_markdown(page, None, None, None)
    assert built.count("!!! note\n    Older than the code it measures") == 2, built
