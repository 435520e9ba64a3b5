"""``actlake report``: one self-contained HTML page (Vega inlined, works offline) plus a PNG per chart.

Every number in the report comes from SQL over the run's tables, the same
queries a user can run with ``actlake sql``.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from actlake.errors import StorageError
from actlake.storage.layout import RunLayout

OUTLIER_Z = 5.0
"""|robust z| above which a dimension is marked as an outlier in the report."""


def _charts(con) -> list[tuple[str, str, object]]:
    """(slug, title, altair chart) for every chart whose tables exist."""
    import altair as alt

    alt.data_transformers.disable_max_rows()
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    charts = []
    if "dim_moments" in have:
        df = con.execute(f"""
            SELECT layer, dim, mean, robust_z, abs(robust_z) > {OUTLIER_Z} AS outlier FROM outliers ORDER BY layer, dim
        """).df()
        c = alt.Chart(df).mark_circle(size=12).encode(
            x=alt.X("dim:Q", title="dimension"),
            y=alt.Y("mean:Q", title="mean over all tokens"),
            color=alt.Color("outlier:N", title=f"|robust z| > {OUTLIER_Z:g}", scale=alt.Scale(range=["#9aa5b1", "#d62728"])),
            tooltip=["layer", "dim", alt.Tooltip("mean:Q", format=".3f"), alt.Tooltip("robust_z:Q", format=".1f")],
        ).properties(width=640, height=90).facet(row=alt.Row("layer:O", title="layer (0 = embeddings)"))
        charts.append(("dim_means", "Per-dimension mean of the residual stream by layer, outliers marked", c))
    if "attention_mass" in have:
        df = con.execute("""
            SELECT layer, key_category, avg(mean_mass) AS mean_mass FROM attention_mass_by_key
            GROUP BY layer, key_category ORDER BY layer
        """).df()
        c = alt.Chart(df).mark_bar().encode(
            x=alt.X("layer:O", title="layer"),
            y=alt.Y("mean_mass:Q", title="mean attention per query (avg over heads)", stack="zero"),
            color=alt.Color("key_category:N", title="key category"),
            tooltip=["layer", "key_category", alt.Tooltip("mean_mass:Q", format=".3f")],
        ).properties(width=420, height=260)
        charts.append(("attention_mass", "Attention mass by key category per layer", c))
    if "residual_norms" in have:
        df = con.execute("""
            SELECT layer, avg(norm) AS mean, quantile_cont(norm, 0.1) AS p10, quantile_cont(norm, 0.5) AS median,
                   quantile_cont(norm, 0.9) AS p90 FROM residual_norms GROUP BY layer ORDER BY layer
        """).df()
        base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer (0 = embeddings)"))
        c = (base.mark_area(opacity=0.25).encode(y=alt.Y("p10:Q", title="||h|| (10th-90th percentile band)"), y2="p90:Q")
             + base.mark_line(point=True).encode(y="median:Q", tooltip=["layer", alt.Tooltip("median:Q", format=".2f"),
                                                                         alt.Tooltip("mean:Q", format=".2f")])
             ).properties(width=420, height=260)
        charts.append(("residual_norms", "Residual-stream norm by layer (median, 10th-90th percentile)", c))
    return charts


def _summary_html(layout: RunLayout) -> str:
    if not layout.summary_json.exists():
        return ""
    s = json.loads(layout.summary_json.read_text())
    rows = [("documents", s.get("docs")), ("windows", s.get("windows")), ("tokens", s.get("tokens")),
            ("padded tokens / real tokens", f"{s.get('padded_fraction', 0):.3f}"),
            ("shards", s.get("shards")), ("wall time (s)", f"{s.get('wall_seconds', 0):.1f}")]
    rows += [(f"rejected: {k}", v) for k, v in sorted(s.get("rejects", {}).items())]
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table class='summary'>{cells}</table>"


def build_report(run_dir: str | Path) -> Path:
    """Write ``report/report.html`` and ``report/<chart>.png``; return the HTML path."""
    import vl_convert as vlc

    from actlake.storage.sql import open_run

    layout = RunLayout(Path(run_dir).resolve())
    if not (layout.tables / "dim_moments").exists() and not (layout.tables / "residual_norms").exists():
        raise StorageError(f"{layout.root}: no reduced tables to report on (did the job finish?)")
    con = open_run(layout.root)
    try:
        charts = _charts(con)
    finally:
        con.close()
    layout.report.mkdir(parents=True, exist_ok=True)
    sections, specs = [], {}
    for slug, title, chart in charts:
        spec = chart.to_dict()
        specs[slug] = spec
        png = vlc.vegalite_to_png(spec, scale=1.5)
        tmp = layout.report / f".{slug}.png.tmp"
        tmp.write_bytes(png)
        tmp.replace(layout.report / f"{slug}.png")
        sections.append(f"<section><h2>{html.escape(title)}</h2><div class='chart' id='chart-{slug}'></div></section>")
    bundle = vlc.javascript_bundle().replace("</script>", "<\\/script>")
    embed = "\n".join(
        f"vegaEmbed('#chart-{slug}', {json.dumps(spec)}, {{actions: false, renderer: 'svg'}})"
        f".catch(e => {{ console.error(e); document.getElementById('chart-{slug}').textContent = 'chart failed: ' + e; }});"
        for slug, spec in specs.items()
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>actlake report: {html.escape(layout.root.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}} table.summary th{{text-align:left;padding-right:1em}}</style>
<script>{bundle}</script></head>
<body><h1>actlake report: {html.escape(layout.root.name)}</h1>
{_summary_html(layout)}
{''.join(sections)}
<script>{embed}</script>
</body></html>"""
    out = layout.report / "report.html"
    tmp = layout.report / ".report.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
