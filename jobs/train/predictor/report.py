"""Report of a predictor run: seed 003's Figures 1-6 from SQL over the run's tables."""

from __future__ import annotations

import html
from pathlib import Path

from actlake.jobs.common.page import open_for_report, write_page


def _curves(con, column: str, title: str):
    import altair as alt

    df = con.execute(f"SELECT layer, step, {column} FROM predictor_curve ORDER BY layer, step").df()
    return alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("step:Q", title="predictor training step"), y=alt.Y(f"{column}:Q", title=title),
        color=alt.Color("layer:N", title="layer"),
        tooltip=["layer", "step", alt.Tooltip(f"{column}:Q", format=".4f")]).properties(width=520, height=260)


def _by_position(con, column: str, title: str):
    import altair as alt

    df = con.execute(f"SELECT layer, position, {column} FROM predictor_position WHERE n_tokens > 0 ORDER BY layer, position").df()
    return alt.Chart(df).mark_line().encode(
        x=alt.X("position:Q", title="token position t + 1 in the window"), y=alt.Y(f"{column}:Q", title=title),
        color=alt.Color("layer:N", title="layer"),
        tooltip=["layer", "position", alt.Tooltip(f"{column}:Q", format=".3f")]).properties(width=520, height=260)


def _f1_heatmap(con, task: str):
    import altair as alt

    df = con.execute("SELECT layer, representation, macro_f1 FROM probe_scores WHERE task = ? ORDER BY layer",
                     [task]).df()
    base = alt.Chart(df).encode(x=alt.X("representation:N", sort=["h", "h_hat", "r", "h_hat+r"], title="representation"),
                                y=alt.Y("layer:O", title="layer"))
    return (base.mark_rect().encode(color=alt.Color("macro_f1:Q", title="macro-F1", scale=alt.Scale(scheme="viridis")))
            + base.mark_text(color="white").encode(text=alt.Text("macro_f1:Q", format=".3f"))
            ).properties(width=280, height=40 * max(1, df.layer.nunique()))


def build_predictive_report(run_dir: str | Path) -> Path:
    layout, con = open_for_report(run_dir, ("predictor_summary",), "no predictor_summary table (did train-predictor finish?)")
    try:
        have = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        blocks = [
            ("mse_curve", "Fig. 1 (after Sekiguchi, Ishigaki & Maeda): evaluation MSE/d of the predictor per layer during training",
             _curves(con, "mse", "MSE / d (evaluation windows)")),
            ("r2_curve", "Fig. 2: R² = 1 − MSE/Var per layer during training", _curves(con, "r2", "R²")),
            ("mse_position", "Fig. 3: MSE by token position (trained predictor, evaluation windows)",
             _by_position(con, "mse", "MSE / d")),
            ("spearman_position", "Fig. 4: Spearman correlation of ‖r‖ with surprisal by token position",
             _by_position(con, "spearman", "Spearman ρ(‖r‖, surprisal)")),
        ]
        if "probe_scores" in have:
            tasks = [r[0] for r in con.execute("SELECT DISTINCT task FROM probe_scores ORDER BY task DESC").fetchall()]
            names = {"source": "Fig. 5: document source (pile_set_name) probe, macro-F1",
                     "type8": "Fig. 6: token type (type8) probe at the last position, macro-F1"}
            blocks += [(f"probe_{t}", names.get(t, t), _f1_heatmap(con, t)) for t in tasks]
        rows = con.execute("""SELECT layer, r2, mse, spearman, n_eval_windows, n_train_windows, n_heads, head_dim
                              FROM predictor_summary ORDER BY layer""").fetchall()
    finally:
        con.close()
    cells = "".join(f"<tr><td>{l}</td><td>{r2:.3f}</td><td>{mse:.4g}</td><td>{sp:.3f}</td><td>{ne}</td><td>{nt}</td>"
                    f"<td>{h}×{d}</td></tr>" for l, r2, mse, sp, ne, nt, h, d in rows)
    header = ("<table class='t1'><tr><th>layer</th><th>R²</th><th>MSE/d</th><th>Spearman ρ(‖r‖, s)</th>"
              f"<th>eval windows</th><th>train windows</th><th>predictor heads</th></tr>{cells}</table>"
              f"<p>{html.escape('SQL: SELECT * FROM predictor_summary; SELECT * FROM probe_scores')}</p>")
    return write_page(layout, blocks, header)
