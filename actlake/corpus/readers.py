"""Streaming readers: each yields the records of one file in order, by index.

A record that cannot be used (malformed JSON, including nesting too deep to parse and
integers too long to convert, invalid UTF-8, text that cannot be encoded to UTF-8, no
text) is yielded as a :class:`Reject` with its index, so one bad line never drops a whole
file. A file that cannot be read at all (truncated ``.zst``, corrupt Parquet), or that
holds fewer records than the plan's range, raises :class:`CorpusError` naming it.

A shard does not decode its file from the start: the plan hands it an :class:`Entry` (from the
file's index, ``actlake/corpus/index.py``), a byte offset where a record starts — in the file
itself for plain jsonl, in a seekable multi-frame copy for ``.jsonl.zst`` — and Parquet readers
start at the row group holding the first record. :class:`ReadStats` counts what a read decoded.

Every path may be a local file or an object-store URL (``s3://bucket/key``, ``gs://…``, ``hf://…``):
URLs are opened through :func:`actlake.fs.open_input` (a seekable ``pyarrow`` file whose reads are
ranged GETs), so a shard reads only the bytes from its entry point on, and a Parquet shard only the
footer and the column chunks of its row groups; nothing is downloaded whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Union

from actlake.errors import CorpusError
from actlake.fs import open_input, url_scheme


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


@dataclass(frozen=True)
class Entry:
    """Where to start reading a jsonl input: ``file`` (the input, or its seekable ``.zst`` copy) at
    byte ``offset`` holds the start of record ``record`` (for ``.zst``, the start of a frame)."""

    file: str
    offset: int
    record: int


@dataclass
class ReadStats:
    """What one read decoded: bytes out of the decompressor (or read, plain files), records split off
    and dropped before the range, Parquet rows decoded (range included)."""

    bytes_decoded: int = 0
    records_skipped: int = 0
    rows_decoded: int = 0


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


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in an object store (``s3://…``) rather than a local file."""

    scheme = url_scheme(path)
    return scheme is not None and scheme != "file"


def open_file(path: str):
    """A seekable binary reader of a local file or an object-store URL."""

    return open_input(path)


REMOTE_SCAN_CHUNK = 8 << 20
"""Bytes per read when an object is scanned whole (counting, indexing, hashing): each read of an
object-store file is one ranged GET, so whole-object scans read in larger pieces than local ones."""


ZSTD_BLOCK = 128 << 10
"""The most one zstd block decompresses to (RFC 8878)."""


def _zst_pieces(f, chunk: int, path: str) -> Iterator[bytes]:
    """The compressed bytes of ``f`` cut at zstd block boundaries (RFC 8878), so that each piece
    decompresses to at most ``chunk`` bytes (its blocks, 128 KiB each at most): a few kilobytes that
    expand to gigabytes (a decompression bomb, or one line of 3 GiB) are never decompressed at once.
    Skippable frames are passed over; a stream that ends inside a frame raises CorpusError."""
    buf, pos = b"", 0
    per_piece = 2 * max(1, chunk // ZSTD_BLOCK)

    def take(n: int) -> bytes | None:
        nonlocal buf, pos
        while len(buf) - pos < n:
            more = f.read(max(chunk, n))
            if not more:
                if len(buf) - pos == 0:
                    return None
                raise CorpusError(f"{path}: truncated zstd file (ends inside a frame)")
            buf, pos = buf[pos:] + more, 0
        out, pos = buf[pos:pos + n], pos + n
        return out

    while (magic := take(4)) is not None:
        number = int.from_bytes(magic, "little")
        if 0x184D2A50 <= number <= 0x184D2A5F:  # skippable frame
            take(int.from_bytes(take(4), "little"))
            continue
        if number != 0xFD2FB528:
            raise CorpusError(f"{path}: cannot read corpus file (not zstd, or damaged: no frame magic number); "
                              "the file may be truncated or corrupt")
        descriptor = take(1)
        d = descriptor[0]
        fcs = {0: 1 if d & 0x20 else 0, 1: 2, 2: 4, 3: 8}[d >> 6]
        piece = [magic + descriptor + take((0 if d & 0x20 else 1) + (0, 1, 2, 4)[d & 3] + fcs)]
        last = False
        while not last:
            head = take(3)
            b = int.from_bytes(head, "little")
            last, kind, size = bool(b & 1), (b >> 1) & 3, b >> 3
            if kind == 3:
                raise CorpusError(f"{path}: cannot read corpus file (a zstd block of the reserved type); the file "
                                  "may be truncated or corrupt")
            piece += [head, take(1 if kind == 1 else size)]
            if len(piece) >= per_piece:  # at most per_piece / 2 blocks of 128 KiB each: about ``chunk`` out
                yield b"".join(piece)
                piece = []
        if d & 0x04:
            piece.append(take(4))  # the content checksum
        yield b"".join(piece)


def _zst_chunks(path: str, chunk: int = 1 << 20, offset: int = 0) -> Iterator[bytes]:
    """Decompressed bytes of every frame from byte ``offset`` (a frame start), about ``chunk`` at a time;
    raises if the file ends inside a frame. Decompressed a block at a time (:func:`_zst_pieces`)."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    with open_file(path) as f:
        f.seek(offset)
        dobj, held, n = dctx.decompressobj(), [], 0
        for piece in _zst_pieces(f, chunk, path):
            out = dobj.decompress(piece)
            if dobj.eof:
                dobj = dctx.decompressobj()
            if out:
                held.append(out)
                n += len(out)
                if n >= chunk:
                    yield b"".join(held)
                    held, n = [], 0
        if held:
            yield b"".join(held)


def _raw_chunks(path: str, chunk: int = 1 << 20, offset: int = 0) -> Iterator[bytes]:
    with open_file(path) as f:
        f.seek(offset)
        while data := f.read(chunk):
            yield data


def decoded_chunks(path: str, chunk: int = 1 << 20, offset: int = 0) -> Iterator[bytes]:
    """The bytes of a plain or zstd-compressed file from ``offset`` (a frame start for ``.zst``); a
    whole-file scan of an object reads :data:`REMOTE_SCAN_CHUNK` bytes per request."""
    if chunk >= 1 << 20 and is_url(path):
        chunk = max(chunk, REMOTE_SCAN_CHUNK)
    return _zst_chunks(path, chunk, offset) if path.endswith(".zst") else _raw_chunks(path, chunk, offset)


MAX_LINE_BYTES = 64 << 20
"""Default ``corpus.max_line_bytes``: a longer jsonl line is a ``line_too_long`` reject, never held in memory."""

LONG_LINE = b"\x00actlake-line-too-long "
"""How a line over the cap stands in the seekable copy of a ``.zst`` input (``LONG_LINE`` + its length):
no JSON line starts with a NUL byte."""


def long_line(n: int) -> bytes:
    return LONG_LINE + str(n).encode() + b"\n"


def _lines(path: str, offset: int = 0, stats: ReadStats | None = None, chunk: int = 1 << 20,
           max_line: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Lines (with their newline) of a plain or zstd-compressed file from ``offset``, streamed; a line longer
    than ``max_line`` bytes comes as :func:`long_line` of its length, its bytes skipped, never held."""
    chunks = decoded_chunks(path, chunk, offset)
    rest, skipped = b"", 0  # skipped: bytes of an over-long line seen so far (0: not in one)
    try:
        for data in chunks:
            if stats is not None:
                stats.bytes_decoded += len(data)
            if skipped:
                q = data.find(b"\n")
                if q < 0:
                    skipped += len(data)
                    continue
                yield long_line(skipped + q)
                data, skipped = data[q + 1:], 0
            parts = (rest + data).split(b"\n")
            rest = parts.pop()
            for part in parts:
                yield part + b"\n" if len(part) <= max_line else long_line(len(part))
            if len(rest) > max_line:
                rest, skipped = b"", len(rest)
        if skipped:
            yield long_line(skipped)
        elif rest:
            yield rest if len(rest) <= max_line else long_line(len(rest))
    except CorpusError:
        raise
    except Exception as e:  # zstd errors, OS errors
        raise CorpusError(f"{path}: cannot read corpus file ({type(e).__name__}: {e}); the file may be truncated or corrupt") from None


def _parse_json_line(index: int, line: bytes, text_field: str, source_field: str) -> Item:
    if line.startswith(LONG_LINE):
        return Reject(index, "line_too_long", f"{int(line[len(LONG_LINE):])} bytes, over corpus.max_line_bytes")
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
    return _row_item(index, obj, text_field, source_field, "field")


def _unencodable(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate from a JSON escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"character {e.start}: {e.reason} ({text[e.start]!r})"
    return None


ENTRY_CHUNK = 64 << 10
"""Bytes read at a time after seeking to an entry point (a whole-file scan reads 1 MiB at a time)."""


def iter_jsonl(path: str, start: int, end: int, text_field: str, source_field: str, entry: Entry | None = None,
               stats: ReadStats | None = None, max_line: int = MAX_LINE_BYTES) -> Iterator[Item]:
    """Records ``start <= index < end`` of a jsonl or jsonl.zst file (blank lines count as empty_text),
    read from ``entry`` (its record must be <= start), or from the start of the file without one."""
    if entry is not None and entry.record > start:
        raise CorpusError(f"{path}: entry point at record {entry.record} lies after the range's start {start}")
    stats = ReadStats() if stats is None else stats
    if entry is None:
        lines, first = _lines(path, 0, stats, max_line=max_line), 0
    else:
        lines, first = _lines(entry.file, entry.offset, stats, ENTRY_CHUNK, max_line), entry.record
    if start >= end:
        return
    try:
        for index, line in enumerate(lines, first):
            if index < start:
                stats.records_skipped += 1
                continue
            yield _parse_json_line(index, line.rstrip(b"\r\n"), text_field, source_field)
            if index >= end - 1:  # stop before the next line: no decoding past the range
                return
    except CorpusError as e:
        if entry is None or entry.file == path:
            raise
        raise CorpusError(f"{path}: its seekable copy is damaged ({e}); delete {entry.file} and its .json "
                          f"index, and plan again to rebuild it") from None


def _row_item(index: int, row: dict, text_field: str, source_field: str, what: str = "column") -> Item:
    """The record of a JSON object or a Parquet/HF row (``what`` names its fields in rejects), or why not."""
    text = _get(row, text_field)
    if not isinstance(text, str):
        return Reject(index, "missing_text", f"{what} {text_field!r} missing or not a string")
    if not text.strip():
        return Reject(index, "empty_text", "")
    source = _get(row, source_field)
    source = str(source) if source is not None else "unknown"
    for name, value in ((text_field, text), (source_field, source)):
        bad = _unencodable(value)
        if bad:
            return Reject(index, "invalid_text", f"{what} {name!r}: {bad}")
    return Record(index, text, source)


def iter_parquet(path: str, start: int, end: int, text_field: str, source_field: str,
                 stats: ReadStats | None = None) -> Iterator[Item]:
    """Rows ``start <= index < end``: only the row groups that hold them are read (found from the
    footer's row counts), only the text and source columns, and only the range becomes Python."""
    import pyarrow.parquet as pq

    stats = ReadStats() if stats is None else stats
    try:
        if is_url(path):  # a pyarrow file over ranged GETs: the footer, then the chosen row groups' columns
            with open_file(path) as f:
                yield from _parquet_rows(pq.ParquetFile(f), start, end, text_field, source_field, stats)
        else:
            yield from _parquet_rows(pq.ParquetFile(path), start, end, text_field, source_field, stats)
    except CorpusError:
        raise
    except Exception as e:
        raise CorpusError(f"{path}: cannot read Parquet corpus file ({type(e).__name__}: {e})") from None


def _parquet_rows(pf, start: int, end: int, text_field: str, source_field: str, stats: ReadStats) -> Iterator[Item]:
    top = text_field.split(".")[0]
    src_top = source_field.split(".")[0]
    cols = [c for c in dict.fromkeys([top, src_top]) if c in pf.schema_arrow.names]
    first = 0  # row index of the current row group's first row
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if first + n > start and first < end:
            table = pf.read_row_group(g, columns=cols)  # n rows
            stats.rows_decoded += n
            lo, hi = max(start, first) - first, min(end, first + n) - first
            for k, row in enumerate(table.slice(lo, hi - lo).to_pylist()):
                yield _row_item(first + lo + k, row, text_field, source_field)
        first += n
        if first >= end:
            return


def iter_hf(name: str, split: str, start: int, end: int, text_field: str, source_field: str) -> Iterator[Item]:
    ds = load_hf(name, split)
    for index in range(start, min(end, len(ds))):
        yield _row_item(index, ds[index], text_field, source_field)


HF_STREAM = "hf_stream"
"""Shard format of a streamed Hugging Face dataset: the shard is one of the dataset's own shards
(its files), ``start`` its number and ``end = start + 1``; records are numbered within it."""


def iter_hf_stream(name: str, split: str, part: int, text_field: str, source_field: str,
                   stats: ReadStats | None = None) -> Iterator[Item]:
    """Every row of dataset shard ``part`` of a streamed dataset (nothing else is downloaded or read)."""
    stats = ReadStats() if stats is None else stats
    ds = load_hf_stream(name, split)
    if not 0 <= part < ds.n_shards:
        raise CorpusError(f"hf dataset {name!r} (split {split!r}): planned dataset shard {part} but it has "
                          f"{ds.n_shards}; the dataset changed after planning")
    try:
        for index, row in enumerate(ds.shard(num_shards=ds.n_shards, index=part, contiguous=True)):
            stats.rows_decoded += 1
            yield _row_item(index, row, text_field, source_field)
    except CorpusError:
        raise
    except Exception as e:
        raise CorpusError(f"hf dataset {name!r} (split {split!r}) shard {part}: cannot read ({type(e).__name__}: {e})") from None


def _datasets():
    try:
        import datasets
    except ImportError:
        raise CorpusError("corpus.format 'hf' needs the datasets library: pip install 'actlake[hf]'") from None
    return datasets


def load_hf(name: str, split: str):
    datasets = _datasets()

    try:
        if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
            ds = datasets.load_from_disk(name)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise CorpusError(f"hf dataset {name!r} (split {split!r}): cannot load ({type(e).__name__}: {e})") from None


def load_hf_stream(name: str, split: str):
    """``name`` (hub id, or a local folder of data files) as an IterableDataset: nothing is downloaded
    up front and no row is counted."""
    datasets = _datasets()
    try:
        return datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:
        raise CorpusError(f"hf dataset {name!r} (split {split!r}): cannot open for streaming ({type(e).__name__}: {e})") from None


def column_labels(path: str, fmt: str, source_field: str, start: int, end: int, hf_split: str = "train") -> set[str] | None:
    """The source labels of records ``start <= index < end`` of a Parquet file or a Hugging Face dataset, as the
    readers label them (``str`` of the value, ``unknown`` where missing), from the source column alone (a Parquet
    file's row groups that hold the range): cheap before Ray starts (``analyses.max_sources``). Rows the reader
    will reject (no text) count too: the text column is not read. None for a jsonl file (its labels are known
    once parsed) and for a column whose values cannot be listed this way."""
    top, *rest = source_field.split(".")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with open_file(path) as f:
                pf = pq.ParquetFile(f)
                if top not in pf.schema_arrow.names:
                    return _labels(None, rest, end - start)
                labels, first = set(), 0
                for g in range(pf.metadata.num_row_groups):
                    n = pf.metadata.row_group(g).num_rows
                    if first + n > start and first < end:
                        lo, hi = max(start, first) - first, min(end, first + n) - first
                        labels |= _labels(pf.read_row_group(g, columns=[top]).column(top).slice(lo, hi - lo), rest)
                    first += n
                return labels
        if fmt == "hf":
            ds = load_hf(path, hf_split)
            if top not in ds.column_names:
                return _labels(None, rest, min(end, len(ds)) - start)
            return _labels(ds.select_columns([top]).with_format("arrow")[start:min(end, len(ds))].column(top), rest)
    except CorpusError:
        raise
    except Exception:  # noqa: BLE001 - a type unique() cannot list (lists, maps): the workers check the labels
        return None
    return None


def _labels(column, fields: list[str], rows: int | None = None) -> set[str]:
    """The distinct labels of an Arrow column, or of its struct field ``fields`` (``meta`` -> ``pile_set_name``);
    ``column`` None: the file has no such column, and its ``rows`` rows are ``unknown``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column is None:
        return {"unknown"} if rows > 0 else set()
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    for part in fields:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(part) < 0:
            return _labels(None, [], len(column))
        column = pc.struct_field(column, part)
    return {"unknown" if v is None else str(v) for v in pc.unique(column).to_pylist()}


def count_records(path: str, fmt: str) -> int:
    """Number of records in a file (one pass; Parquet reads only the footer)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            if not is_url(path):
                return pq.ParquetFile(path).metadata.num_rows
            with open_file(path) as f:
                return pq.ParquetFile(f).metadata.num_rows
        except Exception as e:
            raise CorpusError(f"{path}: cannot read Parquet corpus file ({type(e).__name__}: {e})") from None
    return sum(1 for _ in _lines(path))


def iter_items(path: str, fmt: str, start: int, end: int, text_field: str, source_field: str, hf_split: str = "train",
               entry: Entry | None = None, stats: ReadStats | None = None,
               max_line: int = MAX_LINE_BYTES) -> Iterator[Item]:
    """Records ``start <= index < end`` of one input, as many as it has (see :func:`iter_range`);
    jsonl inputs start at ``entry`` when given (see :func:`iter_jsonl`). For ``hf_stream``, every row
    of dataset shard ``start``."""
    if fmt == "jsonl":
        return iter_jsonl(path, start, end, text_field, source_field, entry, stats, max_line)
    if fmt == "parquet":
        return iter_parquet(path, start, end, text_field, source_field, stats)
    if fmt == "hf":
        return iter_hf(path, hf_split, start, end, text_field, source_field)
    if fmt == HF_STREAM:
        return iter_hf_stream(path, hf_split, start, text_field, source_field, stats)
    raise CorpusError(f"{path}: unknown corpus format {fmt!r}")


def iter_range(path: str, fmt: str, start: int, end: int, text_field: str, source_field: str, hf_split: str = "train",
               entry: Entry | None = None, stats: ReadStats | None = None,
               max_line: int = MAX_LINE_BYTES) -> Iterator[Item]:
    """Every record ``start <= index < end`` of one input (a shard's range): an input that ends before
    ``end`` (it shrank after planning) raises CorpusError naming it, the range and what was read.
    A streamed dataset shard (``hf_stream``) has no planned length: all its rows are its range."""
    n = 0
    for item in iter_items(path, fmt, start, end, text_field, source_field, hf_split, entry, stats, max_line):
        n += 1
        yield item
    if fmt != HF_STREAM and n != end - start:
        got = f"records {start}-{start + n - 1}" if n else "no record"
        raise CorpusError(f"{path}: planned records {start}-{end - 1} but read {got} ({n} of {end - start}); "
                          f"the input shrank after planning")
