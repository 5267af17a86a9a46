"""`cacheproxy compare --report FILE.html`: the comparison as one self-contained HTML page.

The plot (first divergence against the stored margin; exact against parsed rates) is drawn
with matplotlib, an optional dependency (`pip install 'cacheproxy[report]'`) and embedded as
a PNG, so the page is one file a CI job can keep as an artifact.
"""

from __future__ import annotations

import base64
import io
from html import escape
from typing import Any


def require_matplotlib() -> None:
    """Fail before any work when the report cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--report needs matplotlib: pip install 'cacheproxy[report]'") from None


def plot_png(report: dict[str, Any]) -> bytes:
    """First divergence vs stored margin, and the two rates, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8),
                                      gridspec_kw={"width_ratios": [3, 1]})
    exact = [(e["margin"]["at"], e["margin"]["smallest"]) for e in report["entries"]
             if e["exact"] and e["margin"] and e["margin"]["smallest"] is not None]
    rows = [d for d in report["divergences"]["entries"] if d["first_divergence"] is not None]
    known = [(d["first_divergence"], d["gap_at_divergence"]) for d in rows
             if d["gap_at_divergence"] is not None]
    bounded = [(d["first_divergence"], d["gap_at_divergence_at_least"]) for d in rows
               if d["gap_at_divergence_at_least"] is not None]
    for points, style in ((exact, {"color": "tab:green", "label": "exact: smallest gap"}),
                          (known, {"color": "tab:red", "label": "diverged: gap there"}),
                          (bounded, {"color": "tab:red", "marker": "^",
                                     "label": "diverged: gap there at least"})):
        if points:
            left.scatter(*zip(*points, strict=True), alpha=0.7, **style)
    left.set_xlabel("token index (diverged: first divergence; exact: its smallest gap)")
    left.set_ylabel("stored answer's gap (logits)")
    left.set_yscale("symlog", linthresh=1e-3)
    if left.get_legend_handles_labels()[0]:
        left.legend()
    rates = [report["exact_match_rate"], report["parsed_match_rate"]]
    right.bar(["exact", "parsed"], [100 * r for r in rates], color=["tab:blue", "tab:orange"])
    right.set_ylim(0, 100)
    right.set_ylabel("match rate (%)")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _row(e: dict[str, Any]) -> str:
    margin = e["margin"] or {}
    cells = [e["key"].partition("/")[2][:16], "yes" if e["exact"] else "no",
             "" if e["first_divergence"] is None else str(e["first_divergence"]),
             "yes" if e["parsed_equal"] else "no", e["compared_by"],
             "" if margin.get("smallest") is None else f"{margin['smallest']:.4g}",
             "" if margin.get("at") is None else str(margin["at"]),
             e["stored_text"], "" if e["exact"] else e["candidate_text"]]
    return "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"


def render(report: dict[str, Any]) -> str:
    """The page."""
    png = base64.b64encode(plot_png(report)).decode()
    fps = report["fingerprints"]
    differ = "".join(f"<li><b>{escape(n)}</b>: {escape(str(p['stored']))} &rarr; "
                     f"{escape(str(p['candidate']))}</li>" for n, p in fps["differ"].items())
    unchecked = "".join(f"<li>{escape(u)}</li>" for u in report["unchecked"])
    heads = ["key", "exact", "diverges at", "parsed equal", "compared by", "margin",
             "margin at", "stored", "candidate"]
    rows = "".join(_row(e) for e in report["entries"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cacheproxy compare</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:90%;vertical-align:top}}
td:nth-last-child(-n+2){{font-family:monospace;white-space:pre-wrap;max-width:30em}}</style>
</head><body>
<h1>cacheproxy compare</h1>
<p>{report['checked']} entries of namespace <code>{escape(report['namespace'])}</code>
replayed on <code>{escape(report['candidate'])}</code>
(<code>{escape(fps['candidate']['digest'])}</code>).</p>
<p><b>exact-match rate {report['exact_match_rate']:.1%}</b>,
<b>parsed-match rate {report['parsed_match_rate']:.1%}</b></p>
<h2>What differs between the fingerprints</h2><ul>{differ or '<li>nothing</li>'}</ul>
<p>Checked: {escape(', '.join(report['checks']))}.</p>
{f'<p>Not checked:</p><ul>{unchecked}</ul>' if unchecked else ''}
<img alt="first divergence vs margin; match rates" src="data:image/png;base64,{png}">
<h2>Entries</h2>
<table><tr>{''.join(f'<th>{h}</th>' for h in heads)}</tr>{rows}</table>
</body></html>
"""
