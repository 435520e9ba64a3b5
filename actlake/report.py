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
        charts.append(("dim_means", "Fig. 1 (seed 001): per-dimension mean of the residual stream by layer, outliers marked", c))
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
        charts.append(("attention_mass", "Fig. 2 (seed 001): attention mass by key category per layer", c))
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
    if "dim_moments" in have:
        dims = top_outlier_dims(con)
        if dims:
            df = con.execute(f"""
                SELECT layer, dim, category, mean FROM dim_moments
                WHERE scheme = 'role' AND dim IN ({", ".join(map(str, dims))}) AND count > 0 ORDER BY layer
            """).df()
            c = alt.Chart(df).mark_line(point=True).encode(
                x=alt.X("layer:O", title="layer"), y=alt.Y("mean:Q", title="mean value"),
                color=alt.Color("category:N", title="token category"),
                tooltip=["layer", "dim", "category", alt.Tooltip("mean:Q", format=".3f")],
            ).properties(width=260, height=200).facet(column=alt.Column("dim:O", title="outlier dimension"))
            charts.append(("outlier_dims_by_category", "Fig. 3 (seed 001): outlier dimensions' mean value by token category", c))
    if "contributions" in have:
        layers = contribution_layers(con)
        df = con.execute(f"""
            SELECT layer, head, dim, sum(contribution_sum) / sum(n_pairs) AS mean_c
            FROM contributions WHERE query_category = 'all' AND layer IN ({", ".join(map(str, layers))})
            GROUP BY layer, head, dim ORDER BY layer, head, dim
        """).df()
        c = alt.Chart(df).mark_circle(size=10, opacity=0.6).encode(
            x=alt.X("dim:Q", title="dimension j"), y=alt.Y("mean_c:Q", title="mean C_j over all valid pairs"),
            color=alt.Color("head:N", title="head", legend=None),
            tooltip=["layer", "head", "dim", alt.Tooltip("mean_c:Q", format=".3f")],
        ).properties(width=640, height=150).facet(row=alt.Row("layer:O", title="layer"))
        charts.append(("contributions", "Fig. 4 (seed 001): per-dimension contributions to attention scores, every head", c))
    if "attention_geometry" in have:
        df = con.execute("""
            SELECT layer, key_category, sum(k_norm_sum) / sum(n_pairs) AS mean_k_norm,
                   sum(q_norm_sum) / sum(n_pairs) AS mean_q_norm, sum(cos_sum) / sum(n_pairs) AS mean_cos,
                   sum(mass) / sum(n_queries) AS mass, sum(mass_keynorm) / sum(n_queries) AS mass_keynorm
            FROM attention_geometry WHERE n_pairs > 0 GROUP BY layer, key_category ORDER BY layer
        """).df()
        base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer"), color=alt.Color("key_category:N", title="key category"))
        c = alt.hconcat(
            base.mark_line(point=True).encode(y=alt.Y("mean_k_norm:Q", title="mean ||k|| over pairs")).properties(width=250, height=200),
            base.mark_line(point=True).encode(y=alt.Y("mean_cos:Q", title="mean cos(q, k) over pairs")).properties(width=250, height=200),
        )
        charts.append(("geometry_norms", "Attention geometry (seed 002): key norm and q-k angle by key category", c))
        long = df.melt(id_vars=["layer", "key_category"], value_vars=["mass", "mass_keynorm"], var_name="logits", value_name="m")
        long["logits"] = long["logits"].map({"mass": "as computed", "mass_keynorm": "keys at mean norm"})
        c = alt.Chart(long).mark_line(point=True).encode(
            x=alt.X("layer:O", title="layer"), y=alt.Y("m:Q", title="mean attention per query"),
            color=alt.Color("key_category:N", title="key category"), strokeDash=alt.StrokeDash("logits:N", title="keys"),
            tooltip=["layer", "key_category", "logits", alt.Tooltip("m:Q", format=".3f")],
        ).properties(width=520, height=260)
        charts.append(("keynorm_mass", "How much of each category's attention is key norm: mass with keys rescaled to their mean norm", c))
    if "attention_by_distance" in have:
        df = con.execute("""
            SELECT layer, distance, sum(attn_sum) / sum(n_pairs) AS mean_attention FROM attention_by_distance
            WHERE n_pairs > 0 AND abs(distance) <= 32 GROUP BY layer, distance ORDER BY layer, distance
        """).df()
        c = alt.Chart(df).mark_line().encode(
            x=alt.X("distance:Q", title="relative position m - n (query minus key)"),
            y=alt.Y("mean_attention:Q", title="mean attention weight", scale=alt.Scale(type="log")),
            color=alt.Color("layer:O", title="layer"),
            tooltip=["layer", "distance", alt.Tooltip("mean_attention:Q", format=".4f")],
        ).properties(width=520, height=260)
        charts.append(("attention_by_distance", "Attention by relative position (mean over heads)", c))
    return charts


def top_outlier_dims(con, k: int = 3) -> list[int]:
    """The k dimensions with the largest |robust z| in any layer."""
    rows = con.execute(f"""
        SELECT dim FROM outliers WHERE robust_z IS NOT NULL GROUP BY dim ORDER BY max(abs(robust_z)) DESC LIMIT {k}
    """).fetchall()
    return [r[0] for r in rows]


def contribution_layers(con) -> list[int]:
    """First, middle and last attention layer (seed 001 shows layers 2, 6 and 12 of 12)."""
    n = con.execute("SELECT max(layer) + 1 FROM contributions").fetchall()[0][0]
    return sorted({min(1, n - 1), n // 2, n - 1})


def _table1_html(con) -> str:
    """Seed 001 Table 1: mean C_j of the top outlier dimensions by key category, for the chosen layers."""
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if not {"contributions", "dim_moments"} <= have:
        return ""
    dims = top_outlier_dims(con)
    layers = contribution_layers(con)
    rows = con.execute(f"""
        SELECT layer, dim, key_category, sum(contribution_sum) / nullif(sum(n_pairs), 0) AS mean_c
        FROM contributions WHERE query_category = 'all' AND dim IN ({", ".join(map(str, dims))})
          AND layer IN ({", ".join(map(str, layers))})
        GROUP BY layer, dim, key_category ORDER BY layer, dim, key_category
    """).fetchall()
    cats = sorted({r[2] for r in rows})
    grid_: dict = {}
    for layer, dim, cat, v in rows:
        grid_.setdefault((layer, dim), {})[cat] = v
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cats)
    body = "".join(
        f"<tr><td>{layer}</td><td>{dim}</td>" + "".join(
            f"<td>{'' if vals.get(c) is None else f'{vals[c]:.3f}'}</td>" for c in cats) + "</tr>"
        for (layer, dim), vals in sorted(grid_.items()))
    return ("<section><h2>Table 1 (seed 001): mean contribution C_j of the top outlier dimensions, by key category "
            "(all heads, all valid pairs)</h2>"
            f"<table class='t1'><tr><th>layer</th><th>dim</th>{head}</tr>{body}</table>"
            "<p>SQL: <code>SELECT * FROM contributions_mean WHERE layer = L AND dim = J</code></p></section>")


def _nonfinite(con) -> str:
    """Tokens left out of the statistics per layer because their vector held inf/NaN."""
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if not {"dim_moments", "attention_mass"} & have:
        return "not measured"
    parts = []
    for table, what in (("dim_moments", "hidden state"), ("attention_mass", "attention layer")):
        if table not in have:
            continue
        rows = con.execute(f"SELECT layer, max(nonfinite_tokens) FROM {table} GROUP BY layer ORDER BY layer").fetchall()
        bad = [(layer, int(n)) for layer, n in rows if n]
        parts.append(f"{what}s: " + ("0 in every layer" if not bad else ", ".join(f"{what} {l}: {n}" for l, n in bad)))
    return "; ".join(parts)


def _summary_html(layout: RunLayout, nonfinite: str = "") -> str:
    if not layout.summary_json.exists():
        return ""
    s = json.loads(layout.summary_json.read_text())
    rows = [("documents", s.get("docs")), ("windows", s.get("windows")), ("tokens", s.get("tokens")),
            ("padded tokens / real tokens", f"{s.get('padded_fraction', 0):.3f}"),
            ("shards", s.get("shards")), ("wall time (s)", f"{s.get('wall_seconds', 0):.1f}")]
    rows += [(f"rejected: {k}", v) for k, v in sorted(s.get("rejects", {}).items())] or [("rejected records", 0)]
    rows += [("documents cut (longer than the windows allowed)", s.get("cut_docs", 0)),
             ("out-of-memory batch splits", s.get("oom_splits", 0)), ("non-finite tokens excluded", nonfinite)]
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table class='summary'>{cells}</table>"


def build_report(run_dir: str | Path) -> Path:
    """Write ``report/report.html`` and ``report/<chart>.png``; return the HTML path."""
    from actlake.storage.sql import open_run

    layout = RunLayout(Path(run_dir).resolve())
    if not (layout.tables / "dim_moments").exists() and not (layout.tables / "residual_norms").exists():
        raise StorageError(f"{layout.root}: no reduced tables to report on (did the job finish?)")
    con = open_run(layout.root)
    try:
        charts = _charts(con)
        table1 = _table1_html(con)
        nonfinite = _nonfinite(con)
    finally:
        con.close()
    blocks = [*charts[:4], table1, *charts[4:]]
    return write_page(layout, blocks, _summary_html(layout, nonfinite))


def write_page(layout: RunLayout, blocks: list, header_html: str = "") -> Path:
    """Write ``report/report.html`` from ``blocks`` — (slug, title, altair chart) or raw HTML strings —
    and ``report/<slug>.png`` per chart; the page inlines Vega and needs no network."""
    import vl_convert as vlc

    layout.report.mkdir(parents=True, exist_ok=True)
    sections, specs = [], {}
    for block in blocks:
        if isinstance(block, str):
            sections.append(block)
            continue
        slug, title, chart = block
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
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}} table.summary th{{text-align:left;padding-right:1em}} table.t1 td,table.t1 th{{padding:2px 8px;text-align:right}}</style>
<script>{bundle}</script></head>
<body><h1>actlake report: {html.escape(layout.root.name)}</h1>
{header_html}
{''.join(sections)}
<script>{embed}</script>
</body></html>"""
    out = layout.report / "report.html"
    tmp = layout.report / ".report.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
