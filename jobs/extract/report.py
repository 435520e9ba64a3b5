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
from actlake.fs import ObjectPath, location, read_regular
from actlake.jobs.common.page import open_for_report, write_page
from actlake.storage.layout import RunLayout, sweep_checkpoints

log = logging.getLogger("actlake.report")


def _tables(con) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def _blocks(con, producers) -> list:
    """Report blocks ((slug, title, Altair chart) or HTML) of every producer whose tables exist, in the order of
    their positions."""
    import altair as alt

    alt.data_transformers.disable_max_rows()
    have = _tables(con)
    blocks = []
    for cls in producers:
        if all(t in have for t in cls.tables):
            try:
                blocks += cls.charts(con)
            except Exception as e:
                from actlake.analysis.registry import failure

                raise (failure(e, [cls]) or e) from None
    return [block for _, block in sorted(blocks, key=lambda pb: pb[0])]


def _nonfinite(con, producers) -> str:
    """Tokens left out of the statistics per layer because their vector held inf/NaN (the producers that declare
    ``nonfinite_layer``)."""
    have = _tables(con)
    counted = [(cls.tables[0], cls.nonfinite_layer) for cls in producers if cls.nonfinite_layer and cls.tables[0] in have]
    if not counted:
        return "not measured"
    parts = []
    for table, what in counted:
        rows = con.execute(f"SELECT layer, max(nonfinite_tokens) FROM {table} GROUP BY layer ORDER BY layer").fetchall()
        bad = [(layer, int(n)) for layer, n in rows if n]
        parts.append(f"{what}s: " + ("0 in every layer" if not bad else ", ".join(f"{what} {l}: {n}" for l, n in bad)))
    return "; ".join(parts)


def _summary_html(layout: RunLayout, nonfinite: str = "") -> str:
    if not layout.summary_json.exists():
        return ""
    s = json.loads(read_regular(layout.summary_json))
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
    from actlake.analysis.registry import builtin_producers

    if sweep_checkpoints(location(run_dir)) is not None:
        return build_sweep_report(run_dir)
    layout, con = open_for_report(run_dir, ("documents",), "no committed shard to report on (did the job run?)")
    shard_tables = [cls for cls in builtin_producers() if cls.per_token]
    try:
        every = [cls for cls in builtin_producers() if not cls.per_token]  # built-in analyses, and interventions'
        blocks = _blocks(con, (every if analyses is None else list(analyses)) + shard_tables)
        if len(source_labels(con)) > 1:  # analyses.by_source: the headline statistics, a line per source
            blocks += comparison_blocks(con, series="source")
        nonfinite = _nonfinite(con, builtin_producers())
    finally:
        con.close()
    return write_page(layout, blocks, _summary_html(layout, nonfinite))


def build_sweep_report(run_dir) -> Path:
    """A checkpoint sweep's ``report/report.html`` (:func:`sweep_blocks`), in the sweep's folder."""
    from actlake.storage.sql import open_run

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
    from actlake.storage.sql import open_runs

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
    """(slug, title, y title, DataFrame of (series, layer, value)) per headline statistic of the built-in producers
    (:class:`~actlake.analysis.protocol.Headline`) that ``con`` offers, by ``series``: ``run`` (a side-by-side
    connection, :func:`~actlake.storage.sql.open_runs`), ``checkpoint`` (a sweep) -- their rows over every
    document -- or ``source`` (one run's rows per source label)."""
    from actlake.analysis.registry import builtin_producers

    have = _tables(con)
    by = "_by_source" if series == "source" else ""  # a view by its name: every document's rows only
    rows = "source <> '*' AND " if series == "source" else ""
    out = []
    for h in sorted((h for cls in builtin_producers() for h in cls.headlines), key=lambda h: h.position):
        if h.over + by not in have and not (by and h.source_sql and h.over in have):
            continue
        sql = h.source_sql if by and h.source_sql else h.sql.format(series=series, by=by, rows=rows)
        df = con.execute(sql).df().rename(columns={"series": series})
        if not df.empty:
            out.append((h.slug, h.title, h.y_title, df))
    return out


def comparison_blocks(con, series: str = "run") -> list:
    """(slug, title, chart) per headline statistic (:func:`headline_frames`), a line per ``series`` over the layers."""
    import altair as alt

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
    import altair as alt

    alt.data_transformers.disable_max_rows()
    points = con.execute("SELECT checkpoint, ordinal, step, sha256, same_as FROM checkpoints ORDER BY ordinal").df()
    by_step = points["step"].notna().all()
    # training snapshots are log-spaced (Pythia: 0, 1, 2, 4, …, 512, 1000, 2000, …): a symlog axis spreads them out
    x = (alt.X("step:Q", title="training step (symlog scale)", scale=alt.Scale(type="symlog")) if by_step
         else alt.X("ordinal:O", title="checkpoint (sweep order)"))
    blocks = []
    for slug, title, y, df in headline_frames(con, "checkpoint"):
        df = df.merge(points[["checkpoint", "ordinal", "step"]], on="checkpoint")
        c = alt.Chart(df).mark_line(point=True).encode(
            x=x, y=alt.Y("value:Q", title=y),
            color=alt.Color("layer:N", title="layer", scale=alt.Scale(scheme="category10")),  # layers told apart
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
    table = next((t for t in sorted(_tables(con)) if t.endswith("_by_source")), None)
    if table is None:
        return []
    return [r[0] for r in con.execute(f"SELECT DISTINCT source FROM {table} WHERE source <> '*' ORDER BY 1").fetchall()]
