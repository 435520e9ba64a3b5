"""The report page every job writes: one self-contained HTML page (Vega inlined, works offline) plus a PNG
per chart, replacing ``report/`` as a whole."""

from __future__ import annotations

import html
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import ObjectPath, location, open_regular, write_atomic
from actlake.storage.layout import RunLayout

log = logging.getLogger("actlake.report")


def open_for_report(run_dir: str | Path, tables: tuple[str, ...], missing: str):
    """(layout, read-only DuckDB connection) of a run that has at least one of ``tables``; otherwise
    StorageError "<run>: <missing>". The caller closes the connection."""
    from actlake.storage.sql import open_run

    layout = RunLayout(location(run_dir))
    if not any((layout.tables / t).exists() for t in tables):
        raise StorageError(f"{layout.root}: {missing}")
    return layout, open_run(layout.root)


def write_page(layout: RunLayout, blocks: list, header_html: str = "") -> Path:
    """Write ``report/report.html`` from ``blocks`` — (slug, title, altair chart) or raw HTML strings —
    and ``report/<slug>.png`` per chart, titled; the page inlines Vega and needs no network."""
    import altair as alt
    import vl_convert as vlc

    files: dict[str, bytes] = {}
    sections, specs = [], {}
    for block in blocks:
        if isinstance(block, str):
            sections.append(block)
            continue
        slug, title, chart = block
        spec = chart.to_dict()
        specs[slug] = spec  # the page gives it a heading; a PNG on its own carries the title itself
        png = chart.properties(title=alt.TitleParams(title, anchor="start", limit=900)).to_dict()
        files[f"{slug}.png"] = vlc.vegalite_to_png(png, scale=1.5)
        sections.append(f"<section><h2>{html.escape(title)}</h2><div class='chart' id='chart-{slug}'></div></section>")
    bundle = vega_bundle().replace("</script>", "<\\/script>")
    embed = "\n".join(
        f"vegaEmbed('#chart-{slug}', {script_json(spec)}, {{actions: false, renderer: 'svg'}})"
        f".catch(e => {{ console.error(e); document.getElementById('chart-{slug}').textContent = 'chart failed: ' + e; }});"
        for slug, spec in specs.items()
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>actlake report: {html.escape(layout.root.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}} table.summary th{{text-align:left;padding-right:1em}} table.t1 td,table.t1 th{{padding:2px 8px;text-align:right}}</style>
<script>{bundle}</script></head>
<body><h1>actlake report: {html.escape(layout.root.name)}</h1>
{header_html}
{''.join(sections)}
<script>{embed}</script>
</body></html>"""
    files["report.html"] = page.encode("utf-8")
    _replace_report(layout, files)
    return layout.report / "report.html"


def vega_bundle() -> str:
    """vl-convert's JavaScript bundle of Vega, Vega-Lite and vega-embed that the page inlines (about 0.9 MB).
    vl-convert takes 1-2 s of CPU to build it, so it is kept per vl-convert version in actlake's cache folder
    (:func:`~actlake.storage.verified.cache_dir`); where that folder cannot be written it is built each time."""
    import vl_convert as vlc

    from actlake.storage.verified import cache_dir

    cached = cache_dir() / f"vega-bundle-{vlc.__version__}.js"
    try:
        text = cached.read_text(encoding="utf-8")
        if text:
            return text
    except (OSError, ValueError):  # not there yet, or not text
        pass
    bundle = vlc.javascript_bundle()
    try:
        write_atomic(cached, bundle.encode("utf-8"))
    except OSError as e:  # a read-only home
        log.info("cannot keep the Vega bundle in %s (%s)", cached, e)
    return bundle


def script_json(value) -> str:
    """``value`` as JSON that is safe inside an HTML ``<script>`` element: no ``<``, ``>`` or ``&`` (corpus labels and
    token pieces in a chart's data could otherwise close the element and open another, ``</script><script>``), nor
    the line separators JavaScript reads as line ends."""
    text = json.dumps(value)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def check_ours(report: Path, new: set) -> None:
    """A ``report/`` folder a new report (of files ``new``) may replace: none, or one an earlier report wrote: its
    ``report.html`` has actlake's title and the rest are PNGs, or, with the page deleted, PNGs the new report writes
    again. Anything else (``actlake report --compare --out DIR`` where DIR holds a folder of the user's named
    ``report``, a link) is refused naming it: nothing overwrites what actlake did not write."""
    if not os.path.lexists(report):
        return
    if report.is_symlink() or not report.is_dir():
        raise StorageError(f"{report} exists and is not a report folder actlake wrote (a link or a file); "
                           "remove it or write the report elsewhere")
    names = sorted(p.name for p in report.iterdir())
    page = report / "report.html"
    head = b""
    if page.is_file() and not page.is_symlink():
        with open_regular(page) as f:
            head = f.read(512)
    ours = b"<title>actlake report:" in head
    foreign = [n for n in names if not ((ours and n.endswith(".png")) or n in new) or (n == "report.html" and not ours)]
    if foreign:
        raise StorageError(f"{report} holds files no actlake report wrote ({', '.join(foreign[:3])}); "
                           "remove them or write the report elsewhere")


def _replace_report(layout: RunLayout, files: dict[str, bytes]) -> None:
    """Put ``files`` in ``report/`` as a whole: on a disk they are written to a new folder that then takes
    the old one's place, so a failed write (a full disk) keeps the previous report and names the folder;
    in an object store each file is one PUT, the page last."""

    if isinstance(layout.report, ObjectPath):
        for name in sorted(files, key=lambda n: n == "report.html"):
            write_atomic(layout.report / name, files[name])
        return
    check_ours(layout.report, set(files))
    tmp, old = (layout.root / f".report-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("new", "old"))
    try:
        tmp.mkdir()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if layout.report.exists():
            os.replace(layout.report, old)
        os.replace(tmp, layout.report)
    except OSError as e:
        if old.exists() and not layout.report.exists():
            os.replace(old, layout.report)
        raise StorageError(f"{layout.report}: cannot write the report ({e.strerror or e}); "
                           f"{'the previous report is kept' if layout.report.exists() else 'no report written'}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
