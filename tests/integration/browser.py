"""Open a report in a real headless Chromium (Playwright) and say what it drew."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None and os.environ.get("CI") != "true",
                                    reason="chromium not installed (CI installs it)")


def open_report(path) -> dict:
    """errors (console + page), charts [(id, svg count)], marks per svg, table rows, requested URLs."""
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
            page.goto(f"file://{path}")
            page.wait_for_function(
                "[...document.querySelectorAll('.chart')].every(c => c.querySelector('svg'))", timeout=30000)
            charts = page.eval_on_selector_all(".chart", "els => els.map(e => [e.id, e.querySelectorAll('svg').length])")
            marks = page.eval_on_selector_all(".chart svg", "els => els.map(e => e.querySelectorAll('path, circle, rect').length)")
            rows = page.eval_on_selector_all("table.t1 tr", "rows => rows.length")
        finally:
            browser.close()
    return {"errors": errors, "charts": charts, "marks": marks, "table_rows": rows, "requests": requests}
