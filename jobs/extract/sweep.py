"""A checkpoint sweep (``model.checkpoints``): the job's shards under each checkpoint, one run per checkpoint.

``RUN/checkpoints/LABEL/`` is an ordinary run of the same config with that checkpoint as the model. They run
one after the other, so the work is ordered by checkpoint and each worker loads each checkpoint once; each
resumes on its own (its plan, commit groups and completion records), so (checkpoint, shard) is the unit of
work. ``RUN/sweep.json``, written last, lists the checkpoints with the sha256 of their weight files and
``same_as`` (the first earlier checkpoint with byte-identical weights): public checkpoint series do serve
identical weights under different step names, and a sweep that plotted them silently would mislead.
``actlake sql RUN`` opens the runs side by side with a leading column ``checkpoint`` and a table
``checkpoints`` (:mod:`~actlake.storage.sql`); the report draws the headline statistics against the step.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from pathlib import Path

from actlake.config import JobConfig, resolve_model_path
from actlake.config_base import looks_local
from actlake.errors import ModelLoadError
from actlake.hashing import file_sha256
from actlake.jobs.common.ray_env import holding_ray
from actlake.jobs.extract.kept_workers import keeping_workers
from actlake.jobs.extract.report import build_report
from actlake.storage.layout import CHECKPOINTS_DIR, SWEEP_RECORD, sweep_checkpoints, write_json_atomic

log = logging.getLogger("actlake.sweep")
WEIGHTS = re.compile(r"(.*\.safetensors|pytorch_model.*\.bin|tf_model.*\.h5|flax_model.*\.msgpack)")
"""Files whose bytes are a model's weights, as ``from_pretrained`` names them (in the digest with their names;
configs, tokenizers and a trainer's optimizer, scheduler and RNG states are not)."""


def checkpoint_config(cfg: JobConfig, c) -> JobConfig:
    """The job of one checkpoint: ``cfg`` with that model, run in ``RUN/checkpoints/LABEL``."""
    where = {"name_or_path": c.path, "revision": None} if c.path is not None else {"revision": c.revision}
    model = cfg.model.model_copy(update={"checkpoints": [], **where})
    output = cfg.output.model_copy(update={"dir": str(cfg.run_dir / CHECKPOINTS_DIR), "run_id": c.name, "report": False})
    return cfg.model_copy(update={"model": model, "output": output})


def weights_digest(cfg: JobConfig, c, known: dict | None = None) -> tuple[str, dict]:
    """(sha256 over a checkpoint's weight files, each file's name and sha256 in name order; per local file
    [size, mtime_ns, sha256]): equal digests are byte-identical weights. A local folder's files are read here,
    except those ``known`` (the last sweep's record) gives with the same size and modification time; a hub
    model's are not downloaded: the hub's own sha256 of each (LFS) file is used, at the revision it is loaded at."""
    name = c.path if c.path is not None else cfg.model.name_or_path
    files: dict = {}
    if c.path is not None and (looks_local(name) or name.startswith("package:")):
        folder = Path(resolve_model_path(name, f"model.checkpoints: {c.name}"))
        # not only regular files: a FIFO or device named like weights is refused by name (file_sha256), never skipped
        for p in sorted(p for p in folder.rglob("*") if p.exists() and not p.is_dir() and WEIGHTS.fullmatch(p.name)):
            rel, st = p.relative_to(folder).as_posix(), p.stat()
            old = (known or {}).get(rel)
            same = isinstance(old, list) and len(old) == 3 and old[:2] == [st.st_size, st.st_mtime_ns]
            files[rel] = [st.st_size, st.st_mtime_ns, old[2] if same else file_sha256(p)]
        digests = [(rel, meta[2]) for rel, meta in files.items()]
    else:  # loaded as checkpoint_config says: a path at no revision, a revision of name_or_path
        digests = _hub_digests(name, c.revision, c.name)
    if not digests:
        raise ModelLoadError(f"model.checkpoints: {c.name} ({name}): no weight files (*.safetensors, "
                             "pytorch_model*.bin, tf_model*.h5, flax_model*.msgpack)")
    h = hashlib.sha256()
    for rel, digest in digests:
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest(), files


def _hub_digests(repo: str, revision: str | None, label: str) -> list[tuple[str, str]]:
    """(file, sha256) of a hub model's weight files at ``revision``, from the hub's file metadata."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:  # noqa: BLE001 - offline, unknown revision, private repo: one line naming it
        raise ModelLoadError(f"model.checkpoints: {label}: cannot read the weight files' sha256 of {repo} at "
                             f"revision {revision} from the hub ({type(e).__name__}: {e})") from None
    return sorted((s.rfilename, s.lfs.sha256 if s.lfs else (s.blob_id or "")) for s in info.siblings
                  if WEIGHTS.fullmatch(s.rfilename.rsplit("/", 1)[-1]))


def run_sweep(cfg: JobConfig, address: str | None = None, report: bool | None = None, on_shard=None):
    """Run every checkpoint's job in order (each resumes what it finished before), then write the sweep's
    record and report; returns a :class:`~actlake.jobs.extract.run.RunResult` over all of them."""
    from actlake.jobs.extract.run import (  # actlake.jobs.extract.run imports this module: imported when used
        RunResult,
        run_job,
    )

    t0 = time.perf_counter()
    rows, results = [], []
    before = {r["checkpoint"]: r.get("files") for r in sweep_checkpoints(cfg.run_dir) or []}  # a rerun's
    with holding_ray(), keeping_workers():  # one Ray for every checkpoint, and its workers serve the next checkpoint
        for i, c in enumerate(cfg.model.checkpoints):
            digest, files = weights_digest(cfg, c, before.get(c.name))
            same_as = next((r["checkpoint"] for r in rows if r["sha256"] == digest), None)
            if same_as is not None:
                log.warning("checkpoint %s has byte-identical weights to %s (sha256 %s): its statistics are %s's; "
                            "the checkpoints table flags it (same_as)", c.name, same_as, digest[:12], same_as)
            log.info("checkpoint %d/%d: %s (%s)", i + 1, len(cfg.model.checkpoints), c.name, c.path or c.revision)
            results.append(run_job(checkpoint_config(cfg, c), address, report=False, on_shard=on_shard))
            rows.append({"checkpoint": c.name, "step": c.step, "path": c.path, "revision": c.revision,
                         "sha256": digest, "same_as": same_as, "files": files})
    write_json_atomic(cfg.run_dir / SWEEP_RECORD, {"checkpoints": rows})  # last: a sweep is opened once complete
    totals = sweep_totals([r.totals for r in results], time.perf_counter() - t0)
    totals["checkpoints"] = rows
    report_path = None
    if cfg.output.report if report is None else report:
        report_path = str(build_report(cfg.run_dir))
    return RunResult(str(cfg.run_dir), sum(r.shards_total for r in results), sum(r.shards_run for r in results),
                     totals, time.perf_counter() - t0, report_path)


def sweep_totals(totals: list[dict], wall: float) -> dict:
    """The checkpoints' job totals added up (documents, windows, tokens: once per checkpoint)."""
    from actlake.jobs.extract.reduce import COUNTS, add_counts

    out = {"wall_seconds": wall} | add_counts(totals, ("shards",) + COUNTS + ("tokens_run",))
    out["tokens_per_second"] = out["tokens_run"] / wall if out["tokens_run"] else None
    return out
