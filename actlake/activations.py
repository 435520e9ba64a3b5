"""Reading a token export (``actlake export RUN --format tokens``): shuffled activations for SAE training.

    from actlake.activations import iterate
    for batch in iterate("exports/resid-1", batch_size=4096):   # (4096, d) float32 tensors
        ...

The rows are already in a global random order (the export's seed), so reading the shards in turn gives shuffled
batches; a ``torch.utils.data.DataLoader`` with workers splits the shards between them. The folder may be an
object-store URL (``s3://bucket/exports/resid-1``): the shards are read from there, one at a time.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import torch

from actlake.errors import ConfigError
from actlake.fs import ObjectPath, kind_of, location, not_regular, read_regular

INDEX = ("doc_id", "window_index", "position", "token_id")


def manifest(folder) -> dict:
    """The export's ``manifest.json``, checked: a folder that is not a token export is one line naming it."""
    path = location(folder) / "manifest.json"
    try:
        m = json.loads(read_regular(path, error=ConfigError))
    except FileNotFoundError:
        raise ConfigError(f"{folder}: not a token export (no manifest.json); write one with actlake export") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not a token export's manifest ({e})") from None
    if m.get("format") != "actlake-tokens" or m.get("version") != 1:
        raise ConfigError(f"{path}: not a token export's manifest of this version (format {m.get('format')!r}, "
                          f"version {m.get('version')!r})")
    return m


def read_shard(folder, entry: dict, with_index: bool = False):
    """One shard: its activations (N, d) as a float32 torch tensor, and with ``with_index`` a dict of its index
    columns (numpy)."""
    name = str(entry.get("file", ""))
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ConfigError(f"{folder}/manifest.json: shard {name!r} is not a file name of the export's folder")
    path = location(folder) / name
    local = not isinstance(path, ObjectPath)
    if local and kind_of(os.stat(path).st_mode):
        raise ConfigError(not_regular(path, kind_of(os.stat(path).st_mode)))
    source = (lambda p: p) if local else (lambda p: io.BytesIO(p.read_bytes()))  # an object: its bytes, read once
    if path.suffix == ".npy":
        h = torch.from_numpy(np.load(source(path)))
        if with_index:
            index = np.load(source(path.with_name(path.name[:-4] + "-index.npy")))
            index = {k: index[k] for k in INDEX}
    else:
        from safetensors.torch import load, load_file

        tensors = load_file(str(path)) if local else load(path.read_bytes())
        h = tensors["activations"].float()
        index = {k: tensors[k].numpy() for k in INDEX} if with_index else None
    if h.shape[0] != entry["rows"]:
        raise ConfigError(f"{path}: {h.shape[0]} rows where the manifest says {entry['rows']}")
    return (h, index) if with_index else h


class TokenBatches(torch.utils.data.IterableDataset):
    """An iterable of (batch_size, d) float32 tensors over an export's shards in order (the last batch shorter
    unless ``drop_last``); a ``torch.utils.data.IterableDataset``. Under a DataLoader with workers, worker k of n
    reads shards k, k + n, ...; with ``epochs`` > 1 the shards are read again, in the same order."""

    def __init__(self, folder, batch_size: int, drop_last: bool = False, epochs: int = 1):
        if batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {batch_size}")
        super().__init__()
        self.folder, self.batch_size, self.drop_last, self.epochs = location(folder), batch_size, drop_last, epochs
        self.manifest = manifest(folder)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        shards = self.manifest["shards"]
        if info is not None:
            shards = shards[info.id :: info.num_workers]
        carry = None
        for _ in range(self.epochs):
            for entry in shards:
                h = read_shard(self.folder, entry)
                if carry is not None:
                    h, carry = torch.cat([carry, h]), None
                n = (len(h) // self.batch_size) * self.batch_size
                if n:  # (split of an empty tensor gives one empty batch)
                    yield from h[:n].split(self.batch_size)
                if n < len(h):
                    carry = h[n:]
        if carry is not None and not self.drop_last:
            yield carry


def iterate(folder, batch_size: int, drop_last: bool = False, epochs: int = 1) -> TokenBatches:
    """A :class:`TokenBatches` over the export in ``folder``: iterate it, or hand it to a ``DataLoader`` with
    ``batch_size=None``."""
    return TokenBatches(folder, batch_size, drop_last, epochs)
