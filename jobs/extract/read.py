"""A shard's reading stage: records -> tokenised windows, documents and rejects."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from actlake.batching import Window, document_windows, documents_windows, special_affixes
from actlake.config import JobConfig
from actlake.corpus.fingerprint import check_stat
from actlake.corpus.readers import Reject, iter_range
from actlake.errors import ActlakeError, CorpusError
from actlake.jobs.extract.plan import Shard

log = logging.getLogger("actlake.read")

TOKENIZE_EVERY = 64
"""Documents tokenised per tokenizer call (:func:`~actlake.batching.documents_windows`)."""


def read_shard(shard: Shard, cfg, tokenizer, tokenizing: threading.Lock):
    """Windows, documents and rejects of the shard's records. A record the tokenizer fails on is a
    ``tokenizer_error`` reject; a file whose size or mtime moved since planning, or while it was read,
    fails the shard (CorpusError naming it). Records are tokenised TOKENIZE_EVERY at a time, in one call
    (the interpreter lock released while a fast tokenizer encodes them); ``tokenizing`` is held around each
    call (two shards may be read at once with read-ahead; one tokenizer call at a time)."""
    c = cfg.corpus
    out = _Reading(shard, cfg, tokenizer, tokenizing)
    if shard.size is not None:
        check_stat(shard.path, shard.size, shard.mtime_ns, "since the run planned it", shard.ctime_ns)
    items = iter_range(shard.path, shard.fmt, shard.start, shard.end, c.text_field, c.source_field, c.hf_split,
                       entry=shard.entry(), max_line=c.max_line_bytes)  # jsonl: from the entry point the plan found, not the file's start
    pending = []  # records in file order, rejects among them, tokenised together
    for item in items:
        pending.append(item)
        if len(pending) >= TOKENIZE_EVERY:
            out.add(pending)
            pending = []
    out.add(pending)
    if shard.size is not None:
        check_stat(shard.path, shard.size, shard.mtime_ns, "while the shard read it", shard.ctime_ns)
    return out.windows, out.docs, out.rejects


class _Reading:
    """A shard's windows, documents and rejects, added a run of records at a time, in file order."""

    def __init__(self, shard: Shard, cfg, tokenizer, tokenizing: threading.Lock):
        self.shard, self.cfg, self.tokenizer, self.tokenizing = shard, cfg, tokenizer, tokenizing
        # a setting the tokenizer cannot meet (prepend_bos without a BOS) is the job's error, not a reject per record
        special_affixes(tokenizer, cfg.tokenization.prepend_bos)
        self.windows: list[Window] = []
        self.docs, self.rejects = [], []

    def add(self, items: list) -> None:
        texts = [item.text for item in items if not isinstance(item, Reject)]
        tokenized = self._together(texts) if texts else iter(())
        for item in items:
            if isinstance(item, Reject):
                self._reject(item.index, item.reason, item.detail)
                continue
            try:
                ws, cut = next(tokenized) if tokenized is not None else self._alone(item.text)
            except Exception as e:  # noqa: BLE001 - whatever the tokenizer raises on one record skips that record
                self._reject(item.index, "tokenizer_error",
                             f"{type(e).__name__}: {e}"[:200].encode("utf-8", "backslashreplace").decode())
                continue
            if not ws:
                self._reject(item.index, "too_few_tokens", "")
                continue
            doc_id = self.shard.doc_offset + item.index
            self.windows += [Window(doc_id, w, ids, item.source) for w, ids in enumerate(ws)]
            self.docs.append({"doc_id": doc_id, "file": self.shard.path, "record": item.index, "source": item.source,
                              "n_chars": len(item.text), "n_windows": len(ws), "n_tokens": sum(len(x) for x in ws),
                              "cut": cut})

    def _together(self, texts: list[str]):
        """The texts' windows from one tokenizer call, or None where it failed (then each record alone says which)."""
        try:
            with self.tokenizing:
                return iter(documents_windows(self.tokenizer, texts, self.cfg.tokenization))
        except Exception:  # noqa: BLE001 - one record failed the call
            return None

    def _alone(self, text: str):
        with self.tokenizing:
            return document_windows(self.tokenizer, text, self.cfg.tokenization)

    def _reject(self, record: int, reason: str, detail: str) -> None:
        self.rejects.append({"file": self.shard.path, "record": record, "reason": reason, "detail": detail})


class ReaderProcess:
    """Reads shards in a process of its own (``resources.read_in_process``), so that parsing, decompressing
    and tokenising the next shard do not take the interpreter lock from the thread that drives the model.

    One spawned process per worker, holding the worker's tokenizer (pickled to it once) and config; a call
    hands it a shard and waits for the shard's windows, documents and rejects, which are what
    :func:`read_shard` in the worker would return (a test compares the tables). Its errors (a CorpusError
    naming the file) come back as they were raised there. It exits with the worker: it watches its parent."""

    def __init__(self, cfg: JobConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.starting = threading.Lock()
        self.current = self._start()
        """(pool, future of its set-up), replaced as one value: a thread never pairs one pool with another's set-up."""

    @property
    def pool(self) -> ProcessPoolExecutor:
        return self.current[0]

    def _start(self):
        """A new process and the future of its set-up. The config and tokenizer (megabytes) go as its first task,
        through the call queue, whose writer is a thread of the pool's own: passed as the initializer's arguments
        they would go through the start-up pipe, which this thread writes while it holds the pipe's read end
        too, so a process killed before reading them all (the OOM killer, at start-up) blocked it for ever."""
        # spawn, never fork: the worker holds CUDA and threads a forked child would inherit broken
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_watch_parent,
                                   initargs=(os.getpid(),))
        return pool, pool.submit(_set_up_reader, self.cfg, self.tokenizer)

    def read(self, shard: Shard):
        """The shard's windows, documents and rejects. A reader process that died (killed for memory, also
        while it starts) is replaced once per call, with a warning, and the shard read again; dying again raises
        BrokenProcessPool, on which the worker exits as one killed while reading (its shards requeued)."""
        current = self.current
        try:
            current[1].result()
            return current[0].submit(_read_in_reader, shard).result()
        except BrokenProcessPool:
            with self.starting:  # two threads may find it broken: one new process
                if self.current is current:
                    log.warning("the reader process died; starting another and reading shard %d again", shard.shard_id)
                    self.current = self._start()
            pool, ready = self.current
            ready.result()
            return pool.submit(_read_in_reader, shard).result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_reader: dict = {}
"""In the reader process: its config and tokenizer (set once by :func:`_set_up_reader`)."""


def _watch_parent(parent: int) -> None:
    threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="actlake-reader-parent").start()


def _set_up_reader(cfg: JobConfig, tokenizer) -> None:
    """The worker's parsed config (pickled, not validated again) and tokenizer, for every read."""
    _reader.update(cfg=cfg, tokenizer=tokenizer, lock=threading.Lock())


def _exit_with(parent: int) -> None:
    """Exit when the worker that started this process is gone (killed workers do not shut their pools down)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _read_in_reader(shard: Shard):
    try:
        return read_shard(shard, _reader["cfg"], _reader["tokenizer"], _reader["lock"])
    except ActlakeError:  # picklable, as every error of the package
        raise
    except Exception as e:  # one the worker could not unpickle would come back as a dead reader
        raise CorpusError(f"{shard.path}: {type(e).__name__}: {e}") from None
