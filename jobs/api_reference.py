"""docs/api.md, the API reference a custom analysis uses, generated as Markdown from the docstrings (top layer).

Read where a user reads it: on GitHub unbuilt, and on the site as any other page. Every public attribute,
property and method of each class is listed with its type and docstring (the shapes are in the docstrings);
Sphinx roles (``:class:`~x.Y```) become code spans. The sources are read by griffe (installed with the docs
and test extras) from a copy laid out as the installed package is (``jobs/`` as ``actlake/jobs`` ...).
``scripts/sync_docs.py`` writes the page; ``tests/unit/test_docs.py`` checks it is current."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"actlake": "actlake", "jobs": "actlake/jobs", "analysis": "actlake/analysis", "storage": "actlake/storage"}

PAGE = [
    ("The protocol", ["analysis.protocol.Producer", "analysis.protocol.Analysis", "analysis.protocol.ShardTable",
                      "analysis.protocol.OneTable", "analysis.protocol.LabelsOf",
                      "analysis.protocol.TokenValues", "analysis.protocol.ModelSpec", "analysis.protocol.HiddenBatch",
                      "analysis.protocol.LogitsBatch", "analysis.protocol.BatchOutputs", "analysis.protocol.Site",
                      "analysis.protocol.Product"]),
    ("What `add_layer` receives", ["analysis.engine.layer_qk.LayerQK", "analysis.engine.layer_qk.BatchInfo"]),
    ("Table helpers", ["analysis.stats", "analysis.engine.grid"]),
    ("Reading a run from Python", ["open_run", "query"]),
]
"""The page's sections and what each documents (paths inside the ``actlake`` package)."""

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|attr|mod|obj|exc|const):`(~?)([^`]+)`")
FIELD = re.compile(r"^:(param|parameter|arg|returns?|raises?)\s*([^:]*):\s*", re.MULTILINE)


def api_page() -> str:
    """The whole of docs/api.md."""
    import griffe

    with tempfile.TemporaryDirectory() as tmp:
        for folder, place in FOLDERS.items():
            shutil.copytree(ROOT / folder, Path(tmp) / place, ignore=shutil.ignore_patterns("__pycache__"))
        package = griffe.load("actlake", search_paths=[tmp], try_relative_path=False, docstring_parser=None)
        out = ["<!-- Generated from the docstrings by scripts/sync_docs.py: edit the code, not this page. -->",
               "# API reference", "",
               "What a custom producer uses. How the pieces fit: [Writing an analysis](writing-an-analysis.md). "
               "Shapes: B sequences, T positions, H query heads (H_kv key/value heads), d_h head width, d model "
               "width, C token categories, L layers.", ""]
        for title, paths in PAGE:
            out += [f"## {title}", ""]
            for path in paths:
                out += _object(_get(package, path), 3, f"actlake.{path}")
    return "\n".join(out).rstrip() + "\n"


def _get(package, path: str):
    obj = package
    for part in path.split("."):
        obj = obj.members[part]
    return obj.final_target if obj.is_alias else obj


def _object(obj, level: int, name: str | None = None) -> list[str]:
    """``obj``'s section, behind an anchor named by the dotted path it is documented under (``name``, default its
    own: ``api.md#actlake.analysis.protocol.Analysis``)."""
    return [f'<a id="{name or obj.path}"></a>', "", *_section(obj, level)]


def _section(obj, level: int) -> list[str]:
    kind = obj.kind.value
    if kind == "module":
        out = [f"{'#' * level} `actlake.{obj.path.split('.', 1)[1]}`", "", *_doc(obj)]
        for member in obj.members.values():
            if not member.is_alias and _public(member.name) and member.kind.value in ("class", "function"):
                out += _object(member, level + 1)
        return out
    if kind == "function":
        return [f"{'#' * level} `{obj.name}{_signature(obj)}`", "", *_doc(obj)]
    if kind == "attribute":
        return [f"{'#' * level} `{obj.name}`", "", f"`{obj.name} = {obj.value}`", "", *_doc(obj)]
    bases = f"({', '.join(str(b) for b in obj.bases)})" if obj.bases else ""
    out = [f"{'#' * level} `{obj.name}{bases}`", "", *_doc(obj)]
    attrs = [m for m in obj.members.values() if m.kind.value == "attribute" and _public(m.name)]
    if attrs:
        out += ["| attribute | type | what |", "|---|---|---|"]
        for a in attrs:
            note = " (property)" if "property" in a.labels else ""
            doc = " ".join(_text(a.docstring.value).split()) if a.docstring else ""
            cells = [f"`{a.name}`{note}", f"`{a.annotation}`" if a.annotation else f"`= {a.value}`", doc]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    for m in obj.members.values():
        if m.kind.value == "function" and _public(m.name):
            labels = sorted(m.labels & {"classmethod", "staticmethod", "abstractmethod"})
            tag = f" *({', '.join(labels)})*" if labels else ""
            out += [f"{'#' * (level + 1)} `{obj.name}.{m.name}{_signature(m)}`{tag}", "", *_doc(m)]
    return out


def _public(name: str) -> bool:
    return not name.startswith("_")


def _signature(fn) -> str:
    params = []
    for p in fn.parameters:
        if p.name in ("self", "cls"):
            continue
        star = {"variadic positional": "*", "variadic keyword": "**"}.get(p.kind.value, "")
        text = f"{star}{p.name}" + (f": {p.annotation}" if p.annotation else "")
        params.append(text + (f" = {p.default}" if p.default is not None and not star else ""))
    returns = f" -> {fn.returns}" if fn.returns else ""
    return f"({', '.join(params)}){returns}"


def _doc(obj) -> list[str]:
    return [_text(obj.docstring.value), ""] if obj.docstring else []


def _text(doc: str) -> str:
    """A docstring as Markdown: roles as code spans (``~`` keeps the last name), fields as list items, RST's
    double backquotes as single ones."""
    doc = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", doc)
    doc = FIELD.sub(lambda m: f"- **{m.group(1)}** `{m.group(2).strip()}`: " if m.group(2).strip()
                    else f"- **{m.group(1)}**: ", doc)
    return doc.replace("``", "`")
