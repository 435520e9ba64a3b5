"""Training checkpoints: folders we own, written whole, checked before anyone reads them.

A checkpoint is ``checkpoints/<trial>/step-NNNNNNNN/`` under the run directory: the job's files (model,
trainer state), ``identity.json`` (the run and trial it belongs to) and ``manifest.json`` (size and sha256
of every file), written under a temporary name and renamed into place. Before a trial starts the driver
removes leftover temporary folders, refuses another run's checkpoints and checks its own against their
manifests, newest first, so a restarted trial resumes from the newest whole one (a damaged one is named
and set aside). Readers of a finished run take only verified checkpoints (:func:`verified_checkpoints`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from actlake.errors import TrainingError
from actlake.hashing import file_sha256

log = logging.getLogger("actlake.training")

STATE_FILE = "trainer_state.pt"


# --------------------------------------------------------------------------- checkpoints


def checkpoint_path(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Whole checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("step-") and (p / STATE_FILE).is_file():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    cks = list_checkpoints(root)
    return cks[-1] if cks else None


MANIFEST = "manifest.json"
"""In every checkpoint folder: size and sha256 of each of its files, written last, before the rename."""
IDENTITY = "identity.json"
"""In every checkpoint folder (and in its manifest): the run and trial it belongs to, :func:`checkpoint_identity`."""


def checkpoint_identity(config_hash: str, trial: str) -> dict:
    """What a checkpoint must carry to be resumed or analysed by this run: the hash of every setting that
    changes training (seed and inputs included, ``TrainJob.config_hash``) and the trial's name."""
    return {"config": config_hash, "trial": trial}


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], identity: dict | None = None) -> Path:
    """Call ``write(tmp_folder)``, add the run's ``identity`` and the manifest, then rename the folder to
    ``step-NNNNNNNN`` (replacing one).

    A failed write (disk full, ...) raises :class:`TrainingError` naming the checkpoint; the older
    checkpoints are untouched, and the temporary folder is removed."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step:08d}-{uuid.uuid4().hex[:8]}"
    final = checkpoint_path(root, step)
    try:
        tmp.mkdir()
        write(tmp)
        if identity is not None:
            (tmp / IDENTITY).write_text(json.dumps(identity, sort_keys=True))
        _write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as e:
        free = shutil.disk_usage(root).free / 2**20
        raise TrainingError(f"could not write checkpoint {final}: {_first_line(e)} ({free:,.0f} MiB free on its "
                            "disk); the previous checkpoint is kept") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be used (naming the file), or None if it is whole.

    With a manifest every file's size and sha256 are checked; an older checkpoint without one must
    at least unpickle its trainer state."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        try:
            import torch

            torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
        except Exception as e:
            return f"{path / STATE_FILE}: unreadable ({_first_line(e)})"
        return None
    try:
        files = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        return f"{manifest}: unreadable ({_first_line(e)})"
    for name, meta in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != meta["bytes"]:
            return f"{f}: {f.stat().st_size} bytes, its manifest says {meta['bytes']}"
        if file_sha256(f) != meta["sha256"]:
            return f"{f}: contents differ from its manifest (sha256)"
    return None


def foreign(path: Path, identity: dict | None) -> str | None:
    """Why the checkpoint ``path`` belongs to another run or trial than ``identity`` (None: it is this one's,
    or it predates identities, or no identity is asked for)."""
    f = Path(path) / IDENTITY
    if identity is None or not f.is_file():
        return None
    try:
        theirs = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        return f"{f}: unreadable ({_first_line(e)})"
    if theirs != identity:
        differ = ", ".join(f"{k} {theirs.get(k)!r} (this run: {identity.get(k)!r})"
                           for k in sorted(set(theirs) | set(identity)) if theirs.get(k) != identity.get(k))
        return f"{path}: a checkpoint of another run or trial: {differ}"
    return None


def verified_checkpoints(root: Path, steps: list[int], identity: dict | None,
                         remedy: str = "train the run again without --analysis-only") -> list[tuple[int, Path]]:
    """The checkpoints of ``steps`` under ``root``, each whole (its manifest) and this run's (its identity);
    a TrainingError naming the first that is missing, damaged or foreign, and ``remedy``. For readers of a
    finished run."""
    have = dict(list_checkpoints(root))
    out = []
    for step in steps:
        if step not in have:
            raise TrainingError(f"{checkpoint_path(root, step)}: missing (a checkpoint kept for this run's readers); "
                                f"{remedy}, or delete the trial's checkpoints")
        problem = foreign(have[step], identity) or checkpoint_problem(have[step])
        if problem:
            raise TrainingError(f"{problem}; delete it and {remedy}")
        out.append((step, have[step]))
    return out


def prepare_checkpoints(root: Path, identity: dict | None = None) -> int | None:
    """Before a trial starts: remove leftover ``.tmp-*`` folders, refuse checkpoints of another run
    (``identity``, naming the first), then check checkpoints newest first.

    Damaged ones newer than a whole one are renamed ``damaged-step-NNNNNNNN`` and the whole one is
    used (warnings name each file and cause). Returns the step the trial resumes from (None: from
    scratch); raises :class:`TrainingError`, moving nothing, when checkpoints exist but none is usable."""
    root = Path(root)
    if not root.is_dir():
        return None
    for tmp in root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for _, path in list_checkpoints(root):
        why = foreign(path, identity)
        if why:
            raise TrainingError(f"{why}; move it away, or delete {root} to train this trial from the start")
    damaged = []
    for step, path in reversed(list_checkpoints(root)):
        problem = checkpoint_problem(path)
        if problem is not None:
            damaged.append((path, problem))
            continue
        for bad, why in damaged:
            aside = root / f"damaged-{bad.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(bad, aside)
            log.warning("damaged checkpoint %s, moved to %s", why, aside.name)
        if damaged:
            log.warning("%s: falling back to the checkpoint of step %d", root, step)
        return step
    if damaged:
        raise TrainingError(f"no usable checkpoint in {root}: {'; '.join(why for _, why in damaged)}; delete "
                            f"{root} to train this trial from the start")
    return None


def prune_checkpoints(root: Path, keep_steps: set[int], keep_last: int = 2) -> None:
    """Delete checkpoints whose step is not in ``keep_steps``, except the newest ``keep_last``
    (two: the previous one stays as a fallback should the newest be damaged)."""
    cks = list_checkpoints(root)
    for step, path in cks[: max(len(cks) - keep_last, 0)]:
        if step not in keep_steps:
            shutil.rmtree(path, ignore_errors=True)


def log_spaced_steps(total: int, n: int) -> list[int]:
    """About ``n`` steps from 0 to ``total``, evenly spaced in log(1 + step), always with 0 and total."""
    if total <= 0:
        return [0]
    pts = {0, total}
    for i in range(1, n):
        pts.add(int(round(math.expm1(math.log1p(total) * i / (n - 1)))))
    return sorted(p for p in pts if 0 <= p <= total)


def trial_steps(run_dir: Path, trials: list[str]) -> dict[str, int | None]:
    """Newest checkpoint step of every trial (None: none yet)."""
    out = {}
    for name in trials:
        latest = latest_checkpoint(Path(run_dir) / "checkpoints" / name)
        out[name] = latest[0] if latest else None
    return out


def require_finished(run_dir: Path, trials: list[str], steps: int, how: str) -> None:
    """Raise :class:`TrainingError` unless every trial has a checkpoint of its last step (``how``: how to finish)."""
    behind = {n: s for n, s in trial_steps(run_dir, trials).items() if s != steps}
    if behind:
        shown = ", ".join(f"{n} at step {s if s is not None else 'none'}" for n, s in behind.items())
        raise TrainingError(f"{run_dir}: training is unfinished ({shown} of {steps}); {how}")
