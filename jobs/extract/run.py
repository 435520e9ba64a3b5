"""``actlake run``: parse config, plan shards, dispatch to Ray actors, reduce, report."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from actlake.config import JobConfig, resolve_model_path
from actlake.corpus.fingerprint import current_fingerprints, first_change
from actlake.corpus.readers import HF_STREAM
from actlake.errors import ActlakeError, ConfigError, CorpusError, StorageError, printable
from actlake.fs import ObjectPath, location, read_regular, remove_tree
from actlake.jobs.common.ray_env import init_ray, ray_released, release_ray, store_env
from actlake.jobs.extract.dispatch import Dispatcher, Events
from actlake.jobs.extract.identity import identity_change, run_identity
from actlake.jobs.extract.kept_workers import keep, kept_key, take_kept
from actlake.jobs.extract.plan import plan_hash, plan_with_inputs, planned_labels
from actlake.jobs.extract.progress import Progress, job_counter
from actlake.jobs.extract.reduce import reduce_run
from actlake.jobs.extract.report import build_report
from actlake.provenance import provenance
from actlake.storage.layout import RunLayout, write_json_atomic, write_run_json
from actlake.storage.lock import run_lock
from actlake.storage.manifest import read_run
from actlake.storage.shards import committed

log = logging.getLogger("actlake.run")


@dataclass
class RunResult:
    run_dir: str
    shards_total: int
    shards_run: int
    totals: dict
    wall_seconds: float
    report: str | None


@dataclass(frozen=True)
class Job:
    """One extraction job as :func:`run_job` settles it before Ray (checked config, plan, inputs, resolved edits):
    what the steps after it take instead of a row of parameters."""

    cfg: JobConfig
    layout: RunLayout
    shards: list
    """The plan's :class:`~actlake.jobs.extract.plan.Shard` s."""
    inputs: dict
    """The corpus files' fingerprints planning took (path -> fingerprint)."""
    plan_hash: str
    analyses: list
    """The enabled producers' classes."""
    interventions: tuple = ()
    """The resolved interventions (directions' and means' values read once), () without any."""
    tables: tuple = ()
    """The shard tables' classes (documents, rejects, tokens, ...)."""

    @property
    def producers(self) -> list:
        """Every producer of the job: the analyses, then the shard tables."""
        return [*self.analyses, *self.tables]


def _worker_shape(cfg: JobConfig) -> tuple[int, float, float, int]:
    """(workers, cpus each, gpus each, torch threads) from the config and the cluster. A worker that no
    node could hold (more GPUs or memory than any node has) is an error naming the key, not a job that
    waits for ever."""
    import ray

    r = cfg.resources
    res = ray.cluster_resources()
    gpus = r.gpus_per_worker or (1.0 if res.get("GPU", 0) >= 1 else 0.0)
    check_fits_a_node(r, gpus, [nd["Resources"] for nd in ray.nodes() if nd["Alive"]])
    n = r.num_workers or (max(1, int(res.get("GPU", 0) // gpus)) if gpus else 1)
    biggest_node = max((nd["Resources"].get("CPU", 0) for nd in ray.nodes() if nd["Alive"]), default=1)
    cpus = r.cpus_per_worker or (max(1.0, min(res.get("CPU", 1) // n, biggest_node)) if not gpus else 1.0)
    return n, cpus, gpus, int(cpus)


def check_fits_a_node(r, gpus: float, nodes: list[dict]) -> None:
    """ConfigError naming ``resources.cpus_per_worker`` / ``gpus_per_worker`` / ``memory_per_worker_gb`` when no
    node of the cluster (``nodes``: each alive node's Ray resources) has that much (Ray would wait for ever)."""

    most_cpus = max((nd.get("CPU", 0) for nd in nodes), default=0)
    if r.cpus_per_worker and r.cpus_per_worker > most_cpus:
        raise ConfigError(f"resources.cpus_per_worker: {r.cpus_per_worker:g} CPUs per worker, but no node of the "
                          f"cluster offers Ray more than {most_cpus:g}")
    most_gpus = max((nd.get("GPU", 0) for nd in nodes), default=0)
    if r.gpus_per_worker and r.gpus_per_worker > most_gpus:
        raise ConfigError(f"resources.gpus_per_worker: {r.gpus_per_worker:g} GPUs per worker, but no node of the "
                          f"cluster has more than {most_gpus:g} (one worker's GPUs must be on one node)")
    if r.memory_per_worker_gb:
        most = max((nd.get("memory", 0) for nd in nodes), default=0) / 2**30
        if r.memory_per_worker_gb > most:
            raise ConfigError(f"resources.memory_per_worker_gb: {r.memory_per_worker_gb:g} GiB per worker, but no "
                              f"node of the cluster offers Ray more than {most:.1f} GiB")


def read_ahead(cfg: JobConfig, gpus: float) -> bool:
    """Whether a worker holds a second shard to read while the model runs (``resources.read_ahead``;
    default: on GPU workers, whose device would otherwise wait for the CPU between shards)."""
    r = cfg.resources.read_ahead
    return gpus > 0 if r is None else bool(r)


def read_in_process(cfg: JobConfig, gpus: float) -> bool:
    """Whether a worker reads its shards in a process of its own (``resources.read_in_process``; default: with
    read-ahead, which is what lets that process work while the model runs)."""
    r = cfg.resources.read_in_process
    return read_ahead(cfg, gpus) if r is None else bool(r)


def worker_options(cfg: JobConfig, cpus: float, gpus: float) -> dict:
    """Ray actor options of one ShardWorker: CPUs, GPUs, memory (``resources.memory_per_worker_gb``), restarts.
    The object-store variables travel as the actor's argument, not as a runtime_env (see ``jobs/common/ray_env.py``)."""
    r = cfg.resources
    options = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=r.max_retries, max_task_retries=0,
                   max_concurrency=2 if read_ahead(cfg, gpus) else 1)
    if r.memory_per_worker_gb:
        options["memory"] = int(r.memory_per_worker_gb * 2**30)
    return options


def ensure_output_dir(path) -> None:
    """Create ``output.dir`` if needed; a one-line StorageError naming it when it is not a writable folder
    (in an object store: when a probe object cannot be written and removed)."""
    if isinstance(path, ObjectPath):
        probe = path / f".actlake-write-test-{uuid.uuid4().hex[:8]}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StorageError(f"output.dir: cannot write in {path} ({str(e).strip().splitlines()[0][:300]})") from None
        return
    if path.exists() and not path.is_dir():
        raise StorageError(f"output.dir: {path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(f"output.dir: cannot create {path} ({e.strerror or e})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".actlake-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise StorageError(f"output.dir: cannot write in {path} ({e.strerror or e})") from None


def prepare_run_dir(cfg: JobConfig, layout: RunLayout, shards, phash: str, inputs: dict | None = None,
                    interventions: tuple | None = None) -> None:
    """Create the run directory and its run.json, or check that an existing one is the same run:
    same inputs (file fingerprints, see actlake/corpus/fingerprint.py), same model files and code
    (:mod:`~actlake.jobs.extract.identity`) and same plan.

    ``inputs``: the fingerprints planning took (path -> fingerprint); None takes them again. ``interventions``:
    the resolved interventions (None resolves them again)."""
    inputs = plan_with_inputs(cfg)[1] if inputs is None else inputs
    identity = run_identity(cfg, custom_code(cfg), interventions)
    layout.root.mkdir(parents=True, exist_ok=True)
    if layout.run_json.is_file():
        old = read_run(layout)  # a run of another format: refused, naming it
        changed = first_change(old["inputs"], inputs)
        if changed:
            raise CorpusError(f"{changed[0]}: {changed[1]} since run '{layout.root.name}' was planned, so its results "
                              f"would mix two corpora; pick a new output.run_id (--run-id) or delete {layout.root}")
        changed = identity_change(old["identity"], identity)
        if changed:
            raise StorageError(f"{changed} since run '{layout.root.name}' began, so its results would mix two "
                               f"{'models' if changed.startswith(('model', 'the model')) else 'edits' if 'intervention' in changed else 'code versions'}; "
                               f"pick a new output.run_id (--run-id) or delete {layout.root}")
        if old.get("plan_hash") != phash:
            raise StorageError(
                f"{layout.root} holds run '{layout.root.name}' with a different config or corpus "
                f"(plan {old.get('plan_hash')} vs {phash}); pick a new output.run_id or delete the folder"
            )
        return
    write_run_json(layout, {"run_id": layout.root.name, "plan_hash": phash, "config": cfg.to_dict(),
                                        "inputs": inputs, "identity": identity, "shards": [asdict(s) for s in shards],
                                        "created": time.time()})


def check_inputs_after_failure(layout: RunLayout, inputs: dict, n_failed: int) -> None:
    """Raise one CorpusError naming the first input that changed while the run went on, if any."""
    changed = first_change(inputs, current_fingerprints(inputs))
    if changed:
        raise CorpusError(f"{changed[0]}: {changed[1]} while run '{layout.root.name}' was going; {n_failed} shard(s) "
                          f"failed; pick a new output.run_id (--run-id) or delete {layout.root}")


class _CustomCode(importlib.abc.MetaPathFinder):
    """Finds the custom analyses' own top-level modules in their folders, and nothing else: the folder is not put
    on sys.path, so a file there named like a module the driver imports later (psutil, duckdb, ray) never runs."""

    def __init__(self):
        self.where: dict[str, str] = {}

    def find_spec(self, name, path=None, target=None):
        folder = self.where.get(name)
        return importlib.machinery.PathFinder.find_spec(name, [folder]) if folder else None


_CUSTOM = _CustomCode()


def import_custom_analyses(cfg: JobConfig) -> None:
    """Let the driver import the modules of ``analyses.custom[].path`` (as the workers can, through Ray): the
    file's or package's own name only."""
    for _, _, path in cfg.code_refs:
        if path:
            p = Path(path)
            _CUSTOM.where[p.stem if p.is_file() else p.name] = str(p.parent)
    if _CUSTOM.where and _CUSTOM not in sys.meta_path:
        sys.meta_path.insert(0, _CUSTOM)


REDISPATCH = 3
"""Rounds of dispatch per job: a round ends with shards uncommitted only when a worker thought dead
committed a group that overlaps a newer one, which readers then skip (see storage/shards.py)."""

CUSTOM_CODE_LIMIT = 16 << 20
"""Bytes of custom-analysis code shipped to each worker, at most."""


def check_custom_views(cfg: JobConfig) -> None:
    """ConfigError naming the view and its analysis when a custom view is not one SELECT (``actlake sql`` would
    refuse it, and every query of the run with it)."""
    from actlake.analysis.registry import custom_views, enabled, shard_tables
    from actlake.errors import QueryError
    from actlake.storage.sql import check_statement

    for cls in custom_views([c for c, _ in enabled(cfg) + shard_tables(cfg)]):
        for name, sql in cls.views.items():
            try:
                check_statement(sql)
            except QueryError as e:
                raise ConfigError(f"analysis {cls.name!r}: its view {name!r} is not one SELECT ({e})") from None


def custom_code(cfg: JobConfig) -> dict[str, bytes]:
    """The custom analyses' code, ``{path relative to its parent folder: bytes}``, for the workers (Ray
    accepts local ``py_modules`` only for a whole job, not per actor, so the code travels as an argument)."""
    files: dict[str, bytes] = {}
    for key, target, path in cfg.code_refs:
        if not path:
            continue
        root = Path(path)
        members = [root] if root.is_file() else [p for p in root.rglob("*.py") if "__pycache__" not in p.parts]
        for p in members:
            where = ".".join(k for k in key if isinstance(k, str))  # analyses.custom, interventions
            files[str(p.relative_to(root.parent))] = read_regular(p, f"{where}: {target}", ConfigError)
    if sum(map(len, files.values())) > CUSTOM_CODE_LIMIT:
        raise ConfigError(f"analyses.custom: more than {CUSTOM_CODE_LIMIT >> 20} MiB of code to ship; install it "
                          "on the workers instead and leave path empty")
    return files


def run_job(cfg: JobConfig, address: str | None = None, report: bool | None = None, on_shard=None) -> RunResult:
    """Run a job to completion (resuming a run directory), reduce, and build the report; one job at a time
    per run directory (:mod:`actlake.storage.lock`). With ``model.checkpoints``, a sweep (:mod:`~actlake.jobs.extract.sweep`).

    ``on_shard(summary)`` is called in the driver after each shard commits (summary includes the
    worker's resident memory after the shard, ``worker_rss_mb``)."""
    if cfg.model.checkpoints:  # a sweep: this job once per checkpoint
        from actlake.jobs.extract.sweep import (
            run_sweep,  # actlake.jobs.extract.sweep imports this module: imported when used
        )

        return run_sweep(cfg, address, report, on_shard)
    from actlake.analysis.registry import check_table_names, enabled, logits_readers, shard_tables
    from actlake.architectures import check_model
    from actlake.model import require_accelerate

    t0 = time.perf_counter()
    import_custom_analyses(cfg)
    check_table_names(cfg)  # imports custom classes: a bad one fails here
    check_custom_views(cfg)
    analyses = [cls for cls, _ in enabled(cfg)]
    require_accelerate(cfg.model)  # before Ray: a worker without it would die at every restart
    family = check_model(cfg)  # from the model's config alone: an unsupported model is one line, before Ray
    if (readers := logits_readers(cfg)) and not family.causal:
        raise ConfigError(f"{readers} read the LM head's logits, and model {cfg.model.name_or_path} is not a causal LM")
    export_layers(cfg)  # an export of a layer the job does not store: one line, before Ray
    interventions = ()
    if cfg.interventions:  # a dim beyond the width, a layer beyond the model, means of another model: one line
        from actlake.architectures import read_model_config  # (import_custom_analyses made functions importable)
        from actlake.config import resolve_model_path
        from actlake.jobs.extract.interventions import resolve_interventions

        m = cfg.model
        config = read_model_config(resolve_model_path(m.name_or_path), m.revision, m.trust_remote_code)
        interventions = resolve_interventions(cfg, config)  # read once: run.json's identity hashes these values
    layout = RunLayout(cfg.run_dir)
    ensure_output_dir(location(cfg.output.dir))
    shards, inputs = plan_with_inputs(cfg)
    if not shards:
        raise ActlakeError("the corpus has no documents: nothing to do")
    if cfg.analyses.by_source:  # too many labels: one error before Ray, where the source column can be listed
        from actlake.analysis.by_source import check_labels

        check_labels(planned_labels(cfg, shards), cfg.analyses.max_sources)
    job = Job(cfg, layout, shards, inputs, plan_hash(cfg, shards), analyses, interventions,
              tuple(cls for cls, _ in shard_tables(cfg)))
    with run_lock(layout.root):  # from here on, one job at a time per run directory
        return _execute(job, address, report, on_shard, t0)


def _execute(job: Job, address, report, on_shard, t0) -> RunResult:
    """run_job's part under the run directory's lock: prepare it, dispatch the pending shards, reduce, report."""
    cfg, layout, shards, inputs, phash, analyses = (job.cfg, job.layout, job.shards, job.inputs, job.plan_hash,
                                                    job.analyses)
    prepare_run_dir(cfg, layout, shards, phash, inputs, job.interventions)
    remove_tree(layout.staging)  # leftovers of attempts that died mid-write
    record = committed(layout, phash)  # read once per round, and handed to the reduce step
    pending = [s for s in shards if s.shard_id not in record.shards]
    if pending:
        n_records = None if cfg.corpus.hf_streaming else sum(s.end - s.start for s in pending)  # streamed: not counted
        for cls in job.producers:
            if note := cls.plan_note(cfg, n_records):
                print(note, flush=True)
    log.info("run %s: %d shards, %d to run, %d already complete", layout.root, len(shards), len(pending), len(shards) - len(pending))
    ran: list[dict] = []
    todo = pending
    phases = {"before_dispatch": time.perf_counter() - t0, "ray_start": 0.0, "dispatch": 0.0}
    try:  # Ray started here shuts down in the background, while the statistics are reduced
        for _ in range(REDISPATCH):
            if not todo:
                break
            t1 = time.perf_counter()
            ran += _dispatch(job, todo, address or cfg.resources.address, on_shard, phases)
            phases["dispatch"] += time.perf_counter() - t1
            record = committed(layout, phash)
            todo = [s for s in shards if s.shard_id not in record.shards]  # a skipped duplicate record lost its shards
            if todo:
                log.warning("%d shard(s) not committed after dispatch (a commit record was skipped); running them "
                            "again", len(todo))
        t1 = time.perf_counter()
        totals = reduce_run(layout, [s.shard_id for s in shards], phash, analyses,
                            max_sources=cfg.analyses.max_sources, done=record)
        phases["reduce"] = time.perf_counter() - t1
    finally:
        t1 = time.perf_counter()
        ray_released()
        phases["ray_stop"] = time.perf_counter() - t1  # the part of Ray's shutdown the reduce did not hide
    wall = time.perf_counter() - t0
    tokens_run = sum(r["tokens"] for r in ran)
    totals.update(wall_seconds=wall, shards_run=len(pending), tokens_run=tokens_run,
                  tokens_per_second=tokens_run / wall if ran else None, provenance=provenance(inputs),
                  seconds=time_breakdown(phases, ran))
    if pending or not layout.summary_json.exists():
        write_json_atomic(layout.summary_json, totals)
    else:  # a rerun that ran nothing keeps the record of the run that did (its wall time, its throughput)
        log.info("run %s: every shard was already complete; summary.json keeps the run that computed them", layout.root)
    warn_about(layout, job.producers)
    run_exports(cfg, layout, address or cfg.resources.address)
    report_path = None
    if cfg.output.report if report is None else report:
        report_path = str(build_report(layout.root, analyses))
    return RunResult(str(layout.root), len(shards), len(pending), totals, wall, report_path)


def export_layers(cfg: JobConfig) -> list[int]:
    """The hidden state each ``activations.export`` entry exports (layers counted from the end resolved with the
    model's depth, read from its config); a ConfigError naming the entry whose layer the job does not store."""
    from actlake.architectures import resolve_layers

    depth = None
    if cfg.activations.export and min([*cfg.activations.layers, *(e.layer for e in cfg.activations.export)]) < 0:
        from actlake.architectures import layers_of, read_model_config

        m = cfg.model
        depth = layers_of(read_model_config(resolve_model_path(m.name_or_path), m.revision, m.trust_remote_code))
    stored = resolve_layers(cfg.activations.layers, depth) if depth is not None else cfg.activations.layers
    out = []
    for i, e in enumerate(cfg.activations.export):
        layer = resolve_layers([e.layer], depth, lambda _, i=i: f"activations.export[{i}].layer")[0] if e.layer < 0 \
            else e.layer
        if layer not in stored:
            raise ConfigError(f"activations.export[{i}].layer: hidden state {layer} is not stored (activations.layers: "
                              f"{cfg.activations.layers}{'' if depth is None else f', a model of {depth} blocks'})")
        out.append(layer)
    return out


def run_exports(cfg: JobConfig, layout: RunLayout, address: str | None) -> None:
    """``activations.export``, once every shard is committed: each entry written as ``actlake export`` writes it
    (a stopped one resumed), unless its folder is there already (kept, and said so; with a warning when its
    manifest is of other settings). A refusal names the entry."""
    from actlake.jobs.export import describe, export_saelens, export_tokens

    for i, (e, layer) in enumerate(zip(cfg.activations.export, export_layers(cfg))):
        key = f"activations.export[{i}]"
        out = location(e.dir)
        if _exported(out, e, layer, key):
            continue
        export = export_saelens if e.format == "saelens" else export_tokens
        try:
            m = export(layout.root, layer, out, address=address, **e.options())
        except ConfigError as err:
            raise ConfigError(f"{key} ({e.format} to {e.dir}): {err} (the entry's keys are those options' names)") \
                from None
        print(printable(describe(out, e.format, m)), flush=True)


def _exported(out, e, layer: int, key: str) -> bool:
    """True when ``out`` holds a finished export already (kept, and said so; a token export's manifest of other
    settings than the entry's is warned about)."""
    done = [n for n in ("manifest.json", "state.json") if (out / n).exists()] if isinstance(out, ObjectPath) \
        else (["folder"] if os.path.lexists(out) else [])
    if not done:
        return False
    log.info("%s: %s exists; kept (delete it to export again)", key, out)
    if e.format == "tokens" and (out / "manifest.json").exists():
        import json

        got = json.loads(read_regular(out / "manifest.json"))
        want = {"layer": layer, "seed": e.seed or 0, "dtype": e.dtype or "float32",
                "file_format": e.file_format or "safetensors",
                "drop_roles": sorted(e.drop_roles) if e.drop_roles is not None else ["bos"]}
        differ = [k for k, v in want.items() if (sorted(got.get(k) or []) if k == "drop_roles" else got.get(k)) != v]
        if differ:
            log.warning("%s: %s was exported with other settings (%s); it is kept: delete it to export this entry",
                        key, out, ", ".join(f"{k} {got.get(k)!r}, the entry {want[k]!r}" for k in differ))
    return True


def warn_about(layout: RunLayout, producers: list) -> None:
    """Log each producer's warnings about the finished run (:meth:`~actlake.analysis.protocol.Producer.run_notes`:
    empty first-token statistics, say)."""
    from actlake.storage.sql import open_run

    con = open_run(layout.root)
    try:
        for cls in producers:
            for note in cls.run_notes(con):
                log.warning("%s", note)
    finally:
        con.close()


def _close_workers(workers) -> None:
    """Let each live worker remove its offload folder before it is killed (a dead one's stays behind)."""
    import ray

    for w in workers:
        try:
            ray.get(w.close.remote(), timeout=120)
        except Exception as e:  # noqa: BLE001 - a worker that died cannot clean up; the job's result stands
            log.warning("a worker could not remove its offload folder: %s", e)


def worker_start(summaries: list[dict], created_at: float | None) -> float:
    """Seconds from the workers' creation to the first one's constructor (Ray placing it, its process starting,
    the worker module's imports), by the workers' clocks (0 when every worker was kept from a previous job)."""
    started = [s["started_at"] for s in summaries if s.get("started_at")]
    return max(0.0, min(started) - created_at) if started and created_at is not None else 0.0


def time_breakdown(phases: dict, ran: list[dict]) -> dict:
    """Where a job's wall time went, in seconds (``summary.json``'s ``seconds``; benchmarks/end_to_end.py prints
    it). The driver's phases: ``before_dispatch`` (checks, plan, run folder), ``ray_start`` (inside ``dispatch``),
    ``dispatch`` (Ray, the workers and every shard until the last commits), ``reduce``. The workers' time summed
    over shards: ``model_load``, ``read`` (reading and tokenising), ``compute`` (forward pass and analyses),
    ``write`` (the shard's tables), ``merge`` (its files published, its statistics merged into the open group),
    ``commit`` (commit groups; the last group's, at the flush, is not counted). ``worker_start`` (the first worker's
    start, inside ``dispatch``) and ``ray_stop`` (Ray's shutdown beyond the reduce) are the driver's."""
    total = lambda key: sum(r.get(key, 0.0) for r in ran)
    return {k: round(v, 3) for k, v in {
        **phases, "model_load": total("load_seconds"), "read": total("read_seconds"),
        "compute": total("compute_seconds"), "write": total("write_seconds"), "merge": total("merge_seconds"),
        "commit": total("commit_seconds")}.items()}


def _dispatch(job: Job, pending, address, on_shard=None, phases=None) -> list[dict]:
    """Run ``pending`` shards on fresh actors; return their summaries. Raises if any shard failed:
    one line naming the input when one of the job's inputs (fingerprints) changed meanwhile."""
    import ray

    from actlake.jobs.extract.worker import ShardWorker, Target

    cfg, layout, phash, total, inputs = job.cfg, job.layout, job.plan_hash, len(job.shards), job.inputs

    ray_released()  # a redispatch: the previous Ray's shutdown is not this one's start
    t0 = time.perf_counter()
    started = init_ray(address)
    if phases is not None:
        phases["ray_start"] += time.perf_counter() - t0
    try:
        n, cpus, gpus, threads = _worker_shape(cfg)
        files = custom_code(cfg)
        n = min(n, len(pending))
        retries = cfg.resources.max_retries
        env = store_env(local=not (address or os.environ.get("RAY_ADDRESS")))
        streamed = any(s.fmt == HF_STREAM for s in pending)  # its shards' record counts are unknown
        progress = Progress(None if streamed else sum(s.end - s.start for s in pending), len(pending),
                            skipped=total - len(pending))
        counter = job_counter()
        target = Target(cfg.to_dict(), str(layout.root), phash, counter, read_in_process(cfg, gpus))
        options = worker_options(cfg, cpus, gpus)
        key = kept_key(cfg, options, threads, env)
        workers, kept = take_kept(key, n), []
        try:  # from here on every worker held is killed or kept, whatever happens
            made_for = replace(target, counter=None)  # an actor handle is never an argument of its creation
            created_at = time.time() if n > len(workers) else None  # the breakdown's worker_start, by their clocks
            workers += [ShardWorker.options(**options).remote(made_for, threads, files, env)
                        for _ in range(n - len(workers))]
            log.info("dispatching %d shards to %d worker(s) (%g CPU, %g GPU, %s memory each)", len(pending), n, cpus,
                     gpus, f"{cfg.resources.memory_per_worker_gb:g} GiB" if cfg.resources.memory_per_worker_gb
                     else "unreserved")

            def done(summary):
                if on_shard:
                    on_shard(summary)

            def stored() -> dict:
                return {sid: dict(e["summary"], shard_id=sid) for sid, e in committed(layout, phash).shards.items()}

            events = Events(done=done, ran=progress.shard_ran, tick=lambda: progress.tick(counter.totals()),
                            committed=stored)
            dispatcher = Dispatcher(workers, retries, events, 2 if read_ahead(cfg, gpus) else 1, target=target)
            summaries, failures = dispatcher.run(pending)
            if phases is not None:
                phases["worker_start"] = phases.get("worker_start", 0.0) + worker_start(summaries, created_at)
            progress.tick(counter.totals())
            if cfg.model.offload_folder:
                _close_workers(workers)
            if not failures and not dispatcher.deaths:  # a restarted worker has used some of its restarts
                kept = keep(key, workers)
        finally:  # also when the driver fails: no worker outlives the job (or the sweep that keeps it)
            progress.close()
            for w in [w for w in workers if w not in kept]:
                ray.kill(w)
            counter.close()  # the driver's counter stays for its next job
        if failures:
            check_inputs_after_failure(layout, inputs or {}, len(failures))  # one line a failed shard
            raise dispatcher.error()
        return summaries
    finally:
        if started:
            release_ray(background=True)  # _execute waits for it after the reduce
