"""The sample corpus: the same Pile-format documents on every machine.

``actlake corpus sample`` writes the first N of the 1,000 documents shipped with the package
(:data:`BUNDLE`, 0.46 MB), so every machine gets byte-identical files and the same numbers. The bundle
was built once (:func:`build_bundle`, ``python -m actlake.corpus.sample BUNDLE``) from text a
Debian/Python machine has, round-robin over five sources (``meta.pile_set_name``):

- ``PythonSource``: Python standard-library modules (code);
- ``Docstrings``: their module, class and function docstrings (English prose);
- ``PydocTopics``: the interpreter's help topics (``pydoc_data.topics``);
- ``Licenses``: license texts (``/usr/share/common-licenses``, Python's LICENSE);
- ``DebianCopyright``: package copyright files (``/usr/share/doc/*/copyright``).

A written sample carries ``SAMPLE.json`` (its documents, files, the bundle's sha256 and each file's), so a
folder can be checked against what the arguments ask for (:func:`check_sample`).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from actlake.errors import ConfigError, CorpusError
from actlake.fs import read_regular

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
        from pydoc_data.topics import topics  # 0.7 MB of text, absent from some Pythons: imported when used
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


BUNDLE = Path(__file__).resolve().parents[1] / "sample_corpus.jsonl.zst"
"""The shipped documents (jsonl, zstd)."""
BUNDLE_SHA256 = "3e93a8e1f587db813288b2080f16b7d8d471a87e90f57705856c775a4ea0a596"
"""sha256 of the bundle's decompressed jsonl: what every sample is cut from."""
BUNDLE_DOCS = 1000
RECORD = "SAMPLE.json"


def machine_documents(n_docs: int) -> list[dict]:
    """Round-robin over this machine's sources until ``n_docs`` documents (fewer if it has less text): how the
    bundle was made. Differs between machines; use :func:`sample_documents` for the shipped ones."""
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


def build_bundle(path: str | os.PathLike = BUNDLE, n_docs: int = BUNDLE_DOCS) -> str:
    """Write this machine's documents as the bundle; returns the sha256 of its jsonl (set BUNDLE_SHA256 to it)."""
    import zstandard

    data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in machine_documents(n_docs)).encode("utf-8")
    Path(path).write_bytes(zstandard.ZstdCompressor(level=19).compress(data))
    return hashlib.sha256(data).hexdigest()


def sample_documents(n_docs: int) -> list[dict]:
    """The first ``n_docs`` shipped documents (at most :data:`BUNDLE_DOCS`)."""
    import zstandard

    if not 1 <= n_docs <= BUNDLE_DOCS:
        raise ConfigError(f"--docs: the sample corpus has 1 to {BUNDLE_DOCS:,} documents, not {n_docs:,}")
    data = zstandard.ZstdDecompressor().decompress(BUNDLE.read_bytes(), max_output_size=64 << 20)
    if hashlib.sha256(data).hexdigest() != BUNDLE_SHA256:
        raise CorpusError(f"{BUNDLE}: its contents differ from the shipped sample corpus (sha256); reinstall actlake")
    return [json.loads(line) for line in data.decode("utf-8").splitlines()[:n_docs]]


def _files(n_files: int) -> list[str]:
    return [f"{i:02d}.{ext}" for i in range(n_files) for ext in ("jsonl", "jsonl.zst")]


def write_sample(out_dir: str | os.PathLike, n_docs: int = 400, n_files: int = 2) -> list[Path]:
    """Write ``n_files`` Pile-format shards as ``.jsonl`` and ``.jsonl.zst`` (documents dealt round-robin), then
    ``SAMPLE.json``; return the written corpus files."""
    import zstandard

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = sample_documents(n_docs)
    written, digests = [], {}
    for i in range(n_files):
        part = docs[i::n_files]
        data = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in part).encode("utf-8")
        for name, payload in ((f"{i:02d}.jsonl", data), (f"{i:02d}.jsonl.zst", zstandard.ZstdCompressor(level=10).compress(data))):
            tmp = out / f".{name}.tmp"
            tmp.write_bytes(payload)
            os.replace(tmp, out / name)
            written.append(out / name)
            digests[name] = hashlib.sha256(payload).hexdigest()
    record = {"documents": n_docs, "files": n_files, "bundle_sha256": BUNDLE_SHA256, "sha256": digests}
    (out / f".{RECORD}.tmp").write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(out / f".{RECORD}.tmp", out / RECORD)
    labels = sorted({d["meta"]["pile_set_name"] for d in docs})
    print(f"wrote {len(docs)} documents from {len(labels)} sources ({', '.join(labels)}) to {out}/ "
          f"as {n_files} .jsonl and {n_files} .jsonl.zst files", file=sys.stderr)
    return written


def check_sample(out_dir: str | os.PathLike, n_docs: int = 400, n_files: int = 2) -> bool:
    """True when ``out_dir`` holds exactly the sample these arguments write (its files' sha256 as recorded);
    False when it holds none or another sample actlake wrote (write it again). A folder with files that are
    not a sample's is a ConfigError naming it: nothing of it is overwritten."""
    out = Path(out_dir)
    if not out.is_dir():
        return False
    present = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    mine = set(_files(max(n_files, 1))) | {RECORD} | {f for f in present if f.endswith((".jsonl", ".jsonl.zst"))
                                                    and f.split(".")[0].isdigit()}
    if RECORD not in present or set(present) - mine:
        raise ConfigError(f"{out}: not a sample corpus written by this version of `actlake corpus sample` "
                          f"({', '.join(present[:5]) or 'empty'}{' …' if len(present) > 5 else ''}); move it away or "
                          "delete it, and run the command again")
    try:
        record = json.loads(read_regular(out / RECORD, error=ConfigError))  # a FIFO there: refused, never read
    except (OSError, ValueError):
        return False
    want = {"documents": n_docs, "files": n_files, "bundle_sha256": BUNDLE_SHA256}
    if any(record.get(k) != v for k, v in want.items()) or sorted(record.get("sha256", {})) != sorted(_files(n_files)):
        return False
    return all((out / name).is_file() and hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
               for name, digest in record["sha256"].items())


def ensure_sample(out_dir: str | os.PathLike, n_docs: int = 400, n_files: int = 2) -> bool:
    """Write the sample unless ``out_dir`` holds it already (:func:`check_sample`); True when it was written."""
    if check_sample(out_dir, n_docs, n_files):
        print(f"{out_dir}/ holds the sample corpus already ({n_docs} documents, {n_files} files)", file=sys.stderr)
        return False
    for stale in Path(out_dir).glob("[0-9]*.jsonl*") if Path(out_dir).is_dir() else []:
        stale.unlink()  # another sample of ours: written again whole
    write_sample(out_dir, n_docs, n_files)
    return True


if __name__ == "__main__":
    print(build_bundle(sys.argv[1] if len(sys.argv) > 1 else BUNDLE))
