"""One job at a time per run directory: an advisory lock the job's driver holds while it works.

Two drivers on one run directory would both run every pending shard (or train the same trial) and
race on its records. The lock is ``flock`` on ``RUN_DIR/.lock`` (released by the kernel when the
driver exits, killed or not), which also holds on NFS v4 mounts; the file names its holder (host,
pid, command, start time) for the refusal's message. An object store offers no lock: there a
second driver is not refused (commit records still keep every row exactly once).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from actlake.errors import StorageError
from actlake.fs import ObjectPath, kind_of, not_regular

LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_lock(root):
    """Hold the run directory ``root`` (created if needed) for the ``with`` block; a StorageError naming
    the holder when another job holds it."""
    import fcntl  # POSIX only: imported when used

    if isinstance(root, ObjectPath):
        yield
        return
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise StorageError(f"run directory {root} exists and is not a folder; pick a new output.run_id or remove it")
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    try:  # never through a link: its target (any file the user can write) would be truncated and overwritten
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if path.is_symlink():
            raise StorageError(f"{path} is a symbolic link; a run's lock file is never followed: remove the link") from None
        raise StorageError(f"{path}: cannot open the run's lock file ({e.strerror or e})") from None
    kind = kind_of(os.fstat(fd).st_mode)
    if kind:  # a FIFO or a device named .lock
        os.close(fd)
        raise StorageError(f"{not_regular(path, kind)}; remove it")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StorageError(f"{root} is in use by another job ({_holder(path)}); wait for it to end, or pick "
                               "another output.run_id (--run-id)") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                 "command": " ".join(sys.argv)[:300]}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h['pid']} on {h['host']} since {h['started']}: {h['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def holds_run_dir(job):
    """Decorator of a job function ``job(cfg, ...)``: it runs holding ``cfg.run_dir`` (:func:`run_lock`)."""
    @functools.wraps(job)
    def locked(cfg, *args, **kwargs):
        with run_lock(cfg.run_dir):
            return job(cfg, *args, **kwargs)

    return locked
