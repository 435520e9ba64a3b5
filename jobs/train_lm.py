"""``actlake train-lm``: tokenize the corpus, train a small GPT-NeoX on Ray Train, save it with save_pretrained."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from actlake.errors import StorageError
from actlake.predictive_config import LMConfig
from actlake.storage.layout import RunLayout, write_json_atomic

log = logging.getLogger("actlake.lm")

TRIAL = "lm"


def train_lm(cfg: LMConfig, address: str | None = None) -> dict:
    """Train (resuming a run directory); returns the model folder, token counts and the last losses."""
    from actlake import lm
    from actlake.jobs.run import init_ray
    from actlake.jobs.training import Resources, Trial, latest_checkpoint, run_trials

    t0 = time.perf_counter()
    layout = RunLayout(cfg.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("output", "resources", "name")}
    if layout.run_json.exists() and json.loads(layout.run_json.read_text()).get("settings") != settings:
        raise StorageError(f"{layout.root} holds a train-lm run with a different config; "
                           "pick a new output.run_id or delete the folder")
    write_json_atomic(layout.run_json, {"run_id": layout.root.name, "kind": "train-lm", "settings": settings})
    data = layout.root / "data"
    sizes_file = data / "sizes.json"
    if not sizes_file.exists():
        log.info("tokenizing the corpus")
        write_json_atomic(sizes_file, lm.build_token_streams(cfg, data))
    sizes = json.loads(sizes_file.read_text())
    print(f"train-lm: {sizes['documents']:,} documents, {sizes['train']:,} training and {sizes['eval']:,} held-out "
          f"tokens, vocabulary {sizes['vocab_size']:,}", flush=True)
    r = cfg.resources
    started = init_ray(address or r.address, dashboard=True)
    try:
        run_trials([Trial(TRIAL, lm.train_loop, {"job": cfg.to_dict(), "data": str(data)})], layout.root,
                   Resources(r.num_workers, r.cpus_per_worker, r.use_gpu))
    finally:
        if started:
            import ray

            ray.shutdown()
    step, ck = latest_checkpoint(layout.root / "checkpoints" / TRIAL)
    final = layout.root / "model"
    tmp = layout.root / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ck / "model", tmp)
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    import torch

    curve = torch.load(ck / "trainer_state.pt", weights_only=False)["curve"]
    summary = {"model": str(final), "step": step, **sizes, "wall_seconds": time.perf_counter() - t0,
               "last": curve[-1] if curve else None}
    write_json_atomic(layout.summary_json, summary)
    _write_curve(layout, curve)
    return summary


def _write_curve(layout: RunLayout, curve: list[dict]) -> None:
    import pyarrow as pa

    from actlake.storage.parquet_io import write_parquet_atomic

    if curve:
        write_parquet_atomic(pa.Table.from_pylist(curve), layout.aggregate_file("lm_curve"), layout.staging)
