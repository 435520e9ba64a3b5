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


def test_a_report_replaces_only_a_report_folder_actlake_wrote(tmp_path):
    """Principle 2 (issue 50): ``report --compare --out DIR`` over a DIR holding the user's own ``report`` folder (or a
    link named so) is refused naming it, and nothing of it is touched; an earlier report is replaced whole."""
    import pytest

    from actlake.errors import StorageError
    from actlake.jobs.common.page import _replace_report
    from actlake.storage.layout import RunLayout

    page = b"<!doctype html>\n<html><head><meta charset='utf-8'><title>actlake report: x</title>"
    layout = RunLayout(tmp_path / "out")
    layout.report.mkdir(parents=True)
    (layout.report / "thesis.tex").write_text("mine")
    with pytest.raises(StorageError, match=r"report holds files no actlake report wrote \(thesis.tex\)"):
        _replace_report(layout, {"report.html": page})
    assert (layout.report / "thesis.tex").read_text() == "mine" and not (layout.report / "report.html").exists()
    (layout.report / "thesis.tex").unlink()
    (layout.report / "report.html").write_text("<html><title>my own page</title>")
    with pytest.raises(StorageError, match="report.html"):
        _replace_report(layout, {"report.html": page})
    mine = tmp_path / "elsewhere"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    (layout.report / "report.html").unlink()
    layout.report.rmdir()
    layout.report.symlink_to(mine)
    with pytest.raises(StorageError, match="a link or a file"):
        _replace_report(layout, {"report.html": page})
    assert (mine / "keep.txt").read_text() == "mine"
    layout.report.unlink()
    _replace_report(layout, {"report.html": page, "a.png": b"1"})
    _replace_report(layout, {"report.html": page + b"2", "b.png": b"2"})  # an earlier report: replaced whole
    assert sorted(p.name for p in layout.report.iterdir()) == ["b.png", "report.html"]
    (layout.report / "report.html").unlink()  # the page deleted (the tour does): its charts are the new report's
    _replace_report(layout, {"report.html": page, "b.png": b"3"})
    assert (layout.report / "b.png").read_bytes() == b"3"
    (layout.report / "report.html").unlink()
    with pytest.raises(StorageError, match=r"\(b.png\)"):  # without the page, PNGs the new report does not write
        _replace_report(layout, {"report.html": page, "c.png": b"4"})
    assert [p.name for p in layout.root.iterdir()] == ["report"]  # no leftovers
