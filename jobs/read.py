"""A shard's reading stage: records -> tokenised windows, documents and rejects."""

from __future__ import annotations

import threading

from actlake.batching import Window, document_windows
from actlake.corpus.fingerprint import check_stat
from actlake.corpus.readers import Reject, iter_range
from actlake.jobs.plan import Shard


def read_shard(shard: Shard, cfg, tokenizer, tokenizing: threading.Lock):
    """Windows, documents and rejects of the shard's records. A record the tokenizer fails on is a
    ``tokenizer_error`` reject; a file whose size or mtime moved since planning, or while it was read,
    fails the shard (CorpusError naming it). ``tokenizing`` is held around each tokenizer call (two shards
    may be read at once with read-ahead; one tokenizer call at a time)."""
    c = cfg.corpus
    windows: list[Window] = []
    docs, rejects = [], []
    if shard.size is not None:
        check_stat(shard.path, shard.size, shard.mtime_ns, "since the run planned it", shard.ctime_ns)
    items = iter_range(shard.path, shard.fmt, shard.start, shard.end, c.text_field, c.source_field, c.hf_split,
                       entry=shard.entry(), max_line=c.max_line_bytes)  # jsonl: from the entry point the plan found, not the file's start
    for item in items:
        if isinstance(item, Reject):
            rejects.append({"file": shard.path, "record": item.index, "reason": item.reason, "detail": item.detail})
            continue
        doc_id = shard.doc_offset + item.index
        try:
            with tokenizing:
                ws, cut = document_windows(tokenizer, item.text, cfg.tokenization)
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer raises on one record skips that record
            rejects.append({"file": shard.path, "record": item.index, "reason": "tokenizer_error",
                            "detail": f"{type(e).__name__}: {e}"[:200].encode("utf-8", "backslashreplace").decode()})
            continue
        if not ws:
            rejects.append({"file": shard.path, "record": item.index, "reason": "too_few_tokens", "detail": ""})
            continue
        windows += [Window(doc_id, w, ids, item.source) for w, ids in enumerate(ws)]
        docs.append({"doc_id": doc_id, "file": shard.path, "record": item.index, "source": item.source,
                     "n_chars": len(item.text), "n_windows": len(ws), "n_tokens": sum(len(x) for x in ws), "cut": cut})
    if shard.size is not None:
        check_stat(shard.path, shard.size, shard.mtime_ns, "while the shard read it", shard.ctime_ns)
    return windows, docs, rejects
