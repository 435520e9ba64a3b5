"""``actlake train-lm``: tokenize the corpus, train a small GPT-NeoX on Ray Train, save it with save_pretrained."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

from actlake.config import resolve_corpus_files
from actlake.corpus.fingerprint import file_fingerprint, first_change
from actlake.errors import CorpusError, TrainingError
from actlake.jobs.common.ray_env import init_ray
from actlake.jobs.train.lm import loop as lm
from actlake.jobs.train.lm.config import LMConfig
from actlake.jobs.train.training import Resources, Trial, check_settings, run_trials
from actlake.provenance import provenance
from actlake.storage.checkpoints import (
    checkpoint_identity,
    checkpoint_problem,
    foreign,
    latest_checkpoint,
    prepare_checkpoints,
    verified_checkpoints,
)
from actlake.storage.layout import RunLayout, write_json_atomic, write_run_json
from actlake.storage.lock import holds_run_dir
from actlake.storage.publish import publish_table

log = logging.getLogger("actlake.lm")

TRIAL = "lm"


@holds_run_dir
def train_lm(cfg: LMConfig, address: str | None = None) -> dict:
    """Train (resuming a run directory); returns the model folder, token counts and the last losses.

    Everything that can be known before Ray starts is checked first: the settings and world size
    against the run directory, the token counts against ``seq_len``, and the checkpoints."""

    t0 = time.perf_counter()
    layout = RunLayout(cfg.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("output", "resources", "name")}
    r = cfg.resources
    check_settings(layout, "train-lm", "settings", settings, "config", r.num_workers)
    inputs = _check_inputs(cfg, layout)
    identity = checkpoint_identity(hashlib.sha256(json.dumps([cfg.config_hash, inputs], sort_keys=True).encode())
                                   .hexdigest()[:12], TRIAL)
    data = layout.root / "data"
    sizes = _token_streams(cfg, data, inputs)
    lm.check_token_counts(cfg, sizes)
    write_run_json(layout, {"run_id": layout.root.name, "kind": "train-lm", "settings": settings,
                                        "inputs": inputs, "world_size": r.num_workers})
    print(f"train-lm: {sizes['documents']:,} documents, {sizes['train']:,} training and {sizes['eval']:,} held-out "
          f"tokens, vocabulary {sizes['vocab_size']:,}", flush=True)
    if prepare_checkpoints(layout.root / "checkpoints" / TRIAL, identity) == cfg.training.steps:
        print(f"train-lm: trained to step {cfg.training.steps} already; nothing to train", flush=True)
    else:
        started = init_ray(address or r.address, dashboard=True)
        try:
            run_trials([Trial(TRIAL, lm.train_loop, {"job": cfg.to_dict(), "data": str(data), "identity": identity})],
                       layout.root, Resources(r.num_workers, r.cpus_per_worker, r.use_gpu))
        finally:
            if started:
                import ray

                ray.shutdown()
    step, ck = latest_checkpoint(layout.root / "checkpoints" / TRIAL)
    problem = foreign(ck, identity) or checkpoint_problem(ck)
    if problem:
        raise TrainingError(f"the final checkpoint: {problem}")
    final = _export(ck, data / "tokenizer", layout.root / "model")
    snapshots = [{"step": s, "path": str(_export(c, data / "tokenizer", layout.root / "snapshots" / f"step-{s}"))}
                 for s, c in verified_checkpoints(layout.root / "checkpoints" / TRIAL, lm.snapshot_steps(cfg.training),
                                                  identity, "train again")]
    if snapshots:
        print(f"train-lm: {len(snapshots)} snapshots for a checkpoint sweep in {layout.root / 'snapshots'} (steps "
              f"{', '.join(str(s['step']) for s in snapshots)})", flush=True)
    import torch

    curve = torch.load(ck / "trainer_state.pt", weights_only=False)["curve"]
    summary = {"model": str(final), "step": step, "snapshots": snapshots, **sizes,
               "wall_seconds": time.perf_counter() - t0, "last": curve[-1] if curve else None,
               "provenance": provenance(json.loads(layout.run_json.read_text()).get("inputs"))}
    write_json_atomic(layout.summary_json, summary)
    _write_curve(layout, curve)
    return summary


def _export(checkpoint: Path, tokenizer: Path, dest: Path) -> Path:
    """A checkpoint's model with the tokenizer beside it, as ``dest`` (a ``from_pretrained`` folder), replaced whole."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint / "model", tmp)
    for f in tokenizer.iterdir():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _check_inputs(cfg: LMConfig, layout: RunLayout) -> dict:
    """Fingerprints of the corpus files and of the tokenizer folder's files (``path -> fingerprint``); a
    CorpusError naming the first that changed since the run directory was made (its ``run.json``)."""

    paths = resolve_corpus_files(cfg)
    if cfg.tokenizer.path:
        paths += sorted(str(p) for p in Path(cfg.tokenizer.path).rglob("*") if p.is_file())
    inputs = {p: file_fingerprint(p) for p in paths}
    old = json.loads(layout.run_json.read_text()).get("inputs") if layout.run_json.is_file() else None
    changed = first_change(old, inputs) if old is not None else None
    if changed:
        raise CorpusError(f"{changed[0]}: {changed[1]} since run '{layout.root.name}' began, so its checkpoints were "
                          f"trained on other text or token ids; pick a new output.run_id (--run-id) or delete {layout.root}")
    return inputs


def _token_streams(cfg: LMConfig, data: Path, inputs: dict) -> dict:
    """Tokenize the corpus into ``data`` once; reused while the corpus (its files' fingerprints), the
    tokenizer and eval_fraction are unchanged."""

    key = hashlib.sha256(json.dumps({"corpus": cfg.to_dict()["corpus"], "tokenizer": cfg.to_dict()["tokenizer"],
                                     "inputs": inputs, "eval_fraction": cfg.training.eval_fraction},
                                    sort_keys=True).encode()).hexdigest()
    sizes_file = data / "sizes.json"
    sizes = json.loads(sizes_file.read_text()) if sizes_file.exists() else {}
    if sizes.pop("key", None) != key:
        log.info("tokenizing the corpus")
        sizes = lm.build_token_streams(cfg, data)
        write_json_atomic(sizes_file, dict(sizes, key=key))
    return sizes


def _write_curve(layout: RunLayout, curve: list[dict]) -> None:
    import pyarrow as pa


    if curve:
        publish_table(layout.root, "lm_curve", None, pa.Table.from_pylist(curve))
