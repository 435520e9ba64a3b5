"""Report of a synthetic run: dimension, fidelity, orthogonality, belief simplices, learning curves.

Every number comes from SQL over the run's tables (``actlake sql RUN_DIR ...`` runs the same).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actlake.jobs.common.page import open_for_report, write_page


def _dimension_chart(con):
    import altair as alt

    df = con.execute("""
        SELECT trial, step, step + 1 AS step1, effective_dim, factored_reference, joint_reference, belief_dimension
        FROM factored_dimension WHERE kind = 'checkpoint' ORDER BY trial, step""").df()
    band = con.execute("""SELECT min(effective_dim) AS lo, max(effective_dim) AS hi FROM factored_dimension
                          WHERE kind = 'random'""").df()
    r = df.iloc[0]
    refs = alt.Chart(alt.Data(values=[
        {"ref": f"factored Σ(d−1) = {r.factored_reference}", "y": int(r.factored_reference)},
        {"ref": f"joint ∏d − 1 = {r.joint_reference}", "y": int(r.joint_reference)},
        {"ref": f"true beliefs (95%) = {r.belief_dimension}", "y": int(r.belief_dimension)},
        {"ref": f"random init {int(band.lo[0])}–{int(band.hi[0])}", "y": float(band.hi[0])},
    ])).mark_rule(strokeDash=[4, 3]).encode(y="y:Q", color=alt.Color("ref:N", title="reference"))
    lines = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("step1:Q", scale=alt.Scale(type="log"), title="training step + 1"),
        y=alt.Y("effective_dim:Q", title="95%-variance dimension of the final residual stream"),
        strokeDash=alt.StrokeDash("trial:N", title="trial"),
        tooltip=["trial", "step", "effective_dim"])
    return (lines + refs).properties(width=560, height=300)


def _r2_chart(con):
    import altair as alt

    df = con.execute("""SELECT trial, step, step + 1 AS step1, target, r2 FROM factored_fit
                        WHERE kind = 'checkpoint' ORDER BY trial, step""").df()
    return alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("step1:Q", scale=alt.Scale(type="log"), title="training step + 1"),
        y=alt.Y("r2:Q", title="R² of the affine map activations → beliefs", scale=alt.Scale(domain=[min(0, df.r2.min()), 1])),
        color=alt.Color("target:N", title="beliefs of"), strokeDash=alt.StrokeDash("trial:N"),
        tooltip=["trial", "step", "target", alt.Tooltip("r2:Q", format=".3f")]).properties(width=560, height=300)


def _overlap_chart(con):
    import altair as alt

    trial = con.execute("SELECT min(trial) FROM factor_overlap").fetchall()[0][0]
    steps = [r[0] for r in con.execute(
        "SELECT DISTINCT step FROM factor_overlap WHERE kind = 'checkpoint' AND trial = ? ORDER BY step", [trial]).fetchall()]
    pick = sorted({steps[0], steps[len(steps) // 2], steps[-1]})
    df = con.execute(f"""SELECT step, factor_i, factor_j, overlap FROM factor_overlap
                         WHERE kind = 'checkpoint' AND trial = ? AND step IN ({', '.join(map(str, pick))})""", [trial]).df()
    base = alt.Chart(df).encode(x=alt.X("factor_j:O", title="factor"), y=alt.Y("factor_i:O", title="factor"))
    heat = base.mark_rect().encode(color=alt.Color("overlap:Q", scale=alt.Scale(type="symlog", constant=1e-3, domain=[0, 1])),
                                   tooltip=["step", "factor_i", "factor_j", alt.Tooltip("overlap:Q", format=".2e")])
    text = base.mark_text(fontSize=9).encode(text=alt.Text("overlap:Q", format=".1e"))
    return (heat + text).properties(width=160, height=160).facet(column=alt.Column("step:O", title=f"trial {trial}: step"))


def _colour(b: np.ndarray) -> str:
    b = np.clip(np.asarray(b, dtype=float)[:3], 0, None)
    b = b / b.max() if b.max() > 0 else b
    return "#" + "".join(f"{int(round(255 * v)):02x}" for v in np.pad(b, (0, 3 - len(b))))


def _simplex_xy(b: np.ndarray) -> tuple[float, float]:
    """Barycentric projection of a 3-vector onto the plane of the simplex."""
    b = np.asarray(b, dtype=float)[:3]
    return float(b[1] + b[2] / 2), float(b[2] * np.sqrt(3) / 2)


def _scatter_chart(con):
    import altair as alt
    import pandas as pd

    trial = con.execute("SELECT min(trial) FROM belief_scatter").fetchall()[0][0]
    rows = con.execute("""SELECT step, factor, "true", pred FROM belief_scatter
                          WHERE trial = ? AND step = (SELECT max(step) FROM belief_scatter WHERE trial = ?)""",
                       [trial, trial]).fetchall()
    recs = []
    for step, factor, true, pred in rows:
        colour = _colour(true)
        for which, b in (("true belief", true), ("predicted from activations", pred)):
            x, y = _simplex_xy(b)
            recs.append({"step": step, "factor": factor, "which": which, "x": x, "y": y, "colour": colour})
    df = pd.DataFrame(recs)
    return alt.Chart(df).mark_circle(size=10, opacity=0.7).encode(
        x=alt.X("x:Q", axis=None), y=alt.Y("y:Q", axis=None), color=alt.Color("colour:N", scale=None),
    ).properties(width=170, height=150).facet(row=alt.Row("which:N", title=None, sort=["true belief"]),
                                              column=alt.Column("factor:O", title=f"trial {trial}, last step: factor"))


def _curve_chart(con):
    import altair as alt

    df = con.execute("""SELECT trial, step + 1 AS step1, eval_loss, optimal_loss FROM training_curves ORDER BY trial, step""").df()
    lines = alt.Chart(df).mark_line().encode(
        x=alt.X("step1:Q", scale=alt.Scale(type="log"), title="training step + 1"),
        y=alt.Y("eval_loss:Q", title="held-out loss (nats/token)", scale=alt.Scale(zero=False)),
        color=alt.Color("trial:N"), tooltip=["trial", "step1", alt.Tooltip("eval_loss:Q", format=".4f")])
    opt = alt.Chart(df).mark_line(strokeDash=[4, 3], color="black").encode(x="step1:Q", y="optimal_loss:Q",
                                                                           detail="trial:N")
    return (lines + opt).properties(width=560, height=260)


def build_synthetic_report(run_dir: str | Path) -> Path:
    layout, con = open_for_report(run_dir, ("factored_dimension",), "no factored_dimension table (did the analysis run?)")
    try:
        blocks = [
            ("dimension", "Effective dimension (95% of variance) vs training step, with the factored, joint and "
                          "true-belief references", _dimension_chart(con)),
            ("factor_r2", "Fidelity: R² of an affine map from activations to each factor's beliefs "
                          "(and to their concatenation and the joint belief)", _r2_chart(con)),
            ("overlap", "Orthogonality: overlap of the vary-one factor subspaces (0 orthogonal, 1 identical)",
             _overlap_chart(con)),
            ("simplex", "Belief simplices: true beliefs and their affine prediction from activations, coloured by "
                        "true belief", _scatter_chart(con)),
            ("curves", "Learning curves: held-out loss and the Bayes-optimal loss (dashed)", _curve_chart(con)),
        ]
        band = con.execute("""SELECT min(overlap), max(overlap) FROM factor_overlap
                              WHERE kind = 'random' AND factor_i <> factor_j""").fetchall()[0]
    finally:
        con.close()
    header = (f"<p>Overlap band of randomly initialised models (off-diagonal): "
              f"{band[0]:.3g} – {band[1]:.3g}.</p>" if band[0] is not None else "")
    return write_page(layout, blocks, header)
