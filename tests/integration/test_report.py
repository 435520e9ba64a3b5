"""The report opens in a real headless Chromium, offline, with every chart drawn and no console errors."""

from __future__ import annotations

import pytest

from actlake.jobs.run import run_job
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
                "contributions.png", "geometry_norms.png", "keynorm_mass.png", "attention_by_distance.png"):
        data = (report.parent / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@needs_chromium
def test_report_renders_in_headless_chromium(report_run):
    seen = open_report(report_run.report)
    errors, charts, marks, table1, requests = (seen[k] for k in ("errors", "charts", "marks", "table_rows", "requests"))
    assert errors == []
    ids = {i for i, _ in charts}
    assert {"chart-dim_means", "chart-attention_mass", "chart-residual_norms", "chart-outlier_dims_by_category",
            "chart-contributions", "chart-geometry_norms", "chart-keynorm_mass", "chart-attention_by_distance"} <= ids
    assert all(n >= 1 for _, n in charts)
    assert min(marks) > 10
    assert table1 > 3  # header plus a row per (layer, outlier dimension)
    assert all(u.startswith("file://") for u in requests)
