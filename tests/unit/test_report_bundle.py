"""The report page's Vega bundle is vl-convert's own, kept per vl-convert version in actlake's cache folder."""

from __future__ import annotations

import vl_convert as vlc

from actlake.jobs.report import vega_bundle


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
