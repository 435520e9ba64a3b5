"""Entry points into corpus files, built once per file by the pass that counts its records.

A shard starting at record r must not decode its file from the start. Planning reads each jsonl
input once (it has to, to count the records) and on the way records where every ``every``-th
record starts (``every`` = ``sharding.docs_per_shard``, so every shard starts on one):

- plain ``.jsonl``: the byte offset of those records in the file itself;
- ``.jsonl.zst``: a single-frame file (what most tools write, and what The Pile ships) cannot be
  entered anywhere but at its start, and zstd cannot resume a frame from a saved state, so the pass
  re-encodes the file into a seekable copy, one frame per ``every`` records (zstd level 1 with
  frame checksums), and records where each frame starts. The copy decompresses to the original
  bytes, lives in ``OUTPUT_DIR/_corpus_index/`` under a name derived from the input's fingerprint,
  and costs about the input's compressed size in disk;
- Parquet needs no index: the footer's row-group row counts are one.

Files are indexed in parallel (a process pool, ``sharding.plan_workers``); the result is cached in
``OUTPUT_DIR/_record_counts.json`` by the file's fingerprint (see ``jobs/extract/plan.py``), so a rerun or
resume plans from the cache without reading any input.

Inputs and ``OUTPUT_DIR`` may be object stores (``s3://…``): inputs are read through
:mod:`actlake.fs`, a seekable copy is written as one object (an upload that an error deletes), and the
entry-point file as one PUT after the copy is complete, so an index never points at a partial copy.
The pool starts its processes with ``spawn``: pyarrow's S3 client is not fork-safe, and the driver
may hold Ray's threads; each worker builds its own file system from the environment.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator

from actlake.corpus.readers import count_records, decoded_chunks, is_url, long_line
from actlake.errors import CorpusError, StorageError
from actlake.fs import ObjectPath, location, stat, write_atomic

INDEX_DIR = "_corpus_index"
"""In ``output.dir``: one ``KEY.json`` of entry points per indexed input, and ``KEY.jsonl.zst``, the
seekable copy of a ``.jsonl.zst`` input."""
ZSTD_LEVEL = 1
"""Compression level of the seekable copies: level 1 wrote 1.5-2x faster than level 3 on the benchmark's corpus for 4 % more bytes (ratio 2.88 against 3.01; the single-frame input: 3.22)."""
PARALLEL_MIN_BYTES = 32 << 20
"""Below this many bytes to index in all, planning indexes in the driver: starting worker
processes would cost more than it saves."""


def _pieces(chunks: Iterator[bytes], every: int, counted: list[int],
            max_line: int) -> Iterator[tuple[list[bytes], int]]:
    """Cut a byte stream of lines into pieces of ``every`` records (the last may hold fewer): yields each
    piece as (its byte parts as the seekable copy holds them, the number of input bytes they stand for),
    in order, and appends the number of records to ``counted``. A line longer than ``max_line`` bytes is
    held as :func:`~actlake.corpus.readers.long_line` of its length, never whole in memory. A last line
    without a newline is a record, as the readers count it."""

    parts: list[bytes] = []
    nbytes = n_nl = 0
    line: list[bytes] | None = []  # the current line's segments so far; None once it is over the cap
    line_len = 0
    for data in chunks:
        pos = 0
        while True:
            q = data.find(b"\n", pos)
            seg = data[pos:] if q < 0 else data[pos:q + 1]
            line_len += len(seg)
            if line is not None:
                if line_len - (q >= 0) > max_line:
                    line = None
                elif seg:
                    line.append(seg)
            if q < 0:
                break
            parts += line if line is not None else [long_line(line_len - 1)]
            nbytes, n_nl, line, line_len, pos = nbytes + line_len, n_nl + 1, [], 0, q + 1
            if n_nl % every == 0:
                yield parts, nbytes
                parts, nbytes = [], 0
    if line_len:
        parts += line if line is not None else [long_line(line_len)]
        nbytes += line_len
    if nbytes:
        yield parts, nbytes
    counted.append(n_nl + (1 if line_len else 0))


def index_key(path: str, content_hash: str, every: int, max_line: int) -> str:
    """File name stem of an input's index (and seekable copy): its path, content hash, ``every`` and the line cap."""
    return hashlib.sha256(f"{path}|{content_hash}|{every}|{max_line}".encode()).hexdigest()[:24]


def build_index(path: str, fmt: str, every: int, content_hash: str, max_line: int, out_dir: str) -> dict:
    """Count the records of ``path`` and, for jsonl inputs, write its entry points (and the seekable
    copy of a ``.zst``) under ``out_dir`` (a local folder or an object-store URL). Returns
    ``{"records": n}`` plus, for jsonl, ``"index"`` (the entry-point file) and ``"every"``."""

    if fmt == "parquet":
        return {"records": count_records(path, fmt)}
    out = location(out_dir)
    key = index_key(path, content_hash, every, max_line)
    zst = path.endswith(".zst")
    data_file = str(out / f"{key}.jsonl.zst") if zst else path
    counted: list[int] = []
    points: list[int] = []  # points[i]: byte offset in data_file where record i * every starts
    out.mkdir(parents=True, exist_ok=True)
    try:
        pieces = _pieces(decoded_chunks(path), every, counted, max_line)
        if zst:
            _write_frames((parts for parts, _ in pieces), out / f"{key}.jsonl.zst", points)
        else:
            offset = 0
            for _, nbytes in pieces:
                points.append(offset)
                offset += nbytes
    except CorpusError:
        raise
    except Exception as e:  # zstd errors, OS errors
        raise CorpusError(f"{path}: cannot read corpus file ({type(e).__name__}: {e}); the file may be truncated or corrupt") from None
    index = {"source": path, "records": counted[0], "every": every, "file": data_file, "points": points}
    index_file = out / f"{key}.json"
    try:
        write_atomic(index_file, json.dumps(index).encode())
    except (OSError, StorageError) as e:
        raise CorpusError(f"{index_file}: cannot write the corpus index ({type(e).__name__}: {e})") from None
    return {"records": counted[0], "every": every, "index": str(index_file)}


def _write_frames(pieces: Iterator[list[bytes]], dest, points: list[int]) -> None:
    """Write each piece as one zstd frame of ``dest`` (atomically), appending each frame's offset to
    ``points``. On a disk: a temporary file renamed into place. In an object store: one streamed
    upload (the object appears when it completes); if writing fails, the object is deleted."""
    import zstandard


    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    if isinstance(dest, ObjectPath):
        f = dest.open("wb")
        try:
            offset = 0  # counted here: an upload stream's tell() is not needed
            for parts in pieces:
                points.append(offset)
                frame = cctx.compress(b"".join(parts))
                f.write(frame)
                offset += len(frame)
        except BaseException:
            try:  # closing completes the upload: delete the partial object it made
                f.close()
            finally:
                dest.unlink(missing_ok=True)
            raise
        f.close()
        return
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for parts in pieces:
                points.append(f.tell())
                f.write(cctx.compress(b"".join(parts)))
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def load_points(index_file: str) -> dict:
    """An index written by :func:`build_index` (``records``, ``every``, ``file``, ``points``)."""

    try:
        return json.loads(location(index_file).read_text())
    except (OSError, ValueError, StorageError) as e:
        raise CorpusError(f"{index_file}: cannot read corpus index ({type(e).__name__}: {e}); delete it to rebuild") from None


def index_files(jobs: list[tuple[str, str, int, str, int]], out_dir: str, workers: int) -> list[dict]:
    """:func:`build_index` for each ``(path, fmt, every, content_hash, max_line)``, in a pool of ``workers``
    processes (0: one per CPU core) when there is more than one file and enough bytes to be worth it."""
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    size = sum(_size(p) for p, fmt, *_ in jobs if fmt != "parquet")
    if workers <= 1 or size < PARALLEL_MIN_BYTES:
        return [build_index(*job, out_dir) for job in jobs]
    # spawn, not fork: the driver may hold Ray's threads, and pyarrow's S3 client (built once per
    # process, actlake.fs.filesystem) is not fork-safe; a spawned worker builds its own from the environment
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(build_index, *job, out_dir) for job in jobs]
        return [f.result() for f in futures]


def _size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)

    return stat(path)[0]
