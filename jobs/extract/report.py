"""``actlake report``: one self-contained HTML page (Vega inlined, works offline) plus a PNG per chart.

Every number in the report comes from SQL over the run's tables, the same
queries a user can run with ``actlake sql``.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import ObjectPath, location
from actlake.jobs.common.page import open_for_report, write_page
from actlake.storage.layout import RunLayout, sweep_checkpoints

log = logging.getLogger("actlake.report")


def _blocks(con, analyses) -> list:
    """Report blocks ((slug, title, Altair chart) or HTML) of the residual norms and of every analysis
    whose tables exist, in the order of their positions."""
    import altair as alt  # loads altair: imported when used

    alt.data_transformers.disable_max_rows()
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    blocks = []
    if "residual_norms" in have:
        blocks.append((3, _residual_norms_chart(con)))
    for cls in analyses:
        if all(t in have for t in cls.tables):
            try:
                blocks += cls.charts(con)
            except Exception as e:
                from actlake.analysis.registry import failure  # loads torch: imported when used

                raise (failure(e, [cls]) or e) from None
    return [block for _, block in sorted(blocks, key=lambda pb: pb[0])]


def _residual_norms_chart(con):
    import altair as alt  # loads altair: imported when used

    df = con.execute("""
        SELECT layer, avg(norm) AS mean, quantile_cont(norm, 0.1) AS p10, quantile_cont(norm, 0.5) AS median,
               quantile_cont(norm, 0.9) AS p90 FROM residual_norms WHERE isfinite(norm) GROUP BY layer ORDER BY layer
    """).df()  # finite norms only: DuckDB orders NaN above every number, which would move every percentile
    base = alt.Chart(df).encode(x=alt.X("layer:O", title="layer (0 = embeddings)"))
    c = (base.mark_area(opacity=0.25).encode(y=alt.Y("p10:Q", title="||h|| (10th-90th percentile band)"), y2="p90:Q")
         + base.mark_line(point=True).encode(y="median:Q", tooltip=["layer", alt.Tooltip("median:Q", format=".2f"),
                                                                     alt.Tooltip("mean:Q", format=".2f")])
         ).properties(width=420, height=260)
    return ("residual_norms", "Residual-stream norm by layer (median, 10th-90th percentile)", c)


NONFINITE = (("dim_moments", "hidden state"), ("attention_mass", "attention layer"))
"""Tables with a ``nonfinite_tokens`` column per layer, and what their layer is."""


def _nonfinite(con) -> str:
    """Tokens left out of the statistics per layer because their vector held inf/NaN."""
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    if not {t for t, _ in NONFINITE} & have:
        return "not measured"
    parts = []
    for table, what in NONFINITE:
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


def build_report(run_dir: str | Path, analyses=None) -> Path:
    """Write ``report/report.html`` and ``report/<chart>.png``; return the HTML path.

    ``analyses``: the classes whose charts to draw (the job passes its enabled ones, custom analyses
    included); default the built-in ones. ``actlake report`` never imports code named in a run folder.
    """
    from actlake.analysis.registry import builtin  # loads pyarrow, torch: imported when used

    if sweep_checkpoints(location(run_dir)) is not None:
        return build_sweep_report(run_dir)
    layout, con = open_for_report(run_dir, ("documents",), "no committed shard to report on (did the job run?)")
    try:
        blocks = _blocks(con, list(builtin().values()) if analyses is None else analyses)
        if len(source_labels(con)) > 1:  # analyses.by_source: the headline statistics, a line per source
            blocks += comparison_blocks(con, series="source")
        nonfinite = _nonfinite(con)
    finally:
        con.close()
    return write_page(layout, blocks, _summary_html(layout, nonfinite))


def build_sweep_report(run_dir) -> Path:
    """A checkpoint sweep's ``report/report.html`` (:func:`sweep_blocks`), in the sweep's folder."""
    from actlake.storage.sql import open_run  # loads pyarrow: imported when used

    layout = RunLayout(location(run_dir))
    con = open_run(layout.root)
    try:
        blocks = sweep_blocks(con)
    finally:
        con.close()
    return write_page(layout, blocks, "<p>A checkpoint sweep: each checkpoint's run is in "
                                      "<code>checkpoints/LABEL/</code>; its tables carry the column "
                                      "<code>checkpoint</code>.</p>")


def build_comparison(run_dirs: list, out_dir: str | Path) -> Path:
    """``actlake report --compare``: the headline statistics of several runs side by side (models or corpora
    compared), one colour per run, from :func:`~actlake.storage.sql.open_runs`; written to
    ``out_dir/report/report.html`` with a PNG per chart. Returns the HTML path."""
    from actlake.storage.sql import open_runs  # loads pyarrow: imported when used

    if len(run_dirs) < 2:
        raise StorageError(f"--compare needs two runs or more, got {len(run_dirs)}")
    con = open_runs(run_dirs)
    try:
        blocks = comparison_blocks(con)
    finally:
        con.close()
    runs = [RunLayout(location(r)).root.name for r in run_dirs]
    if not blocks:
        raise StorageError(f"{', '.join(map(str, run_dirs))}: no statistic the runs share to compare")
    out = location(out_dir)
    if not isinstance(out, ObjectPath):
        Path(out).mkdir(parents=True, exist_ok=True)
    header = ("<p>Runs compared, one colour each: " + ", ".join(f"<code>{html.escape(str(r))}</code>" for r in run_dirs)
              + f" (the column <code>run</code>: {', '.join(html.escape(r) for r in runs)}).</p>")
    return write_page(RunLayout(out), blocks, header)


def headline_frames(con, series: str = "run") -> list:
    """(slug, title, y title, DataFrame of (series, layer, value)) per headline statistic ``con`` offers, by
    ``series``: ``run`` (a side-by-side connection, :func:`~actlake.storage.sql.open_runs`), ``checkpoint``
    (a sweep) -- their rows over every document -- or ``source`` (one run's rows per source label)."""
    from actlake.analysis.dim_moments import OUTLIER_Z  # loads torch: imported when used

    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    by = "_by_source" if series == "source" else ""  # a view by its name: every document's rows only
    rows = "source <> '*' AND " if series == "source" else ""
    norms = ("SELECT d.source AS series, r.layer, avg(r.norm) AS value FROM residual_norms r JOIN documents d "
             "USING (doc_id) GROUP BY ALL ORDER BY ALL" if series == "source" else
             f"SELECT {series} AS series, layer, avg(norm) AS value FROM residual_norms GROUP BY ALL ORDER BY ALL")
    charts = [
        ("residual_norms", "residual_norms", "Residual-stream norm by layer (mean)", "mean ||h||", norms),
        (f"attention_mass_by_key{by}", "first_token_mass",
         "Attention mass on the leading special token ([CLS] or BOS) by layer, mean over heads", "mass on it",
         f"SELECT {series} AS series, layer, avg(mean_mass) AS value FROM attention_mass_by_key{by} WHERE {rows}"
         "key_category = 'bos' GROUP BY ALL ORDER BY ALL"),
        (f"massive_activations{by}", "massive_activations",
         "Share of [CLS]/BOS's mean squared norm in its largest dimension, by layer", "share (top dimension)",
         f"SELECT {series} AS series, layer, share AS value, dim FROM massive_activations{by} WHERE {rows}"
         "scheme = 'role' AND category = 'bos' AND rank = 1 ORDER BY ALL"),
        (f"outliers{by}", "outliers", f"Outlier dimensions by layer (|robust z| > {OUTLIER_Z:g})", "dimensions",
         f"SELECT {series} AS series, layer, count(*) FILTER (WHERE abs(robust_z) > {OUTLIER_Z}) AS value "
         f"FROM outliers{by} WHERE {rows}true GROUP BY ALL ORDER BY ALL"),
    ]
    out = []
    for view, slug, title, y, sql in charts:
        if view in have:
            df = con.execute(sql).df().rename(columns={"series": series})
            if not df.empty:
                out.append((slug, title, y, df))
    return out


def comparison_blocks(con, series: str = "run") -> list:
    """(slug, title, chart) per headline statistic (:func:`headline_frames`), a line per ``series`` over the layers."""
    import altair as alt  # loads altair: imported when used

    alt.data_transformers.disable_max_rows()
    blocks = []
    for slug, title, y, df in headline_frames(con, series):
        c = alt.Chart(df).mark_line(point=True).encode(
            x=alt.X("layer:O", title="layer"), y=alt.Y("value:Q", title=y), color=alt.Color(f"{series}:N", title=series),
            tooltip=[c for c in df.columns],
        ).properties(width=480, height=240)
        blocks.append((f"{'compare' if series == 'run' else 'by_source'}_{slug}",
                       title if series == "run" else f"By source: {title[0].lower()}{title[1:]}", c))
    return blocks


def sweep_blocks(con) -> list:
    """A checkpoint sweep's report: each headline statistic against the training step (the checkpoint's place
    in the sweep where it has no step), a line per layer; then the checkpoints table, copies flagged."""
    import altair as alt  # loads altair: imported when used

    alt.data_transformers.disable_max_rows()
    points = con.execute("SELECT checkpoint, ordinal, step, sha256, same_as FROM checkpoints ORDER BY ordinal").df()
    by_step = points["step"].notna().all()
    x = alt.X("step:Q" if by_step else "ordinal:O", title="training step" if by_step else "checkpoint (sweep order)")
    blocks = []
    for slug, title, y, df in headline_frames(con, "checkpoint"):
        df = df.merge(points[["checkpoint", "ordinal", "step"]], on="checkpoint")
        c = alt.Chart(df).mark_line(point=True).encode(
            x=x, y=alt.Y("value:Q", title=y), color=alt.Color("layer:O", title="layer"),
            tooltip=[c for c in df.columns],
        ).properties(width=480, height=240)
        blocks.append((f"sweep_{slug}", f"Across checkpoints: {title[0].lower()}{title[1:]}", c))
    rows = "".join(
        f"<tr><td>{html.escape(str(r.checkpoint))}</td><td>{'' if r.step != r.step else int(r.step)}</td>"
        f"<td><code>{html.escape(str(r.sha256)[:16])}</code></td>"
        f"<td>{'<b>same weights as ' + html.escape(str(r.same_as)) + '</b>' if isinstance(r.same_as, str) else ''}</td></tr>"
        for r in points.itertuples())
    blocks.insert(0, "<section id='checkpoints'><h2>Checkpoints</h2><table class='t1'><tr><th>checkpoint</th>"
                     f"<th>step</th><th>sha256 of the weights</th><th></th></tr>{rows}</table>"
                     "<p>A checkpoint with the same weights as an earlier one gives the same statistics: its points "
                     "repeat that one's.</p></section>")
    return blocks


def source_labels(con) -> list[str]:
    """The source labels of a run's statistics (``analyses.by_source``: the ``_by_source`` tables; none without it)."""
    have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    table = next((t for t in ("dim_moments_by_source", "attention_mass_by_source") if t in have), None)
    if table is None:
        return []
    return [r[0] for r in con.execute(f"SELECT DISTINCT source FROM {table} WHERE source <> '*' ORDER BY 1").fetchall()]
