"""A read-only fsspec file system over an exact list of files, for DuckDB's ``register_filesystem``.

DuckDB's ``allowed_paths`` lets a connection write to a path as well as read it. The SQL views
therefore name their files as ``actlake-ro:///abs/path`` URLs served by this file system, which
opens only the listed files and only for reading; every write (``open`` in any other mode,
``rm``, ``mv``, ``cp``) fails. Local paths stay closed by ``enable_external_access = false``.
"""

from __future__ import annotations

import datetime
import os

from fsspec.spec import AbstractFileSystem

PROTOCOL = "actlake-ro"
PREFIX = f"{PROTOCOL}://"


def url(path) -> str:
    """The URL under which DuckDB reads ``path`` (an absolute local path)."""
    return PREFIX + str(path)


class ReadOnlyFiles(AbstractFileSystem):
    """Serves exactly ``files`` (absolute paths), read-only."""

    protocol = PROTOCOL

    def __init__(self, files, **kwargs):
        super().__init__(skip_instance_cache=True, **kwargs)
        self.files = frozenset(str(f) for f in files)

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
        return open(self._listed(path), "rb")

    def info(self, path, **kwargs):
        p = self._listed(path)
        st = os.stat(p)
        return {"name": p, "size": st.st_size, "type": "file", "mtime": st.st_mtime}

    def ls(self, path, detail=True, **kwargs):
        entry = self.info(path)
        return [entry] if detail else [entry["name"]]

    def modified(self, path):
        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], tz=datetime.timezone.utc)

    def _refuse(self, *args, **kwargs):
        raise PermissionError("read-only file system")

    rm = rm_file = _rm = rmdir = mv = cp_file = copy = put_file = pipe_file = touch = mkdir = makedirs = _refuse
