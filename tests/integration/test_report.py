"""The report opens in a real headless Chromium, offline, with every chart drawn and no console errors."""

from __future__ import annotations

import pytest

from actlake.jobs.extract.run import run_job
from tests.conftest import job_config
from tests.integration.browser import needs_chromium, open_report

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def report_run(minilm_path, sample_corpus, tmp_path_factory, ray_local):
    out = tmp_path_factory.mktemp("reportrun")
    return run_job(job_config(minilm_path, sample_corpus, out, **{"corpus.max_docs": 8, "output.report": True}))


def test_report_files(report_run):
    from pathlib import Path

    report = Path(report_run.report)
    assert report.name == "report.html"
    html = report.read_text()
    assert "<script src=" not in html
    for png in ("dim_means.png", "attention_mass.png", "residual_norms.png", "outlier_dims_by_category.png",
                "contributions.png", "geometry_norms.png", "keynorm_mass.png", "attention_by_distance.png",
                "first_token_mass.png", "massive_activations.png"):
        data = (report.parent / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@needs_chromium
def test_report_renders_in_headless_chromium(report_run):
    seen = open_report(report_run.report)
    errors, charts, marks, table1, requests = (seen[k] for k in ("errors", "charts", "marks", "table_rows", "requests"))
    assert errors == []
    ids = {i for i, _ in charts}
    assert {"chart-dim_means", "chart-attention_mass", "chart-residual_norms", "chart-outlier_dims_by_category",
            "chart-contributions", "chart-geometry_norms", "chart-keynorm_mass", "chart-attention_by_distance",
            "chart-first_token_mass"} <= ids
    assert all(n >= 1 for _, n in charts)
    assert min(marks) > 10
    assert table1 > 3  # header plus a row per (layer, outlier dimension)
    assert all(u.startswith("file://") for u in requests)


def test_report_draws_the_sink_head_by_head_and_the_massive_activations(report_run):
    """The heatmap's values are the attention on [CLS] per layer and head, recomputed from the raw partial
    sums; the massive-activations table names, per layer, the dimension with the largest |mean| on [CLS]."""
    from pathlib import Path

    import numpy as np

    from actlake import open_run
    from actlake.analysis.attention_mass import first_token_mass

    con = open_run(str(report_run.run_dir))
    raw = con.execute("SELECT layer, head, key_category, mass, n_queries FROM attention_mass").df()
    bos = raw[raw.key_category == "bos"].groupby(["layer", "head"])[["mass", "n_queries"]].sum()
    drawn = first_token_mass(con).set_index(["layer", "head"])["mean_mass"]
    m = con.execute("SELECT layer, dim, mean FROM dim_moments WHERE scheme = 'role' AND category = 'bos'").df()
    con.close()
    assert len(drawn) == len(bos) > 0
    np.testing.assert_allclose(drawn.to_numpy(), (bos.mass / bos.n_queries).loc[drawn.index].to_numpy(), rtol=1e-12)
    assert drawn.max() > 1.5 * drawn.min()  # heads differ: what the per-layer average hides

    top = m.loc[m["mean"].abs().groupby(m.layer).idxmax()]
    html = Path(report_run.report).read_text()
    section = html[html.index("id='massive-activations'"):]
    rows = section[section.index("<table"):section.index("</table>")].split("<tr>")[2:]
    assert len(rows) == m.layer.nunique()
    for row, (_, t) in zip(rows, top.sort_values("layer").iterrows()):
        bos_cell = row.split("<td>")[2]  # after the layer, the first role: bos
        assert bos_cell.startswith(f"<b>{int(t.dim)}</b>: {t['mean']:.3g} ")
    from actlake.analysis.dim_moments import top_dimension_by_role  # the chart's data names the same dimensions

    con = open_run(str(report_run.run_dir))
    drawn = top_dimension_by_role(con)
    con.close()
    bos = drawn[drawn.category == "bos"].sort_values("layer")
    assert bos.dim.tolist() == [int(d) for d in top.sort_values("layer").dim]
    assert set(bos[bos.layer.between(1, 4)].dim) == {99}  # MiniLM's [CLS] dimension, named on the chart


def test_fig4_draws_each_dimensions_range_over_the_heads(report_run):
    """Fig. 4's data: per (layer, dimension) the lowest, mean and highest over the heads of mean C_j over every
    valid pair, recomputed from the raw sums; a row per (layer, dimension), not per head and key category."""
    import numpy as np

    from actlake import open_run
    from actlake.analysis.contributions import contribution_layers, contribution_ranges

    con = open_run(str(report_run.run_dir))
    layers = contribution_layers(con)
    raw = con.execute("SELECT layer, head, dim, contribution_sum, n_pairs FROM contributions "
                      "WHERE query_category = 'all'").df()
    drawn = contribution_ranges(con, layers)
    d = con.execute("SELECT count(DISTINCT dim) FROM contributions").fetchall()[0][0]
    con.close()
    per_head = raw[raw.layer.isin(layers)].groupby(["layer", "head", "dim"])[["contribution_sum", "n_pairs"]].sum()
    c = (per_head.contribution_sum / per_head.n_pairs).groupby(["layer", "dim"])
    assert len(drawn) == len(layers) * d
    for column, expected in (("lowest", c.min()), ("mean", c.mean()), ("highest", c.max())):
        np.testing.assert_allclose(drawn.set_index(["layer", "dim"])[column].to_numpy(), expected.to_numpy(), rtol=1e-9)
    assert (drawn.highest > drawn.lowest).any()  # the heads differ


def test_attention_per_key_names_the_category_each_key_token_draws_most(report_run):
    """`attention_mass_by_key` answers "where does a query's attention go" (`other` wins: most tokens are
    other); `attention_per_key` answers "which key token draws the most", mass over the pairs it was in. Checked
    against the base table; for MiniLM, [CLS] in layers 1-4."""
    import numpy as np

    from actlake import open_run

    con = open_run(str(report_run.run_dir))
    raw = con.execute("SELECT layer, key_category, mass, n_pairs FROM attention_geometry WHERE source = '*'").df()
    view = con.execute("SELECT layer, key_category, weight_per_key, lift FROM attention_per_key WHERE source = '*' "
                       "ORDER BY layer, key_category").df()
    con.close()
    g = raw.groupby(["layer", "key_category"])[["mass", "n_pairs"]].sum()
    per_key = (g.mass / g.n_pairs).loc[list(zip(view.layer, view.key_category))].to_numpy()
    np.testing.assert_allclose(view.weight_per_key, per_key, rtol=1e-12)
    overall = raw.groupby("layer").mass.sum() / raw.groupby("layer").n_pairs.sum()
    np.testing.assert_allclose(view.lift, per_key / overall.loc[view.layer].to_numpy(), rtol=1e-12)
    top = view.loc[view.groupby("layer").lift.idxmax()].set_index("layer").key_category
    assert (top.loc[1:4] == "bos").all(), top
