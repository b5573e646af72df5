"""Renders the docs' figure tables and plots from the benchmark records in docs/benchmarks/*.json.

A page marks where a table goes:

    <!-- figures: throughput throughput -->
    (generated: the table and a line naming machine, versions, date, commit and command)
    <!-- /figures -->

The first word after "figures:" names the record (docs/benchmarks/throughput.json), the second
one of its "tables". A plot goes the same way from one of the record's "charts":

    <!-- chart: serving latency -->
    (generated: the image docs/figures/serving-latency.svg and the same provenance line)
    <!-- /chart -->

A record is what a benchmark script writes with --json (scripts/provenance.py: write_record), or
a transcription of an earlier measurement marked "source": "transcribed". A chart is

    {"kind": "line" | "bar", "title": ..., "xlabel": ..., "ylabel": ..., "xscale": "log2" (line, optional),
     "panels": [{"title": ...,
                 "series": [{"label": ..., "x": [...], "y": [...]}],        # kind "line"
                 "hline": {"y": ..., "label": ...},                         # optional
                 "bars": [{"label": ..., "value": v, "low": lo, "high": hi}]  # kind "bar"; low/high optional
                 }]}

Each SVG carries the SHA-256 of the chart, the provenance and the drawing code it was made from, so
the check below holds whatever matplotlib version draws it.

    python scripts/docs_figures.py           # rewrite the pages (README.md and docs/*.md) and plots
    python scripts/docs_figures.py --check   # exit 1 when a page or plot differs from its records
    python scripts/docs_figures.py --stale   # the records measured before their code last changed

tests/test_docs.py checks that the committed pages and plots are what this renders.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import inspect
import json
import os
import re
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from provenance import ENGINE_CODE, git  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "docs", "benchmarks")
FIGURES = os.path.join(ROOT, "docs", "figures")  # the plots, one SVG per chart block
BLOCK = re.compile(r"(<!-- figures: (\S+) (\S+) -->\n)(.*?)(<!-- /figures -->)", re.S)
CHART_BLOCK = re.compile(r"(<!-- chart: (\S+) (\S+) -->\n)(.*?)(<!-- /chart -->)", re.S)


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                              recursive=True))]


def load_record(name: str) -> dict:
    path = os.path.join(RECORDS, f"{name}.json")
    if not os.path.exists(path):
        raise ValueError(f"no benchmark record {os.path.relpath(path, ROOT)}")
    with open(path) as f:
        return json.load(f)


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def provenance_line(name: str, record: dict, page_dir: str, plot: bool = False) -> str:
    """The line under a table (a plot's leaves out the record's note, which its table's line has)."""
    p = record["provenance"]
    link = os.path.relpath(os.path.join(RECORDS, f"{name}.json"), page_dir)
    commit = f"at commit `{p['commit'][:7]}`" if p.get("commit") else "at a commit not recorded"
    if p.get("dirty"):
        commit += " with uncommitted changes"
    how = "Transcribed from an earlier write-up of a run" if p.get("source") == "transcribed" else "Measured"
    if plot:
        how = "Plotted from a run transcribed from an earlier write-up" if p.get("source") == "transcribed" \
            else "Plotted from a run"
    parts = [f"{how} on {p['machine']}", f"jax {p['jax']} / jaxlib {p['jaxlib']}", p["date"], commit]
    line = "*" + ", ".join(parts) + f": `{p['command']}`."
    if record.get("note") and not plot:
        line += f" {record['note'].rstrip('.')}."
    return line + f" Data: [{name}.json]({link}).*"


def render(name: str, table_id: str, page_dir: str) -> str:
    return render_record(name, load_record(name), table_id, page_dir)


def render_record(name: str, record: dict, table_id: str, page_dir: str) -> str:
    """One table of a record (read or not from docs/benchmarks/NAME.json) as the pages show it."""
    tables = record.get("tables") or {}
    if table_id not in tables:
        raise ValueError(f"docs/benchmarks/{name}.json has no table {table_id!r} (tables: {sorted(tables)}); "
                         "a script without doc_tables() writes none")
    table = tables[table_id]
    lines = []
    if table.get("caption"):
        lines += [table["caption"].rstrip(".") + ".", ""]
    lines.append("| " + " | ".join(_cell(c) for c in table["columns"]) + " |")
    lines.append("|" + "---|" * len(table["columns"]))
    for row in table["rows"]:
        if len(row) != len(table["columns"]):
            raise ValueError(f"docs/benchmarks/{name}.json table {table_id!r}: row {row} has {len(row)} cells, "
                             f"the columns {len(table['columns'])}")
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += ["", provenance_line(name, record, page_dir)]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- staleness
def staleness(record: dict) -> str | None:
    """A note when commits after the recorded one touch the measured code, else None."""
    commit = record["provenance"].get("commit")
    measures = record.get("measures") or list(ENGINE_CODE)
    if not commit:
        return "The commit this figure measured was not recorded, so its age against the code is unknown."
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None  # a shallow or foreign clone: nothing to compare against
    changes = git("rev-list", "--count", f"{commit}..HEAD", "--", *measures)
    if not changes or changes == "0":
        return None
    last = git("log", "-1", "--format=%h, %ad", "--date=short", f"{commit}..HEAD", "--", *measures)
    return (f"Older than the code it measures: {changes} commits since `{commit[:7]}` changed "
            f"{', '.join(f'`{m}`' for m in measures)} (the latest: {last}). Re-run the command to refresh it.")


# ------------------------------------------------------------------------------------------ charts
def chart_spec(name: str, chart_id: str) -> tuple[dict, dict]:
    record = load_record(name)
    charts = record.get("charts") or {}
    if chart_id not in charts:
        raise ValueError(f"docs/benchmarks/{name}.json has no chart {chart_id!r} (charts: {sorted(charts)})")
    chart = charts[chart_id]
    if chart.get("kind") not in ("line", "bar") or not chart.get("panels"):
        raise ValueError(f"docs/benchmarks/{name}.json chart {chart_id!r}: kind must be 'line' or 'bar' with "
                         f"panels, got kind {chart.get('kind')!r}")
    return chart, record


def chart_path(name: str, chart_id: str) -> str:
    return os.path.join(FIGURES, f"{name}-{chart_id}.svg")


def chart_digest(name: str, chart_id: str) -> str:
    """What the SVG must be drawn from: the chart, its provenance and the code that draws it."""
    chart, record = chart_spec(name, chart_id)
    text = json.dumps({"chart": chart, "provenance": record["provenance"],
                       "drawing": inspect.getsource(draw_chart)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def svg_digest(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        m = re.search(r"paxpage-chart sha256:([0-9a-f]{64})", f.read())
    return m.group(1) if m else None


def draw_chart(name: str, chart_id: str, path: str | None = None) -> str:
    """Draws the chart as SVG (deterministic for one matplotlib version) with the machine, date
    and commit in its footer; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart, record = chart_spec(name, chart_id)
    path = path or chart_path(name, chart_id)
    panels = chart["panels"]
    with matplotlib.rc_context({"svg.hashsalt": "paxpage", "svg.fonttype": "none", "font.size": 9}):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 3.8), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            if chart["kind"] == "line":
                for series in panel["series"]:
                    ax.plot(series["x"], series["y"], marker="o", label=series["label"])
                if chart.get("xscale") == "log2":
                    xs = sorted({x for series in panel["series"] for x in series["x"]})
                    ax.set_xscale("log", base=2)
                    if xs:
                        ax.set_xticks(xs, [f"{x:g}" for x in xs])
                ax.set_ylim(bottom=0)
            else:
                bars = panel["bars"]
                ys = range(len(bars))[::-1]
                values = [b["value"] for b in bars]
                err = [[b["value"] - b.get("low", b["value"]) for b in bars],
                       [b.get("high", b["value"]) - b["value"] for b in bars]]
                ax.barh(list(ys), values, xerr=err if any(map(any, err)) else None, capsize=3, color="tab:blue")
                ax.set_yticks(list(ys), [b["label"] for b in bars])
                for y, b in zip(ys, bars):
                    ax.text(b.get("high", b["value"]), y, "  " + b.get("text", f"{b['value']:g}"), va="center")
                ax.set_xlim(0, max(b.get("high", b["value"]) for b in bars) * 1.25)
            if panel.get("hline"):
                line = panel["hline"]
                ax.axhline(line["y"], color="grey", linestyle="--", linewidth=1, label=line["label"])
            ax.set_xlabel(chart.get("xlabel", ""))
            if ax is axes[0][0] or chart["kind"] == "line":
                ax.set_ylabel(chart.get("ylabel", ""))
            ax.set_title(panel.get("title", ""))
            ax.grid(alpha=0.3)
            if chart["kind"] == "line":
                ax.legend(fontsize="small")
        p = record["provenance"]
        how = "transcribed" if p.get("source") == "transcribed" else "measured"
        commit = p["commit"][:7] if p.get("commit") else "commit not recorded"
        fig.suptitle(textwrap.fill(chart.get("title", ""), 62 * len(panels)), fontsize="medium")
        fig.text(0.01, 0.01, f"{how} on {p['machine']}, jax {p['jax']}, {p['date']}\n{commit}, "
                             f"docs/benchmarks/{name}.json", fontsize=7, color="grey")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        svg = path.endswith(".svg")  # another suffix (.png) only to look at it
        fig.savefig(path, metadata={"Date": None, "Description": f"paxpage-chart sha256:{chart_digest(name, chart_id)}"}
                    if svg else None, dpi=None if svg else 100)
        plt.close(fig)
    return path


def render_chart(name: str, chart_id: str, page_dir: str) -> str:
    chart, record = chart_spec(name, chart_id)
    image = os.path.relpath(chart_path(name, chart_id), page_dir)
    alt = _cell(chart.get("title") or f"{name} {chart_id}").replace("[", "(").replace("]", ")")
    return f"![{alt}]({image})\n\n{provenance_line(name, record, page_dir, plot=True)}\n"


# ------------------------------------------------------------------------------------------ pages
def rendered(path: str) -> str:
    with open(path) as f:
        text = f.read()
    page_dir = os.path.dirname(path)
    text = BLOCK.sub(lambda m: m.group(1) + render(m.group(2), m.group(3), page_dir) + m.group(5), text)
    return CHART_BLOCK.sub(lambda m: m.group(1) + render_chart(m.group(2), m.group(3), page_dir) + m.group(5), text)


def charts_shown() -> list[tuple[str, str]]:
    """(record, chart) of every chart block on the pages."""
    out = []
    for path in pages():
        with open(path) as f:
            out += [(m.group(2), m.group(3)) for m in CHART_BLOCK.finditer(f.read())]
    return sorted(set(out))


def stale_charts() -> list[str]:
    """Plots missing or drawn from other data than their record's chart, and SVGs no page shows."""
    shown = charts_shown()
    out = [os.path.relpath(chart_path(n, c), ROOT) for n, c in shown if svg_digest(chart_path(n, c)) != chart_digest(n, c)]
    wanted = {chart_path(n, c) for n, c in shown}
    out += [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(FIGURES, "*.svg"))) if p not in wanted]
    return out


def differing_pages() -> list[str]:
    out = []
    for path in pages():
        with open(path) as f:
            if f.read() != rendered(path):
                out.append(os.path.relpath(path, ROOT))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report pages that differ; exit 1 if any")
    parser.add_argument("--stale", action="store_true",
                        help="only list the records whose measured code changed after the commit they measured")
    args = parser.parse_args(argv)
    if args.stale:
        for path in sorted(glob.glob(os.path.join(RECORDS, "*.json"))):
            name = os.path.basename(path)[:-len(".json")]
            note = staleness(load_record(name))
            if note:
                print(f"{name}: {note}")
        return 0
    if args.check:
        stale = differing_pages() + stale_charts()
        for path in stale:
            print(f"{path}: differs from docs/benchmarks/ (run python scripts/docs_figures.py)")
        return 1 if stale else 0
    shown = charts_shown()
    for name, chart_id in shown:
        if svg_digest(chart_path(name, chart_id)) != chart_digest(name, chart_id):
            print(f"drew {os.path.relpath(draw_chart(name, chart_id), ROOT)}")
    wanted = {chart_path(n, c) for n, c in shown}
    for path in sorted(glob.glob(os.path.join(FIGURES, "*.svg"))):
        if path not in wanted:
            os.remove(path)
            print(f"removed {os.path.relpath(path, ROOT)} (no page shows it)")
    for path in pages():
        new = rendered(path)
        with open(path) as f:
            old = f.read()
        if new != old:
            with open(path, "w") as f:
                f.write(new)
            print(f"rewrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
