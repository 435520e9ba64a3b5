"""The report opens in a real headless Chromium, offline, with every chart drawn and no console errors."""

from __future__ import annotations

import os
import shutil

import pytest

from actlake.jobs.run import run_job
from tests.conftest import job_config

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


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


@pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true", reason="chromium not installed (CI installs it)")
def test_report_renders_in_headless_chromium(report_run):
    from playwright.sync_api import sync_playwright

    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(f"file://{report_run.report}")
            page.wait_for_function(
                "[...document.querySelectorAll('.chart')].every(c => c.querySelector('svg'))", timeout=30000)
            charts = page.eval_on_selector_all(".chart", "els => els.map(e => [e.id, e.querySelectorAll('svg').length])")
            marks = page.eval_on_selector_all(".chart svg", "els => els.map(e => e.querySelectorAll('path, circle, rect').length)")
            table1 = page.eval_on_selector_all("table.t1 tr", "rows => rows.length")
        finally:
            browser.close()
    assert errors == []
    ids = {i for i, _ in charts}
    assert {"chart-dim_means", "chart-attention_mass", "chart-residual_norms", "chart-outlier_dims_by_category",
            "chart-contributions", "chart-geometry_norms", "chart-keynorm_mass", "chart-attention_by_distance"} <= ids
    assert all(n >= 1 for _, n in charts)
    assert min(marks) > 10
    assert table1 > 3  # header plus a row per (layer, outlier dimension)
    assert all(u.startswith("file://") for u in requests)
