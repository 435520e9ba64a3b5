"""A deterministic Pile-format sample corpus from text every Debian/Python machine has.

Sources (``meta.pile_set_name``):

- ``PythonSource``: Python standard-library modules (code);
- ``Docstrings``: their module, class and function docstrings (English prose);
- ``PydocTopics``: the interpreter's help topics (``pydoc_data.topics``);
- ``Licenses``: license texts (``/usr/share/common-licenses``, Python's LICENSE);
- ``DebianCopyright``: package copyright files (``/usr/share/doc/*/copyright``).

The same machine and arguments always give byte-identical files.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

MAX_CHARS = 6000


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py")] + [p for p in root.glob("*/*.py") if "test" not in p.parts[-2]]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def _read(p: Path) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def python_source() -> Iterator[str]:
    for p in _stdlib_files():
        text = _read(p)
        if text and len(text) > 200:
            yield text[:MAX_CHARS]


def docstrings() -> Iterator[str]:
    for p in _stdlib_files():
        text = _read(p)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in [tree] + [n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]:
            doc = ast.get_docstring(node)
            if doc and len(doc) > 120:
                yield doc[:MAX_CHARS]


def pydoc_topics() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return
    for key in sorted(topics):
        if len(topics[key]) > 200:
            yield topics[key][:MAX_CHARS]


def licenses() -> Iterator[str]:
    paths = sorted(Path("/usr/share/common-licenses").glob("*"))
    paths.append(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt")
    for p in paths:
        if p.is_file():
            text = _read(p)
            if text:
                for i in range(0, min(len(text), 4 * MAX_CHARS), MAX_CHARS):
                    yield text[i : i + MAX_CHARS]


def debian_copyright() -> Iterator[str]:
    for p in sorted(Path("/usr/share/doc").glob("*/copyright")):
        text = _read(p)
        if text and len(text) > 200:
            yield text[:MAX_CHARS]


SOURCES = {
    "PythonSource": python_source,
    "Docstrings": docstrings,
    "PydocTopics": pydoc_topics,
    "Licenses": licenses,
    "DebianCopyright": debian_copyright,
}


def sample_documents(n_docs: int) -> list[dict]:
    """Round-robin over the sources until ``n_docs`` documents (fewer if the machine has less text)."""
    iters = {name: fn() for name, fn in SOURCES.items()}
    docs: list[dict] = []
    while len(docs) < n_docs and iters:
        for name in list(iters):
            try:
                text = next(iters[name])
            except StopIteration:
                del iters[name]
                continue
            docs.append({"text": text, "meta": {"pile_set_name": name}})
            if len(docs) >= n_docs:
                break
    return docs


def write_sample(out_dir: str | os.PathLike, n_docs: int = 400, n_files: int = 2) -> list[Path]:
    """Write ``n_files`` Pile-format shards as ``.jsonl`` and ``.jsonl.zst``; return the written paths."""
    import zstandard

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = sample_documents(n_docs)
    written = []
    for i in range(n_files):
        part = docs[i::n_files]
        data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in part).encode("utf-8")
        for name, payload in ((f"{i:02d}.jsonl", data), (f"{i:02d}.jsonl.zst", zstandard.ZstdCompressor(level=10).compress(data))):
            tmp = out / f".{name}.tmp"
            tmp.write_bytes(payload)
            os.replace(tmp, out / name)
            written.append(out / name)
    labels = sorted({d["meta"]["pile_set_name"] for d in docs})
    print(f"wrote {len(docs)} documents from {len(labels)} sources ({', '.join(labels)}) to {out}/ "
          f"as {n_files} .jsonl and {n_files} .jsonl.zst files", file=sys.stderr)
    return written
