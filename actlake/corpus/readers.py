"""Streaming readers: each yields the records of one file in order, by index.

A record that cannot be used (malformed JSON, including nesting too deep to parse and
integers too long to convert, invalid UTF-8, text that cannot be encoded to UTF-8, no
text) is yielded as a :class:`Reject` with its index, so one bad line never drops a whole
file. A file that cannot be read at all (truncated ``.zst``, corrupt Parquet), or that
holds fewer records than the plan's range, raises :class:`CorpusError` naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, Union

from actlake.errors import CorpusError


@dataclass(frozen=True)
class Record:
    index: int
    """Record number within its file (line number - 1 for jsonl, row for Parquet)."""
    text: str
    source: str


@dataclass(frozen=True)
class Reject:
    index: int
    reason: str
    """One of: malformed_json, invalid_utf8, invalid_text, not_an_object, missing_text, empty_text
    (and, from the extractor, too_few_tokens and tokenizer_error)."""
    detail: str


Item = Union[Record, Reject]


def file_format(path: str, declared: str = "auto") -> str:
    if declared != "auto":
        return declared
    if path.endswith((".jsonl", ".json", ".jsonl.zst")):
        return "jsonl"
    if path.endswith(".parquet"):
        return "parquet"
    raise CorpusError(f"{path}: unknown corpus format (expected .jsonl, .jsonl.zst or .parquet)")


def _get(obj, dotted: str):
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _zst_chunks(path: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Decompressed bytes of every frame; raises if the file ends inside a frame."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        dobj = dctx.decompressobj()
        in_frame = False
        while True:
            data = f.read(chunk)
            if not data:
                break
            while data:
                out = dobj.decompress(data)
                in_frame = not dobj.eof
                if out:
                    yield out
                data = dobj.unused_data if dobj.eof else b""
                if dobj.eof:
                    dobj = dctx.decompressobj()
                    in_frame = False
        if in_frame:
            raise CorpusError(f"{path}: truncated zstd file (ends inside a frame)")


def _raw_chunks(path: str, chunk: int = 1 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while data := f.read(chunk):
            yield data


def _lines(path: str) -> Iterator[bytes]:
    """Lines (with their newline) of a plain or zstd-compressed file, streamed."""
    chunks = _zst_chunks(path) if path.endswith(".zst") else _raw_chunks(path)
    rest = b""
    try:
        for data in chunks:
            parts = (rest + data).split(b"\n")
            rest = parts.pop()
            for part in parts:
                yield part + b"\n"
        if rest:
            yield rest
    except CorpusError:
        raise
    except Exception as e:  # zstd errors, OS errors
        raise CorpusError(f"{path}: cannot read corpus file ({type(e).__name__}: {e}); the file may be truncated or corrupt") from None


def _parse_json_line(index: int, line: bytes, text_field: str, source_field: str) -> Item:
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(index, "invalid_utf8", f"byte {e.start}: {e.reason}")
    try:
        obj = json.loads(s)
    except RecursionError:
        return Reject(index, "malformed_json", "nested too deeply to parse")
    except ValueError as e:  # JSONDecodeError, and integers beyond Python's digit limit
        return Reject(index, "malformed_json", str(e)[:200])
    if not isinstance(obj, dict):
        return Reject(index, "not_an_object", f"got {type(obj).__name__}")
    text = _get(obj, text_field)
    if not isinstance(text, str):
        return Reject(index, "missing_text", f"field {text_field!r} missing or not a string")
    if not text.strip():
        return Reject(index, "empty_text", "")
    source = _get(obj, source_field)
    source = str(source) if source is not None else "unknown"
    for name, value in ((text_field, text), (source_field, source)):
        bad = _unencodable(value)
        if bad:
            return Reject(index, "invalid_text", f"field {name!r}: {bad}")
    return Record(index, text, source)


def _unencodable(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate from a JSON escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"character {e.start}: {e.reason} ({text[e.start]!r})"
    return None


def iter_jsonl(path: str, start: int, end: int, text_field: str, source_field: str) -> Iterator[Item]:
    """Records ``start <= index < end`` of a jsonl or jsonl.zst file (blank lines count as empty_text)."""
    for index, line in enumerate(_lines(path)):
        if index < start:
            continue
        if index >= end:
            break
        yield _parse_json_line(index, line.rstrip(b"\r\n"), text_field, source_field)


def iter_parquet(path: str, start: int, end: int, text_field: str, source_field: str) -> Iterator[Item]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        top = text_field.split(".")[0]
        src_top = source_field.split(".")[0]
        cols = [c for c in dict.fromkeys([top, src_top]) if c in pf.schema_arrow.names]
        index = 0
        for batch in pf.iter_batches(batch_size=1024, columns=cols):
            for row in batch.to_pylist():
                if start <= index < end:
                    text = _get(row, text_field)
                    if not isinstance(text, str):
                        yield Reject(index, "missing_text", f"column {text_field!r} missing or not a string")
                    elif not text.strip():
                        yield Reject(index, "empty_text", "")
                    else:
                        src = _get(row, source_field)
                        yield Record(index, text, str(src) if src is not None else "unknown")
                index += 1
                if index >= end:
                    return
    except CorpusError:
        raise
    except Exception as e:
        raise CorpusError(f"{path}: cannot read Parquet corpus file ({type(e).__name__}: {e})") from None


def iter_hf(name: str, split: str, start: int, end: int, text_field: str, source_field: str) -> Iterator[Item]:
    ds = load_hf(name, split)
    for index in range(start, min(end, len(ds))):
        row = ds[index]
        text = _get(row, text_field)
        if not isinstance(text, str):
            yield Reject(index, "missing_text", f"field {text_field!r} missing or not a string")
        elif not text.strip():
            yield Reject(index, "empty_text", "")
        else:
            src = _get(row, source_field)
            yield Record(index, text, str(src) if src is not None else "unknown")


def load_hf(name: str, split: str):
    try:
        import datasets
    except ImportError:
        raise CorpusError("corpus.format 'hf' needs the datasets library: pip install 'actlake[hf]'") from None
    import os

    try:
        if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
            ds = datasets.load_from_disk(name)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise CorpusError(f"hf dataset {name!r} (split {split!r}): cannot load ({type(e).__name__}: {e})") from None


def count_records(path: str, fmt: str) -> int:
    """Number of records in a file (one pass; Parquet reads only the footer)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as e:
            raise CorpusError(f"{path}: cannot read Parquet corpus file ({type(e).__name__}: {e})") from None
    return sum(1 for _ in _lines(path))


def iter_items(path: str, fmt: str, start: int, end: int, text_field: str, source_field: str, hf_split: str = "train") -> Iterator[Item]:
    """Records ``start <= index < end`` of one input, as many as it has (see :func:`iter_range`)."""
    if fmt == "jsonl":
        return iter_jsonl(path, start, end, text_field, source_field)
    if fmt == "parquet":
        return iter_parquet(path, start, end, text_field, source_field)
    if fmt == "hf":
        return iter_hf(path, hf_split, start, end, text_field, source_field)
    raise CorpusError(f"{path}: unknown corpus format {fmt!r}")


def iter_range(path: str, fmt: str, start: int, end: int, text_field: str, source_field: str, hf_split: str = "train") -> Iterator[Item]:
    """Every record ``start <= index < end`` of one input (a shard's range): an input that ends before
    ``end`` (it shrank after planning) raises CorpusError naming it, the range and what was read."""
    n = 0
    for item in iter_items(path, fmt, start, end, text_field, source_field, hf_split):
        n += 1
        yield item
    if n != end - start:
        got = f"records {start}-{start + n - 1}" if n else "no record"
        raise CorpusError(f"{path}: planned records {start}-{end - 1} but read {got} ({n} of {end - start}); "
                          f"the input shrank after planning")
