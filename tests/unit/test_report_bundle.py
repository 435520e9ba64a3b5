"""The report page's Vega bundle is vl-convert's own, kept per vl-convert version in actlake's cache folder."""

from __future__ import annotations

import vl_convert as vlc

from actlake.jobs.common.page import vega_bundle


def test_the_bundle_is_vl_converts_and_is_kept_per_version(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kept = tmp_path / "actlake" / f"vega-bundle-{vlc.__version__}.js"
    assert vega_bundle() == vlc.javascript_bundle() == kept.read_text(encoding="utf-8")
    kept.write_text("// kept", encoding="utf-8")
    assert vega_bundle() == "// kept"  # read from the cache, not built again
    kept.write_text("", encoding="utf-8")  # an emptied file is built again
    assert vega_bundle() == vlc.javascript_bundle() == kept.read_text(encoding="utf-8")


def test_an_unwritable_cache_folder_still_gives_the_bundle(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    assert vega_bundle() == vlc.javascript_bundle()


def test_chart_data_cannot_close_the_script_element_it_is_inlined_in():
    """A source label `</script><script>alert(1)</script>` became live script elements in report.html."""
    import json

    from actlake.jobs.common.page import script_json

    spec = {"data": {"values": [{"source": "</script><script>alert(1)</script>", "piece": "a & b > c\u2028"}]}}
    text = script_json(spec)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == spec


def test_the_residual_norm_chart_leaves_non_finite_norms_out():
    """A model whose output is NaN for some tokens: the medians drawn took NaN as the largest value."""
    import duckdb

    from actlake.analysis.residual_norms import ResidualNorms

    con = duckdb.connect()
    con.execute("CREATE TABLE residual_norms AS SELECT * FROM (VALUES (0, 1.0), (0, 2.0), (0, 3.0), "
                "(0, 'NaN'::DOUBLE), (0, 'NaN'::DOUBLE), (0, 'inf'::DOUBLE)) t(layer, norm)")
    df = ResidualNorms.charts(con)[0][1][2].data  # the layered chart's data
    assert df["median"].tolist() == [2.0] and df["mean"].tolist() == [2.0]
