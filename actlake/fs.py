"""Local folders and object stores behind one small path type.

A location is either a :class:`pathlib.Path` (a local disk or a shared mount) or an
:class:`ObjectPath` (``s3://bucket/key``, ``gs://bucket/key``, ``hf://datasets/…``) served by
``pyarrow.fs``. ``ObjectPath`` offers the part of the ``Path`` API actlake uses (``/``, ``name``,
``parent``, ``read_bytes``, ``is_file``, ``stat``, ``iterdir``, …), so storage code reads the same
for both; what differs is said by the functions below:

- :func:`write_atomic`: a temporary file renamed into place on a disk, one PUT on an object store
  (an object appears whole or not at all; there is no rename);
- :func:`arrow`: the ``pyarrow.fs`` file system and path, for Parquet reads and writes;
- :func:`glob`: ``*``, ``?`` and ``**`` over a local folder or a bucket listing.

S3 settings come from the standard AWS variables: credentials (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, profiles), ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, and ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for S3-compatible stores
(MinIO, Ceph, a local test server). An unknown scheme is an error, never a local folder.
"""

from __future__ import annotations

import functools
import glob as _glob
import os
import posixpath
import re
import shutil
import stat as st
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from actlake.errors import StorageError

SCHEMES = ("s3", "gs", "gcs", "hf")
"""Object-store schemes actlake reads and writes through ``pyarrow.fs``."""

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(value) -> str | None:
    """The scheme of ``value`` when it is a URL (``s3://…``), else None."""
    m = _SCHEME.match(str(value))
    return m.group(1).lower() if m else None


def check_scheme(value, key: str) -> None:
    """StorageError naming ``key`` when ``value`` is a URL of a scheme actlake cannot use."""
    s = url_scheme(value)
    if s is not None and s not in SCHEMES and s != "file":
        raise StorageError(f"{key}: {value!r} uses the scheme {s}://, which actlake cannot read or write "
                           f"(known: {', '.join(f'{x}://' for x in SCHEMES)}, or a local path); it is never "
                           "taken as a local folder")


def resolve_text(value, key: str = "path") -> str:
    """The one resolution of a path a user wrote (a config value, a command-line argument).

    An object-store URL (``s3://…``) comes back as it is; ``file://PATH`` and local paths come back
    absolute and normalised, ``~`` expanded, a relative path taken against the working directory. Symbolic links are kept (a glob pattern need not exist). StorageError for a
    scheme actlake cannot use, or a URL that names no bucket: it is never taken as a local folder
    (``key`` names the value in the message)."""
    text = str(value)
    check_scheme(text, key)
    s = url_scheme(text)
    if s not in (None, "file"):
        if not text[len(s) + 3:].strip("/"):
            raise StorageError(f"{key}: {text!r} names no bucket")
        return text
    local = os.path.expanduser(text[len("file://"):] if s == "file" else text)
    return os.path.normpath(os.path.join(os.getcwd(), local))


def location(value) -> "Path | ObjectPath":
    """The location ``value`` names: an ObjectPath for an object-store URL, else an absolute local Path."""
    if isinstance(value, (Path, ObjectPath)):
        return value if isinstance(value, ObjectPath) else value.resolve()
    text = resolve_text(value)
    if url_scheme(text) is None:
        return Path(text).resolve()
    s = url_scheme(text)
    return ObjectPath("gs" if s == "gcs" else s, posixpath.normpath(text[len(s) + 3:].strip("/")))


@functools.lru_cache(maxsize=None)
def filesystem(scheme: str):
    """The process's ``pyarrow.fs`` file system for ``scheme`` (built once, from the environment)."""
    import pyarrow.fs as pafs

    try:
        if scheme == "s3":
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            if endpoint:
                return pafs.S3FileSystem(endpoint_override=endpoint, region=region or "us-east-1")
            return pafs.S3FileSystem(region=region) if region else pafs.S3FileSystem()
        if scheme == "gs":
            return pafs.GcsFileSystem()
        if scheme == "hf":
            from huggingface_hub import HfFileSystem

            return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem()))
    except (OSError, ImportError, ValueError) as e:
        raise StorageError(f"{scheme}://: cannot open the object store ({type(e).__name__}: {e})") from None
    raise StorageError(f"{scheme}://: not an object-store scheme actlake knows")


@dataclass(frozen=True)
class ObjectStat:
    st_size: int
    st_mtime_ns: int


@dataclass(frozen=True, order=True)
class ObjectPath:
    """``scheme://key`` in an object store; the subset of ``pathlib.Path`` storage code needs.

    Directories are prefixes: ``mkdir`` does nothing and ``is_dir`` is true when a key lies below."""

    scheme: str
    key: str  # "bucket/a/b", no leading or trailing slash

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    @property
    def fs(self):
        return filesystem(self.scheme)

    def __truediv__(self, other) -> "ObjectPath":
        return ObjectPath(self.scheme, posixpath.normpath(posixpath.join(self.key, str(other))))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.key).suffix

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.scheme, posixpath.dirname(self.key) or self.key)

    @property
    def parents(self) -> list["ObjectPath"]:
        out, p = [], self
        while p.parent != p:
            p = p.parent
            out.append(p)
        return out

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def relative_to(self, other: "ObjectPath") -> PurePosixPath:
        if not isinstance(other, ObjectPath) or other.scheme != self.scheme:
            raise ValueError(f"{self} is not under {other}")
        return PurePosixPath(self.key).relative_to(other.key)

    def resolve(self) -> "ObjectPath":
        return self

    def _info(self):
        return self.fs.get_file_info(self.key)

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return self._info().type != pafs.FileType.NotFound or self.is_dir()

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        if self._info().type == pafs.FileType.Directory:
            return True
        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
        try:
            return bool(self.fs.get_file_info(sel))
        except OSError:
            return False

    def stat(self) -> ObjectStat:
        import pyarrow.fs as pafs

        info = self._info()
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(str(self))
        mtime = info.mtime_ns if info.mtime_ns is not None else 0
        return ObjectStat(info.size, mtime)

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.key, compression=None) as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            if "not found" in str(e).lower() or "does not exist" in str(e).lower() or "NoSuchKey" in str(e):
                raise FileNotFoundError(str(self)) from None
            raise

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        with self.fs.open_output_stream(self.key, compression=None) as f:
            f.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def open(self, mode: str = "rb"):
        if mode == "rb":
            return self.fs.open_input_file(self.key)
        if mode == "wb":
            return self.fs.open_output_stream(self.key, compression=None)
        raise ValueError(f"{self}: mode {mode!r} (object stores take 'rb' or 'wb')")

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        return None  # prefixes exist when an object lies below them

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.delete_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def iterdir(self):
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=False)
        for info in sorted(self.fs.get_file_info(sel), key=lambda i: i.path):
            yield ObjectPath(self.scheme, info.path.rstrip("/"))

    def files(self) -> list["ObjectPath"]:
        """Every object below this prefix (one recursive listing)."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=True)
        return sorted(ObjectPath(self.scheme, i.path) for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File)

    def sizes(self) -> dict[str, int]:
        """Size of every object below this prefix, by key relative to it (one recursive listing)."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self.key, allow_not_found=True, recursive=True)
        n = len(self.key) + 1
        return {i.path[n:]: i.size for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File}

    def glob(self, pattern: str) -> list["ObjectPath"]:
        rx = glob_regex(posixpath.join(self.key, pattern))
        return [p for p in self.files() if rx.fullmatch(p.key)]


def glob_regex(pattern: str) -> re.Pattern:
    """A regex for a glob over ``/``-separated keys: ``*`` and ``?`` stay within a segment, ``**/`` spans any."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            j = pattern.index("]", i + 2)
            body = pattern[i + 1:j]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def file_sizes(folder) -> dict[str, int]:
    """Size of every file below ``folder`` (a Path or ObjectPath), by ``/``-separated path relative to
    it: one listing, whatever the number of files (one request per 1,000 objects on S3)."""
    if isinstance(folder, ObjectPath):
        return folder.sizes()
    out = {}
    for dirpath, _, names in os.walk(folder):  # does not follow links to folders
        rel = os.path.relpath(dirpath, folder)
        for name in names:
            try:
                info = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if st.S_ISREG(info.st_mode):  # a link is no file of the run: it could point anywhere
                out[name if rel == "." else f"{rel}/{name}".replace(os.sep, "/")] = info.st_size
    return out


def write_atomic(path, data: bytes) -> None:
    """``path`` holds ``data`` whole or keeps what it held: temporary name and rename on a disk,
    one PUT on an object store."""
    if isinstance(path, ObjectPath):
        path.write_bytes(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_tree(path) -> None:
    """Delete a folder (or prefix) and everything below it; nothing when it is absent."""
    if isinstance(path, ObjectPath):
        try:
            path.fs.delete_dir(path.key)
        except (FileNotFoundError, OSError):
            for p in path.files():
                p.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def arrow(path) -> tuple:
    """(``pyarrow.fs`` file system, path string) for ``path``, for pyarrow's readers and writers."""
    import pyarrow.fs as pafs

    if isinstance(path, ObjectPath):
        return path.fs, path.key
    return pafs.LocalFileSystem(), str(path)


_KINDS = ((st.S_ISDIR, "a folder"), (st.S_ISFIFO, "a FIFO"), (st.S_ISCHR, "a character device"),
          (st.S_ISBLK, "a block device"), (st.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str | None:
    """None for a regular file's ``st_mode``; else what it is, in words ("a FIFO", "a character device", ...)."""
    if st.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a file")


def not_regular(path, kind: str, key: str | None = None) -> str:
    """The one-line refusal of a path that is not a regular file: ``KEY: PATH is not a regular file (KIND)``."""
    return f"{key + ': ' if key else ''}{path} is not a regular file ({kind})"


def open_regular(path, key: str | None = None, error: type[Exception] = StorageError):
    """A binary reader of the local file ``path``, or ``error`` naming ``key`` (the option or config key the path
    came from), the path and what it is when it is not a regular file: a FIFO (``<(...)`` too), a device, a socket,
    a folder. A FIFO nobody writes to blocks its reader for ever and ``/dev/zero`` never ends, so every file a user
    hands actlake is opened here. The type is checked before the open (a device is never opened) and again on the
    opened file, which is opened without blocking (a FIFO put there in between cannot hang the open). A missing or
    unreadable path raises the OSError ``open`` would."""
    kind = kind_of(os.stat(path).st_mode)
    if kind:
        raise error(not_regular(path, kind, key))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        kind = kind_of(os.fstat(fd).st_mode)
        if kind:
            raise error(not_regular(path, kind, key))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, key: str | None = None, error: type[Exception] = StorageError) -> bytes:
    """The bytes of a user's file through :func:`open_regular` (an object's bytes for an ObjectPath: an object
    store holds no FIFOs or devices)."""
    if isinstance(path, ObjectPath):
        return path.read_bytes()
    with open_regular(path, key, error) as f:
        return f.read()


def check_folder(folder, key: str, error: type[Exception], recursive: bool = False, pattern: str = "*") -> None:
    """``error`` naming ``key`` and the first entry of ``folder`` matching ``pattern`` (all of them below it with
    ``recursive``) that is neither a regular file nor a folder: a model's or a tokenizer's folder, whose files a
    library (``from_pretrained``) opens by name. Links are followed (a link to a FIFO is a FIFO); a dangling one is
    left to the reader, which names it."""
    for p in sorted(Path(folder).rglob(pattern) if recursive else Path(folder).glob(pattern)):
        try:
            mode = os.stat(p).st_mode
        except OSError:
            continue
        kind = None if st.S_ISDIR(mode) else kind_of(mode)
        if kind:
            raise error(not_regular(p, kind, key))


def open_input(path):
    """A seekable binary reader of ``path`` (a local path string, Path or ObjectPath)."""
    p = location(path)
    return p.open("rb") if isinstance(p, ObjectPath) else open_regular(p)


def stat(path) -> tuple[int, int]:
    """(size in bytes, modification time in ns) of a local or object-store file."""
    p = location(path)
    info = p.stat() if isinstance(p, ObjectPath) else os.stat(p)
    return info.st_size, info.st_mtime_ns


def glob(pattern: str) -> list[str]:
    """Files matching ``pattern`` (``*``, ``?``, ``**``) as sorted strings: local absolute paths or URLs."""
    s = url_scheme(pattern)
    if s is None or s == "file":
        local = pattern[len("file://"):] if s == "file" else pattern
        return sorted(os.path.abspath(m) for m in _glob.glob(os.path.expanduser(local), recursive=True)
                      if not os.path.isdir(m))
    root = location(pattern)
    parts = root.key.split("/")
    fixed = next((i for i, x in enumerate(parts) if any(c in x for c in "*?[")), len(parts))
    if fixed == len(parts):
        return [str(root)] if root.is_file() else []
    base = ObjectPath(root.scheme, "/".join(parts[:fixed]))
    return [str(p) for p in base.glob("/".join(parts[fixed:]))]
