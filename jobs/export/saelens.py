"""``actlake export RUN --format saelens``: SAELens's activation cache (``CacheActivationsRunner``'s format, read by
its ``ActivationsStore`` with ``cached_activations_path``), one Arrow file per store file, each written by its own
task, so no process gathers the corpus."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from actlake.errors import ActlakeError, ConfigError
from actlake.fs import write_atomic
from actlake.jobs.export.store import Staging, Store, batches, check_output, output, run_tasks

log = logging.getLogger("actlake.export")

VERSION = 1
"""Changes when the same request would give another dataset (a stopped export of another version is not resumed)."""


def export_saelens(run_dir, layer: int, out_dir, context_size: int | None = None, hook_name: str | None = None,
                   workers: int = 1, address: str | None = None, scratch=None) -> dict:
    """A Hugging Face ``datasets`` folder (``save_to_disk``'s layout) with one row per window of exactly
    ``context_size`` tokens (default: the store's longest), a column named by TransformerLens's hook (default
    ``blocks.L.hook_resid_pre``: hidden state L is the residual stream entering block L) of
    ``Array2D((context_size, d), float32)``, and ``token_ids``, ``Sequence(int32, length=context_size)``. Windows
    of another length are left out and counted (shorter: a document's end; longer: a smaller ``context_size`` than
    the store's windows). Rows in the store's order (SAELens shuffles as it reads); every token of a window (SAELens
    leaves special tokens out as it reads, ``exclude_special_tokens``).

    Each store file becomes one Arrow file of the dataset, written by its own task: in this process (``workers``
    1), or as Ray tasks, ``workers`` at a time, on an embedded Ray or the cluster at ``address`` (the folder must
    then be one every node writes to); ``state.json`` lists the files. A stopped export resumes when run again
    with the same request (the files written are kept). ``out_dir`` may be an object-store URL: the dataset is made in
    ``scratch`` and uploaded file by file, ``state.json`` last. Returns what was written."""
    out = output(out_dir)
    check_output(out, workers)
    if context_size is not None and context_size < 1:
        raise ConfigError(f"--context-size: must be at least 1, got {context_size}")
    store = Store(run_dir, layer)
    lengths = store.window_lengths()
    T = context_size or int(lengths.max())
    counts = {"rows": int((lengths == T).sum()), "shorter": int((lengths < T).sum()), "longer": int((lengths > T).sum())}
    if not counts["rows"]:
        raise ConfigError(f"--context-size {T}: no stored window has exactly {T} tokens (the longest has "
                          f"{int(lengths.max())})")
    hook = hook_name or f"blocks.{store.layer}.hook_resid_pre"
    request = {"kind": "saelens", "version": VERSION, "store": store.fingerprint, "layer": store.layer,
               "context_size": T, "hook_name": hook}
    with Staging(out, request, scratch) as staging:
        if (staging / "state.json").exists():  # finished before a stop: only published now
            names = [f["filename"] for f in json.loads((staging / "state.json").read_text())["_data_files"]]
        else:
            n = len(store.files)
            jobs = [(str(p), i, n, store.layer, T, hook, store.d, str(staging)) for i, (p, _) in enumerate(store.files)]
            written = [w for w in run_tasks(_saelens_file, jobs, workers, address, "(Arrow files), store files")
                       if w is not None]
            if sum(k for _, k in written) != counts["rows"]:
                raise ActlakeError(f"export: {sum(k for _, k in written)} windows written where the store holds "
                                   f"{counts['rows']} of {T}")
            names = [name for name, _ in written]
            _saelens_state(staging, names)
        for p in staging.glob("done-*.json"):
            p.unlink()
    log.info("wrote %d windows of %d tokens (%s) in %d file(s); left out %d shorter and %d longer window(s)",
             counts["rows"], T, hook, len(names), counts["shorter"], counts["longer"])
    return {"rows": counts["rows"], "context_size": T, "d_model": store.d, "hook_name": hook, "files": len(names),
            "left_out_shorter": counts["shorter"], "left_out_longer": counts["longer"]}


def _saelens_file(path: str, i: int, n: int, layer: int, T: int, hook: str, d: int, staging: str):
    """Store file ``i``'s windows of T tokens as ``data-I-of-N.arrow`` in ``staging`` (``save_to_disk``'s own
    writer, through a scratch folder of its own), then ``done-I.json``; (file name, rows), or None when it has none.
    A file done already is skipped. Memory: about 4 times the file's hidden states in numpy arrays and 3.5 times in
    Arrow's while ``datasets`` converts them (measured on a 50 MiB file), so a store file (one shard's) bounds it."""
    import datasets

    staging = Path(staging)
    done = staging / f"done-{i:05d}.json"
    if done.exists():
        got = json.loads(done.read_text())
        return None if got is None else tuple(got)
    datasets.disable_progress_bars()  # the command prints its own line
    result = None
    parts = list(batches(path, layer, 65_536))
    if parts:
        index = np.concatenate([x for x, _ in parts])
        h = np.concatenate([v for _, v in parts])
        del parts  # the file's hidden states once from here on, and the windows taken beside them
        order = np.lexsort((index["position"], index["window_index"], index["doc_id"]))
        index = index[order]
        new = np.r_[True, (index["doc_id"][1:] != index["doc_id"][:-1])
                    | (index["window_index"][1:] != index["window_index"][:-1])]
        lengths = np.diff(np.r_[np.flatnonzero(new), len(index)])
        starts = np.r_[0, np.cumsum(lengths)[:-1]][lengths == T]
        if len(starts):
            take = (starts[:, None] + np.arange(T)).reshape(-1)  # (rows T,) in the store's order
            windows, ids = h[order[take]].reshape(-1, T, d), index["token_id"][take].reshape(-1, T)
            del h
            result = _write_arrow(staging, i, n, T, hook, d, windows, ids)
    write_atomic(done, json.dumps(result).encode())
    return result


def _write_arrow(staging: Path, i: int, n: int, T: int, hook: str, d: int, windows: np.ndarray,
                 ids: np.ndarray) -> tuple[str, int]:
    """``windows`` (N, T, d) and their token ids (N, T) as ``data-I-of-N.arrow``."""
    import datasets

    features = datasets.Features({hook: datasets.Array2D((T, d), "float32"),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=T)})
    ds = datasets.Dataset.from_dict({hook: windows, "token_ids": ids}, features=features)
    scratch = staging / f".task-{i:05d}"
    shutil.rmtree(scratch, ignore_errors=True)  # left by a stopped task
    ds.save_to_disk(str(scratch), num_shards=1)
    (arrow,) = [p for p in scratch.iterdir() if p.suffix == ".arrow"]
    name = f"data-{i:05d}-of-{n:05d}.arrow"
    os.rename(arrow, staging / name)
    os.replace(scratch / "dataset_info.json", staging / "dataset_info.json")  # the same in every task's
    shutil.rmtree(scratch)
    return name, len(ids)


def _saelens_state(staging: Path, names: list[str]) -> None:
    """``state.json`` naming every task's Arrow file in the store's order: ``load_from_disk`` then reads them as one
    dataset."""
    state = {"_data_files": [{"filename": name} for name in names], "_fingerprint": uuid.uuid4().hex[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    (staging / "state.json").write_text(json.dumps(state, indent=2))

