"""The Ray actor that owns one device: loads the model once, then processes shards."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import ray

from actlake.analysis.registry import failure, logits_readers
from actlake.config import parse_config
from actlake.errors import AnalysisFailed
from actlake.fs import location
from actlake.jobs.extract.plan import Shard
from actlake.storage.layout import RunLayout

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters

log = logging.getLogger("actlake.worker")


def keep_freed_heap(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Let the heap keep what a batch frees for the next batch (glibc only; False elsewhere).

    By default glibc maps large tensors (beyond a threshold it adjusts as it goes) straight from the
    OS and returns them when freed, or trims the freed top of the heap, so every batch pays the page
    faults of its working set again: about 6 % of a CPU worker's time with all-MiniLM-L6-v2
    (``benchmarks/attention_suite.py`` with and without ``--default-heap``). Blocks below ``mmap_threshold`` (32 MiB, the largest
    threshold glibc's own adjustment reaches) now come from the heap, and its free top is only
    returned beyond ``trim_threshold``; :func:`release_free_memory` still hands everything free back
    after each shard. True when glibc took both settings.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        took_mmap = bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold))
        took_trim = bool(libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
        return took_mmap and took_trim
    except (OSError, AttributeError):  # not glibc
        return False


def release_free_memory() -> None:
    """Hand freed heap back to the OS between shards (glibc keeps it otherwise, and the resident
    set creeps up with the many tensor shapes of length-bucketed batches)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def freeze_loaded_objects() -> None:
    """Leave what is alive now (modules, the model, its tokenizer: some 450,000 objects with MiniLM) out of every
    later garbage collection (``gc.freeze``), so that :func:`release_free_memory`'s collection between shards
    looks at the shard's objects only: 0.3 s a shard before, a few milliseconds after (2 cores)."""
    gc.collect()
    gc.freeze()


def install_code(files: dict, origins: list[str] = ()) -> dict[str, str]:
    """Put the custom analyses' code (``{relative path: bytes}``) on sys.path, in :func:`code_folder`. Returns
    {path written: the driver's path of that file} for ``origins`` (``analyses.custom[].path``), so errors
    name the files their authors know."""
    if not files:
        return {}
    root = code_folder(files)
    tops = {Path(o).name: Path(o).parent for o in origins if o}
    written = {str(root / rel): str(tops[Path(rel).parts[0]] / rel) for rel in files if Path(rel).parts[0] in tops}
    sys.path.insert(0, str(root))
    return written


def code_folder(files: dict) -> Path:
    """A folder in the system's temporary folder holding ``files``, named by their digest and shared by this
    user's workers on the machine: every job's workers leave one folder per version of the code, not one each
    (a worker is killed, never asked to clean up). Made whole in a new folder renamed into place; a file of
    it that a cleaner removed or anything changed is written again (atomically: the right bytes are the same
    for every reader); files written beside them at run time (bytecode, an analysis's cache) are left alone.
    A folder of that name that is not this user's alone is not used: the worker gets a private copy, and a
    warning says why."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    shared = Path(tempfile.gettempdir()).resolve() / f"actlake-custom-{os.getuid()}-{digest.hexdigest()[:24]}"
    if not shared.exists():
        new = _written(files, Path(tempfile.mkdtemp(prefix="actlake-custom-new-", dir=shared.parent)))
        try:
            new.rename(shared)
        except OSError:  # another worker's copy was renamed first
            shutil.rmtree(new, ignore_errors=True)
    if not _ours(shared):
        private = _written(files, Path(tempfile.mkdtemp(prefix="actlake-custom-")))
        log.warning("%s is not this user's alone; using a private copy of the custom code in %s", shared, private)
        return private
    stale = [rel for rel, data in files.items() if not _same(shared / rel, data)]
    if stale:
        log.warning("%s: %s differed from the job's custom code; written again", shared, ", ".join(sorted(stale)))
        _written({rel: files[rel] for rel in stale}, shared, made=False)
    return shared


def _written(files: dict, root: Path, made: bool = True) -> Path:
    """``root`` with ``files`` written into it, each whole (a temporary file renamed into place). A path out of
    ``root`` is a ValueError; ``made``: ``root`` was made for them, and is removed when writing fails."""
    try:
        for rel, data in files.items():
            target = (root / rel).resolve()
            if root not in target.parents:
                raise ValueError(f"custom code path escapes its folder: {rel}")
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)  # left only when writing failed
    except BaseException:
        if made:
            shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is a folder of this user's that no one else may write in."""
    try:
        st = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _same(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False


@dataclass(frozen=True)
class Target:
    """The job a worker serves: sent with every call, so that a worker kept for the next job (a sweep's next
    checkpoint) or restarted by Ray with the arguments it was first made with takes on the job it is called for."""

    cfg_dict: dict
    run_dir: str
    plan_hash: str
    counter: object = None
    read_in_process: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.run_dir, self.plan_hash


@ray.remote
class ShardWorker:
    """Runs the shards the dispatcher hands it and commits them a group at a time
    (:mod:`actlake.storage.shards`): when its group is due, when told a shard is its last, or on ``flush``.
    Started with ``max_concurrency=2`` (``resources.read_ahead``) it holds two shards: the model runs one
    while the other is read and tokenised, so the device does not wait for the CPU between shards."""

    def __init__(self, target: Target, torch_threads: int, code: dict | None = None, store_env: dict | None = None):
        """``target``: the job it is made for (without its progress counter, which each call's target brings).
        ``store_env``: the driver's object-store variables (:func:`actlake.jobs.common.ray_env.store_env`), set in
        this process before any store is opened. An argument, never a ``runtime_env``: Ray writes a
        runtime_env's variables in plain text to its agent's log.

        Every argument is a plain value sent inline with the actor's creation: no object reference and no
        actor handle, which Ray keeps in its object store and warns it may lose before a restart
        (ray-project/ray#53727). The job's progress counter comes with each call's ``target``. Custom code over
        Ray's inline limit (100 KiB; ``CUSTOM_CODE_LIMIT`` allows 16 MiB) still goes by reference: Ray then warns,
        and a restart after the reference is lost fails."""
        self.started_at = time.time()  # reported with the first shard: the job's time breakdown (worker start)
        os.environ.update(store_env or {})
        import torch

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        keep_freed_heap()
        cfg = parse_config(target.cfg_dict)  # once: _aim takes it, and hands it to the reader process
        self.shipped = install_code(code or {}, [str(path) for _, _, path in cfg.code_refs if path])
        self.compute = threading.Lock()  # the model runs one shard at a time, also when two are in hand
        self.aiming = threading.Lock()  # one retarget at a time (two shards may arrive at once)
        self.pid = os.getpid()
        self.extractor = None
        self.load_seconds = 0.0
        self._aim(target, cfg)

    def _aim(self, target: Target, cfg=None) -> None:
        """Take on ``target``'s job: its config, run directory, plan and progress counter, and its model, loaded
        after the previous job's is freed (a sweep's next checkpoint reuses this process, not the weights)."""
        from actlake.jobs.extract.driver import Extractor
        from actlake.jobs.extract.group import OpenGroup
        from actlake.model import load_model
        from actlake.storage.shards import CommitPolicy

        if self.extractor is not None:
            self.close()
            self.extractor = None
            gc.unfreeze()  # the previous job's objects may be collected again
            release_free_memory()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.target = None  # until the new model is loaded: a failed load is tried again by the next call
        t0 = time.perf_counter()
        self.cfg = cfg or parse_config(target.cfg_dict)  # ``cfg``: the constructor's parse of the same dict
        self.layout = RunLayout(location(target.run_dir))
        self.group = OpenGroup(self.layout, target.plan_hash, CommitPolicy(max_seconds=self.cfg.sharding.commit_seconds))
        head = self.cfg.analyses.surprisal  # null: a causal LM's
        if head is False and logits_readers(self.cfg):  # a custom analysis reads the logits
            head = None
        self.extractor = Extractor(self.cfg, load_model(self.cfg.model, lm_head=head))
        if self.extractor.interventions:  # read here: the same values the run recorded, or no shard runs
            from actlake.jobs.extract.identity import check_interventions

            check_interventions(self.layout, self.extractor.interventions)
        if target.read_in_process:
            from actlake.jobs.extract.read import (
                ReaderProcess,
            )

            self.extractor.reader = ReaderProcess(self.cfg, self.extractor.lm.tokenizer)
        self.counter = target.counter
        self.target = target.key
        freeze_loaded_objects()
        self.load_seconds = time.perf_counter() - t0  # reported with the next shard (the job's time breakdown)

    def _on(self, target: Target | None) -> None:
        """Before a call of a job's dispatcher: take on its job if this worker holds another (it served the job
        before, in a sweep, or Ray restarted it with the arguments it was first made with)."""
        if target is None:
            return
        with self.aiming:
            if target.key != self.target:
                log.info("worker %d: now on run %s", self.pid, target.run_dir)
                self._aim(target)
            self.counter = target.counter  # the same run dispatched again (a redispatch) has a new counter

    def process(self, shard_dict: dict, last: bool = False, target: Target | None = None) -> dict:
        """Run one shard of ``target``'s job; ``committed``: the shard ids this call committed (its group's, when
        due or ``last``). An exception raised by an analysis's code is an AnalysisFailed naming it, file, line and
        method, its traceback logged here (the job's log)."""
        import psutil

        self._on(target)
        shard = Shard(**shard_dict)
        on_batch = None if self.counter is None else self.counter.add
        with self._analyses_named():
            try:
                summary = self.extractor.process(shard, self.layout, self.group, self.compute, on_batch)
            except BrokenProcessPool:  # the reader died twice on this shard: die as a worker killed while reading
                log.error("the reader process died twice reading shard %d; the worker exits, its shards are "
                          "requeued", shard.shard_id)
                os._exit(1)
            t0 = time.perf_counter()
            with self.group.lock:
                committed = self.group.commit() if last or self.group.due() else []
            commit_s = time.perf_counter() - t0
        release_free_memory()
        rss_mb = psutil.Process().memory_info().rss / 2**20
        with self.aiming:  # the other slot's shard (read-ahead) must not report the load (or the start) again
            load_s, self.load_seconds = self.load_seconds, 0.0
            started_at, self.started_at = self.started_at, None
        return dict(summary, shard_id=shard.shard_id, pid=self.pid, worker_rss_mb=rss_mb, committed=committed,
                    node_id=ray.get_runtime_context().get_node_id(), commit_seconds=commit_s, load_seconds=load_s,
                    started_at=started_at)

    def flush(self, target: Target | None = None) -> list[int]:
        """Commit the open group now; the shard ids committed."""
        self._on(target)
        with self._analyses_named():
            return self.group.commit()

    @contextlib.contextmanager
    def _analyses_named(self):
        try:
            yield
        except Exception as e:
            failed = failure(e, self.extractor.producers)
            if failed is None:
                raise
            message, trace = failed.args
            for shipped, original in self.shipped.items():  # name the author's file, not the worker's copy
                message, trace = message.replace(shipped, original), trace.replace(shipped, original)
            failed = AnalysisFailed(message, trace)
            log.error("%s\n%s", failed, failed.traceback)
            raise failed from None

    def close(self) -> None:
        """Remove this worker's offload folder (``model.offload_folder``); called before the actor is killed."""
        self.extractor.lm.close()
        if self.extractor.reader is not None:
            self.extractor.reader.close()

    def get_pid(self) -> int:
        return self.pid
