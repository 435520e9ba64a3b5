"""A read-only fsspec file system over an exact list of files, for DuckDB's ``register_filesystem``.

DuckDB's ``allowed_paths`` lets a connection write to a path as well as read it. The SQL views
therefore name their files as ``actlake-ro:///abs/path`` URLs (``actlake-ro:///~s3/bucket/key`` for
an object in a store) served by this file system, which opens only the listed files and only for
reading; every write (``open`` in any other mode, ``rm``, ``mv``, ``cp``) fails. Local paths stay
closed by ``enable_external_access = false``, and DuckDB's own S3 access (httpfs) is never loaded.
"""

from __future__ import annotations

import datetime
import io
import os
import threading

from fsspec.spec import AbstractFileSystem

from actlake.fs import ObjectPath

PROTOCOL = "actlake-ro"
PREFIX = f"{PROTOCOL}://"


def _key(path) -> str:
    return f"/~{path.scheme}/{path.key}" if isinstance(path, ObjectPath) else str(path)


def url(path) -> str:
    """The URL under which DuckDB reads ``path`` (an absolute local Path or an ObjectPath)."""
    return PREFIX + _key(path)


class ReadOnlyFiles(AbstractFileSystem):
    """Serves exactly ``files`` (absolute Paths or ObjectPaths), read-only.

    In an object store a committed object is never written again (every write takes a new name), so its size
    and time are read once per file system (one connection) and it is opened at the first read: DuckDB asks
    for them several times per open, and opens files whose footers it has cached, each a request there. On a
    disk a reduce replaces its tables' files under the same names: each open takes the file's size from the
    opened file itself."""

    protocol = PROTOCOL

    def __init__(self, files, **kwargs):
        super().__init__(skip_instance_cache=True, **kwargs)
        self.files = {_key(f): f for f in files}
        self._infos: dict[str, dict] = {}
        self._infos_lock = threading.Lock()  # DuckDB calls from several threads

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        return path[len(PREFIX):] if path.startswith(PREFIX) else path

    def _listed(self, path) -> str:
        p = self._strip_protocol(path)
        if p not in self.files:
            raise PermissionError(f"{p}: not a committed file of this run")
        return p

    def _open(self, path, mode="rb", **kwargs):
        if mode != "rb":
            raise PermissionError(f"{self._strip_protocol(path)}: read-only (mode {mode!r} refused)")
        p = self._listed(path)
        f = self.files[p]
        if isinstance(f, ObjectPath):
            return PositionalReader(lambda: f.open("rb"), self.info(p)["size"])
        handle = f.open("rb")
        return PositionalReader(handle, os.fstat(handle.fileno()).st_size)

    def info(self, path, **kwargs):
        p = self._listed(path)
        f = self.files[p]
        if not isinstance(f, ObjectPath):
            return self._entry(p, f.stat())
        with self._infos_lock:
            known = self._infos.get(p)
        if known is None:
            known = self._entry(p, f.stat())
            with self._infos_lock:
                self._infos[p] = known
        return dict(known)

    @staticmethod
    def _entry(p: str, st) -> dict:
        return {"name": p, "size": st.st_size, "type": "file", "mtime": st.st_mtime_ns / 1e9}

    def ls(self, path, detail=True, **kwargs):
        entry = self.info(path)
        return [entry] if detail else [entry["name"]]

    def modified(self, path):
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    def _refuse(self, *args, **kwargs):
        raise PermissionError("read-only file system")

    rm = rm_file = _rm = rmdir = mv = cp_file = copy = put_file = pipe_file = touch = mkdir = makedirs = _refuse


class PositionalReader(io.RawIOBase):
    """A read-only file whose position is each thread's own, every read a positional one (``pread``; a pyarrow
    file's ``read_at``). DuckDB reads a Parquet file's row groups from several threads through one handle, as a
    seek and then a read: on one shared position another thread's seek could land between the two, and the
    read return another part of the file (seen on an object store: "don't know what type").

    ``f``: an open file, or a function that opens it, called at the first read (DuckDB opens a file whose
    footer it has cached, ``parquet_metadata_cache``, and reads nothing from it: an object store's open is a
    request)."""

    def __init__(self, f, size: int):
        super().__init__()
        self._size, self._local = size, threading.local()
        self._open_file, self._f, self._fd = (f, None, None) if callable(f) else (None, f, self._fd_of(f))
        self._opening = threading.Lock()

    @staticmethod
    def _fd_of(f) -> int | None:
        return None if hasattr(f, "read_at") else f.fileno()  # pyarrow's positional read, else pread

    def _file(self):
        if self._f is None:
            with self._opening:
                if self.closed:
                    raise ValueError("I/O operation on closed file")
                if self._f is None:
                    f = self._open_file()
                    self._fd = self._fd_of(f)
                    self._f = f
        return self._f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return getattr(self._local, "pos", 0)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self._size}[whence]
        self._local.pos = max(0, base + offset)
        return self._local.pos

    def read(self, size: int = -1) -> bytes:
        pos = self.tell()
        n = max(0, self._size - pos) if size is None or size < 0 else min(size, max(0, self._size - pos))
        f = self._file()
        data = os.pread(self._fd, n, pos) if self._fd is not None else bytes(f.read_at(n, pos))
        self._local.pos = pos + len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with self._opening:
            if not self.closed and self._f is not None:
                self._f.close()
            super().close()
