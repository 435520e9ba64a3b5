"""Workers kept from one job for the next inside :func:`keeping_workers` (a sweep's checkpoints): a worker's
process, with torch and transformers imported, serves the next job, which loads its own model into it.

Starting a worker costs about 4.5 s on a 2-core machine (a process, its imports, the model), which is most of a
checkpoint's time for a small model. A kept worker learns its next job from the job's first call
(:class:`~actlake.jobs.extract.worker.Target`), so a worker Ray restarts with its first job's arguments also serves the
job it is called for. Kept only after a job in which no worker died (a restart uses up one of its
``resources.max_retries``), and never with custom analyses (their code is installed once per process) or an
offloaded model (its folder is removed with the job)."""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("actlake.run")

_kept: dict | None = None
"""Inside :func:`keeping_workers`: idle workers (with their process ids) by :func:`kept_key`; None outside."""


@contextlib.contextmanager
def keeping_workers():
    """Jobs run in this block hand their workers to the next job with the same worker shape; the workers
    left are killed when the outermost block ends (before :func:`~actlake.jobs.common.ray_env.holding_ray` ends)."""
    global _kept
    outer = _kept
    if outer is None:
        _kept = {}
    try:
        yield
    finally:
        if outer is None:
            left, _kept = _kept, None
            _kill([w for ws in left.values() for w, _ in ws])


def kept_key(cfg, options: dict, threads: int, env: dict) -> tuple | None:
    """What two jobs' workers must share for one to serve the other; None: never kept."""
    if any(path for _, _, path in cfg.code_refs) or cfg.model.offload_folder:
        return None
    return tuple(sorted(options.items())), threads, tuple(sorted(env.items()))


def take_kept(key: tuple | None, n: int) -> list:
    """Up to ``n`` kept workers for ``key``, each still the process it was when kept (one that died or was
    restarted meanwhile is killed: a restart has used up one of its retries); kept workers of other shapes are
    killed (their CPUs and GPUs are the new job's)."""
    import ray

    if _kept is None or not _kept:
        return []
    mine = _kept.pop(key, []) if key is not None else []
    _kill([w for ws in _kept.values() for w, _ in ws] + [w for w, _ in mine[n:]])
    _kept.clear()
    live = []
    for w, pid in mine[:n]:
        try:
            same = ray.get(w.get_pid.remote(), timeout=60) == pid
        except Exception:  # noqa: BLE001 - dead or unreachable: a fresh worker replaces it
            same = False
        if same:
            live.append(w)
        else:
            _kill([w])
    if live:
        log.info("reusing %d worker(s) of the previous job", len(live))
    return live


def keep(key: tuple | None, workers: list) -> list:
    """Keep ``workers`` for the next job inside :func:`keeping_workers`; the workers kept."""
    import ray

    if _kept is None or key is None:
        return []
    pids = ray.get([w.get_pid.remote() for w in workers])
    _kept.setdefault(key, []).extend(zip(workers, pids))
    return list(workers)


def _kill(workers: list) -> None:
    import ray

    if not ray.is_initialized():  # gone with its Ray
        return
    for w in workers:
        ray.kill(w)
