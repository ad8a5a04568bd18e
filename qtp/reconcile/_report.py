"""The three renderings of a ReconcileResult: a terminal table, a JSON file, an HTML page with a PNG chart."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from qtp.reconcile._classify import CLASSES, VIOLATIONS
from qtp.reconcile._job import ReconcileResult

_COLOURS = {"ok": "#4c9a2a", "in_doubt": "#999999", "compensated": "#2a7f9a"}
_VIOLATION_COLOUR = "#c0392b"


def summary_table(result: ReconcileResult) -> str:
    """The verdict and the count of every class, as aligned text for a terminal."""
    meta = result.metadata
    width = max(len(name) for name in CLASSES)
    lines = [f"{'class':<{width}}  {'keys':>12}"]
    lines.append("-" * len(lines[0]))
    for name in CLASSES:
        flag = "  <- violation" if name in VIOLATIONS and result.counts[name] else ""
        lines.append(f"{name:<{width}}  {result.counts[name]:>12,}{flag}")
    if result.duplicate_histogram:
        hist = ", ".join(f"{k}x: {v:,}" for k, v in sorted(result.duplicate_histogram.items()))
        lines.append(f"duplicates by multiplicity: {hist}")
    differing = {k: v for k, v in result.mismatched_columns.items() if v}
    if differing:
        lines.append("mismatches by column: " + ", ".join(f"{k}: {v:,}" for k, v in differing.items()))
    if result.counts["in_doubt"]:
        lines.append(f"in doubt and applied on the server: {result.in_doubt_applied:,}")
    if meta:
        lines.append(
            f"client rows {meta['client']['rows']:,}, server rows {meta['server']['rows']:,}, "
            f"{meta['seconds']:.1f}s"
        )
    lines.append(f"verdict: {result.verdict}")
    return "\n".join(lines)


def write_json(result: ReconcileResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")


def chart_png(result: ReconcileResult) -> bytes:
    """A horizontal bar chart of the classes (log scale, so that a handful of anomalies stays visible)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = list(CLASSES)
    values = [result.counts[name] for name in names]
    colours = [_COLOURS.get(name, _VIOLATION_COLOUR) for name in names]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    try:
        bars = ax.barh(names[::-1], [max(v, 0.8) for v in values[::-1]], color=colours[::-1])
        ax.set_xscale("log")
        ax.set_xlabel("keys (log scale)")
        ax.set_title(f"qtp reconcile: {result.verdict}")
        for bar, value in zip(bars, values[::-1]):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:,}", va="center", fontsize=8)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)


def write_html(result: ReconcileResult, path: str | Path) -> Path:
    """The HTML report; its chart is written beside it as ``<name>.png`` and embedded as well.

    Returns the PNG's path.
    """
    path = Path(path)
    png = chart_png(result)
    png_path = path.with_suffix(".png")
    png_path.write_bytes(png)
    meta = result.metadata
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>qtp reconcile report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
        ".violated{color:#c0392b}.ok{color:#4c9a2a}code{font-size:90%}</style></head><body>",
        f"<h1>Reconciliation: <span class='{'ok' if result.exactly_once else 'violated'}'>"
        f"{html.escape(result.verdict)}</span></h1>",
        f"<img alt='classes' src='data:image/png;base64,{base64.b64encode(png).decode()}'>",
        _counts_table(result),
        _metadata_table(meta) if meta else "",
        "<h2>Samples</h2>",
    ]
    names = [c["name"] for c in meta.get("columns", [])] if meta else []
    for cls, rows in result.samples.items():
        if rows:
            parts.append(_samples_table(cls, rows, names, result.counts[cls]))
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return png_path


def _counts_table(result: ReconcileResult) -> str:
    rows = "".join(
        f"<tr><td>{name}</td><td>{result.counts[name]:,}</td></tr>" for name in CLASSES
    )
    extra = []
    if result.duplicate_histogram:
        extra.append("duplicates by multiplicity: " + ", ".join(
            f"{k}&times;: {v:,}" for k, v in sorted(result.duplicate_histogram.items())))
    if any(result.mismatched_columns.values()):
        extra.append("mismatches by column: " + ", ".join(
            f"{html.escape(k)}: {v:,}" for k, v in result.mismatched_columns.items() if v))
    extra.append(f"in doubt and applied on the server: {result.in_doubt_applied:,}")
    return (f"<h2>Classes</h2><table><tr><th>class</th><th>keys</th></tr>{rows}</table>"
            + "".join(f"<p>{line}</p>" for line in extra))


def _metadata_table(meta: dict) -> str:
    def side(s: dict) -> str:
        status = f", status column {s['status_column']}" if s.get("status_column") else ""
        return html.escape(f"{s['url']} table {s['table']} (key {s['key']}{status}): {s['rows']:,} rows")

    rows = [
        ("client", side(meta["client"])),
        ("server", side(meta["server"])),
        ("columns", html.escape(", ".join(f"{c['client']} = {c['server']}" for c in meta["columns"]))),
        ("started", html.escape(meta["started_at"])),
        ("finished", html.escape(meta["finished_at"])),
        ("seconds", f"{meta['seconds']:.1f}"),
        ("spark", html.escape(json.dumps(meta["spark"]))),
    ]
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<h2>Run</h2><table>{body}</table>"


def _samples_table(cls: str, rows: list[dict], names: list[str], total: int) -> str:
    head = "".join(
        f"<th>client {html.escape(n)}</th><th>server {html.escape(n)}</th>" for n in names
    )
    body = []
    for row in rows:
        cells = [html.escape(str(row["key"])), html.escape(row["status"] or "(not sent)"), str(row["copies"])]
        client, server = row["client"] or {}, row["server"] or {}
        for name in names:
            mark = " class='violated'" if name in (row.get("differing") or []) else ""
            cells.append(f"<span{mark}>{html.escape(str(client.get(name, '')))}</span>")
            cells.append(f"<span{mark}>{html.escape(str(server.get(name, '')))}</span>")
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<h3>{html.escape(cls)} ({len(rows)} of {total:,})</h3><table><tr><th>key</th><th>client status"
            f"</th><th>server copies</th>{head}</tr>{''.join(body)}</table>")
