"""One shard's work on a loaded model: read, tokenize, batch, forward, analyse, commit."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis import capture
from actlake.analysis.attention_weights import triton_kernels_on
from actlake.analysis.device import to_device, to_host
from actlake.analysis.layer_replay import LayerReplay
from actlake.analysis.protocol import HiddenBatch, ModelSpec, enabled, products
from actlake.analysis.recorder import AttentionRecorder, ModelQK
from actlake.analysis.residual_norms import add_norms
from actlake.analysis.surprisal import token_surprisal
from actlake.batching import Window, collate, document_windows, make_batches
from actlake.categories import ROLE, TYPE8, Categorizer, one_hot
from actlake.config import JobConfig
from actlake.corpus.readers import Reject
from actlake.errors import ConfigError
from actlake.jobs.plan import Shard
from actlake.model import LoadedModel
from actlake.storage.activations import activation_table, resolve_layers, window_sampled
from actlake.storage.layout import RunLayout
from actlake.storage.shards import Group, ShardFiles

log = logging.getLogger("actlake.extract")

MAX_OOM_SPLITS = 4
"""A batch that runs out of memory is halved at most this many times (down to 1/16)."""


class Extractor:
    """Holds the model (loaded once per worker) and turns shards into committed tables."""

    def __init__(self, cfg: JobConfig, lm: LoadedModel):
        self.cfg, self.lm = cfg, lm
        self.cats = Categorizer(lm.tokenizer)
        capture.install(lm.model)
        self.mqk = ModelQK(lm.model, lm.family)
        self.inputs = capture.LayerInputs(lm.model, lm.family)  # hooks attached per batch, when needed
        self.stream = capture.HiddenStream(lm.model, lm.family)  # likewise
        self.oom_splits = 0
        self.tokenizing = threading.Lock()
        self.store_layers = resolve_layers(cfg.activations.layers, lm.model.config.num_hidden_layers)
        self.analyses = enabled(cfg.analyses)  # (class, options) per enabled analysis
        m = self.mqk
        self.triton = triton_kernels_on(cfg.analyses.triton_kernels, lm.device)
        unsafe = [c.name for c, _ in self.analyses if "attention" in c.reads and not c.graph_safe]
        if cfg.analyses.layer_graphs and unsafe:
            raise ConfigError(f"analyses.layer_graphs: true needs every attention analysis to be graph_safe; {unsafe} "
                              "are not (README: Your own analysis)")
        self.strict = lm.device.type != "cuda"
        """run_batch's default: strict checks layer by layer on a CPU, device-side counts read once per batch on a GPU."""
        self.spec = ModelSpec(m.n_layers, m.n_heads, m.n_kv_heads, lm.model.config.hidden_size,
                              cfg.tokenization.max_length, lm.device)

    # ------------------------------------------------------------------ reading
    def read_shard(self, shard: Shard):
        """Windows, documents and rejects of the shard's records. A record the tokenizer fails on is a
        ``tokenizer_error`` reject; a file whose size or mtime moved since planning, or while it was
        read, fails the shard (CorpusError naming it)."""
        from actlake.corpus.fingerprint import check_stat
        from actlake.corpus.readers import iter_range

        c = self.cfg.corpus
        windows: list[Window] = []
        docs, rejects = [], []
        if shard.size is not None:
            check_stat(shard.path, shard.size, shard.mtime_ns, "since the run planned it", shard.ctime_ns)
        items = iter_range(shard.path, shard.fmt, shard.start, shard.end, c.text_field, c.source_field, c.hf_split,
                           entry=shard.entry(), max_line=c.max_line_bytes)  # jsonl: from the entry point the plan found, not the file's start
        for item in items:
            if isinstance(item, Reject):
                rejects.append({"file": shard.path, "record": item.index, "reason": item.reason, "detail": item.detail})
                continue
            doc_id = shard.doc_offset + item.index
            try:
                with self.tokenizing:  # two shards may be read at once (read-ahead); one tokenizer call at a time
                    ws, cut = document_windows(self.lm.tokenizer, item.text, self.cfg.tokenization)
            except Exception as e:  # noqa: BLE001 - whatever the tokenizer raises on one record skips that record
                rejects.append({"file": shard.path, "record": item.index, "reason": "tokenizer_error",
                                "detail": f"{type(e).__name__}: {e}"[:200].encode("utf-8", "backslashreplace").decode()})
                continue
            if not ws:
                rejects.append({"file": shard.path, "record": item.index, "reason": "too_few_tokens", "detail": ""})
                continue
            windows += [Window(doc_id, w, ids, item.source) for w, ids in enumerate(ws)]
            docs.append({"doc_id": doc_id, "file": shard.path, "record": item.index, "source": item.source,
                         "n_chars": len(item.text), "n_windows": len(ws), "n_tokens": sum(len(x) for x in ws),
                         "cut": cut})
        if shard.size is not None:
            check_stat(shard.path, shard.size, shard.mtime_ns, "while the shard read it", shard.ctime_ns)
        return windows, docs, rejects

    # ------------------------------------------------------------------ one batch
    def new_stats(self) -> dict:
        """Fresh accumulators of every enabled analysis, on the model's device: {name: Analysis}."""
        return {cls.name: cls.create(self.spec, **options) for cls, options in self.analyses}

    def run_batch(self, batch: list[Window], strict: bool | None = None) -> "BatchResult":
        """Forward one batch and compute every enabled statistic of it on the model's device.

        ``strict`` (default :attr:`strict`: on a CPU) checks masks and inf/NaN layer by layer, reading values back from
        the device as it goes. Otherwise nothing is read back until the end, where one small read (the
        batch's only synchronisation) says whether a check failed; then the batch is run again strictly,
        which gives the exact exclusions or the error. Per-token outputs come back to pinned host memory
        without blocking, and are complete when this returns.
        """
        launched = self.launch(batch, strict)
        if launched.passed():
            return launched.result
        log.warning("a check failed on the device (mask or inf/NaN); running the batch again strictly")
        return self.run_batch(batch, strict=True)

    @torch.inference_mode()
    def launch(self, batch: list[Window], strict: bool | None = None) -> "Launched":
        """:meth:`run_batch` up to its synchronisation: on a GPU the batch's work is queued (the host may
        prepare and queue the next batch while it runs) and :meth:`Launched.passed` waits for it."""
        a = self.cfg.analyses
        strict = self.strict if strict is None else strict
        stats = self.new_stats()
        ids, mask = collate(batch, self.lm.tokenizer.pad_token_id)  # (B, T)
        role, type8 = self.cats.batch(ids.numpy(), mask.sum(1).numpy())  # (B, T) category ids, 0 on padding
        dev = self.lm.device
        attention = [x for x in stats.values() if "attention" in x.reads]
        hidden = [x for x in stats.values() if "hidden_states" in x.reads]
        with contextlib.ExitStack() as stack:
            inputs = stack.enter_context(self.inputs) if any("layer_inputs" in x.reads for x in attention) else None
            recorder = AttentionRecorder(self.mqk, mask, one_hot(role, len(ROLE), mask), [x.add_layer for x in attention],
                                         inputs=inputs, needs=products(attention), method=a.attention_weights,
                                         strict=strict, on_excluded=[x.nonfinite_excluded for x in attention
                                                                     if hasattr(x, "nonfinite_excluded")],
                                         triton=self.triton,
                                         replay=LayerReplay(attention) if a.layer_graphs and not strict and attention else None)
            if attention:
                stack.enter_context(capture.recording(recorder))
            sink = None
            if a.residual_norms or hidden or self.store_layers:  # else no hidden state is looked at
                sink = HiddenSink(self, batch, HiddenBatch(mask, role, type8, strict, self.triton), hidden)
                stack.enter_context(self.stream(sink))
            out = self.lm.model(input_ids=to_device(ids, dev), attention_mask=to_device(mask, dev),
                                use_cache=False)  # causal models would keep every layer's keys and values
            if sink is not None:
                self.stream.last(out.last_hidden_state)
        result = BatchResult(batch, ids, mask, role, type8, stats)
        if sink is not None:
            result.norms, result.acts = to_host(sink.norms) if a.residual_norms else None, sink.acts
        if self.lm.lm_head is not None:
            result.surprisal = to_host(token_surprisal(self.lm.lm_head, out.last_hidden_state, ids, mask))
        checks = [] if strict else recorder.problems() + [t for x in stats.values() for t in x.problems()]
        # the recorder (its layer graph, the buffers replays read) lives until the batch is waited for
        return Launched(batch, result, _DeviceChecks(dev, checks, sink.devices if sink is not None else set()), recorder)

    # ------------------------------------------------------------------ one shard
    def process(self, shard: Shard, layout: RunLayout, group: Group, compute_lock=None) -> dict:
        """Run one shard: its tables go into their tables (not yet committed), its statistics into ``group``,
        which the caller commits (:mod:`actlake.storage.shards`). Returns the shard's summary.

        ``compute_lock`` is held only while the model runs: a worker running two shards at once (reading
        ahead, ``resources.read_ahead``) reads and tokenises one, and writes the other's tables, while the
        model runs the third. Batches are queued one ahead (:meth:`launch`): on a GPU the host prepares
        batch k+1 while the device runs batch k, and collects batch k's results while it runs k+1."""
        t0 = time.perf_counter()
        windows, docs, rejects = self.read_shard(shard)
        read_s = time.perf_counter() - t0
        with compute_lock or contextlib.nullcontext():
            t1 = time.perf_counter()
            batches = make_batches(windows, self.cfg.batching)
            acc = ShardResults(self.cfg.analyses, self.new_stats(), self.cats, self.cfg.activations)
            splits_before = self.oom_splits
            pending = None  # the batch queued before this one: its results are read once this one is queued
            for batch in batches:
                for launched in self._split_on_oom(self.launch, batch):
                    if pending is not None:
                        self._collect(pending, acc)
                    pending = launched
            if pending is not None:
                self._collect(pending, acc)
            splits = self.oom_splits - splits_before
            compute_s = time.perf_counter() - t1
        files = ShardFiles(layout, shard.shard_id)
        try:
            acc.write(files, docs, rejects)
            summary = {"docs": len(docs), "windows": len(windows), "tokens": acc.n_tokens, "padded_tokens": acc.n_padded,
                       "batches": len(batches), "oom_splits": splits,
                       "dtype": str(self.lm.dtype).removeprefix("torch."),
                       "cut_docs": sum(d["cut"] for d in docs),
                       "rejects": dict(Counter(r["reason"] for r in rejects)), "seconds": time.perf_counter() - t0,
                       "read_seconds": read_s, "compute_seconds": compute_s}
            group.add(shard.shard_id, files.publish(), summary, acc.stats)
        except BaseException:
            files.abort()
            raise
        return summary

    def _collect(self, launched: "Launched", acc: "ShardResults") -> None:
        """Wait for a queued batch and add its results; a failed device check runs it again strictly."""
        if launched.passed():
            acc.add(launched.result)
            return
        log.warning("a check failed on the device (mask or inf/NaN); running the batch again strictly")
        for result in self.run_batch_resilient(launched.batch, strict=True):
            acc.add(result)

    def run_batch_resilient(self, batch: list[Window], strict: bool | None = None):
        """:meth:`run_batch`, halving the batch on out-of-memory (see :meth:`_split_on_oom`). Yields
        :class:`BatchResult`."""
        return self._split_on_oom(lambda b: self.run_batch(b, strict), batch)

    def _split_on_oom(self, run, batch: list[Window], depth: int = 0):
        """``run(batch)``; on out-of-memory, split the batch in halves and retry (at most MAX_OOM_SPLITS deep).

        Each attempt accumulates into fresh statistics, handed back only when it succeeded, so a
        failed attempt leaves nothing behind. Yields what ``run`` returns, per part.
        """
        try:
            result = run(batch)
        except RuntimeError as e:  # torch.OutOfMemoryError is one; other backends only say so in the text
            if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)):
                raise
            if len(batch) == 1 or depth >= MAX_OOM_SPLITS:
                raise
            del e
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.oom_splits += 1
            log.warning("out of memory on a batch of %d windows; splitting it in two", len(batch))
            half = len(batch) // 2
            yield from self._split_on_oom(run, batch[:half], depth + 1)
            yield from self._split_on_oom(run, batch[half:], depth + 1)
            return
        yield result


class HiddenSink:
    """What one batch does with each hidden state as the model produces it (:class:`~actlake.analysis.capture.HiddenStream`):
    residual norms into one (B, T, L+1) float64 device buffer, every ``hidden_states`` analysis, and the
    sampled windows' rows of the stored layers, copied to pinned host memory without blocking."""

    def __init__(self, ex: Extractor, batch: list[Window], hb: HiddenBatch, analyses: list):
        self.hb, self.analyses, self.n_hidden = hb, analyses, ex.stream.n_layers + 1
        self.with_norms, self.store = ex.cfg.analyses.residual_norms, ex.store_layers
        self.keep = [i for i, w in enumerate(batch)
                     if self.store and window_sampled(ex.cfg.activations, w.doc_id, w.window)]
        self.rows = torch.tensor(self.keep, dtype=torch.long)
        self.norms: torch.Tensor | None = None
        self.acts: dict = {}
        self.devices: set = set()

    def __call__(self, layer: int, h: torch.Tensor) -> None:
        self.devices.add(h.device)
        if self.with_norms:
            self.norms = add_norms(self.norms, layer, h, self.n_hidden)
        for x in self.analyses:
            x.add_hidden(layer, h, self.hb)
        if layer in self.store:
            self.acts[layer] = (self.keep, to_host(h[to_device(self.rows, h.device)]))


class _DeviceChecks:
    """A queued batch's device-side checks and the point after which its host copies are complete.

    One CUDA device: the checks are summed into one pinned host value and an event is recorded behind
    them, when the batch is queued; :meth:`failed` waits for that event only (the batch's only
    synchronisation), so work queued after it (the next batch) goes on. Several devices: every device in
    use is synchronised. On a CPU there is nothing to wait for."""

    def __init__(self, dev: torch.device, checks: list, hidden_devices: set):
        self.checks, self.event, self.flag = checks, None, None
        self.devices = {d for d in {dev} | hidden_devices | {t.device for t in checks} if d.type == "cuda"}
        if len(self.devices) == 1:
            (cuda,) = self.devices
            if checks:
                self.flag = to_host(torch.stack([t.sum().to(torch.float64) for t in checks]).sum())
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(cuda))

    def failed(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
            return self.flag is not None and bool(self.flag)
        for d in self.devices:
            torch.cuda.synchronize(d)
        return any(bool(t.sum()) for t in self.checks)


@dataclass
class Launched:
    """A batch queued on the device by :meth:`Extractor.launch`."""

    batch: list[Window]
    result: "BatchResult"
    """Complete only once :meth:`passed` returned (its host copies may still be in flight before)."""
    checks: _DeviceChecks
    recorder: AttentionRecorder | None = None
    """Kept until the batch is waited for: a recorded layer graph and its buffers stay alive while queued."""

    def passed(self) -> bool:
        """Wait for the batch; False when a device-side check counted a problem (run it again strictly)."""
        return not self.checks.failed()


@dataclass
class BatchResult:
    """One batch's outputs. Per-token values are (B, T, ...) host tensors (padding included; ``mask``
    says which tokens are real); the analyses' statistics stay on the model's device."""

    batch: list[Window]
    ids: torch.Tensor
    """(B, T) the host's right-padded token ids."""
    mask: torch.Tensor
    """(B, T) 1 for real tokens (the host's)."""
    role: torch.Tensor
    """(B, T) int64 ``ROLE`` ids of the tokens (0 on padding)."""
    type8: torch.Tensor
    """(B, T) int64 ``TYPE8`` ids (0 on padding)."""
    stats: dict
    """{name: Analysis} accumulated over this batch."""
    norms: torch.Tensor | None = None
    """(B, T, L+1) float64 residual norms."""
    surprisal: torch.Tensor | None = None
    """(B, T) float32, NaN where undefined."""
    acts: dict = field(default_factory=dict)
    """Stored layers: {layer: (rows of the batch sampled, (n, T, d) hidden states of those rows)}."""


class ShardResults:
    """Everything one shard produces, accumulated batch by batch, then written as tables."""

    def __init__(self, analyses, stats: dict, cats: Categorizer, activations=None):
        self.a, self.stats, self.cats, self.act_cfg = analyses, stats, cats, activations
        self.token_cols: list[dict] = []  # per batch, the tokens table's columns as arrays (a table in write())
        self.norm_rows: list = []
        self.act_rows: list = []
        self.n_tokens = self.n_padded = 0

    def add(self, r: "BatchResult") -> None:
        """Take one batch's results (host tensors complete, statistics on the device). Per-token columns are
        gathered as whole arrays (the windows are right-padded: ``r.mask`` is a prefix per row), and turned
        into a table in :meth:`write`, outside the compute lock."""
        batch = r.batch
        lengths = np.fromiter((len(w.ids) for w in batch), np.int64, len(batch))
        n = int(lengths.sum())
        self.n_tokens += n
        self.n_padded += len(batch) * int(lengths.max()) - n
        for name, part in r.stats.items():
            self.stats[name] = self.stats[name].merge(part)
        valid = r.mask.bool().numpy()  # (B, T): tokens in (batch, position) order, as the keys below
        keys = (np.repeat([w.doc_id for w in batch], lengths), np.repeat([w.window for w in batch], lengths),
                np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths))  # doc_id, window, position (n,)
        surprisal = r.surprisal.numpy() if r.surprisal is not None else None
        if self.a.tokens:
            self.token_cols.append({
                "doc_id": keys[0], "window_index": keys[1], "position": keys[2], "token_id": r.ids.numpy()[valid],
                "role": r.role.numpy()[valid], "type8": r.type8.numpy()[valid],
                "sources": [w.source for w in batch], "lengths": lengths,
                "surprisal": None if surprisal is None else surprisal[valid]})
        if r.acts:
            keep = next(iter(r.acts.values()))[0]  # the sampled rows, the same for every stored layer
            for j, i in enumerate(keep):
                w, T = batch[i], len(batch[i].ids)
                s = [None] * T if surprisal is None else [None if v != v else v for v in surprisal[i, :T].tolist()]
                self.act_rows.append((w, self.cats.texts(w.ids), r.type8[i, :T].tolist(), s,
                                      {lay: hs[j][:T] for lay, (_, hs) in r.acts.items()}))
        if r.norms is not None:
            self.norm_rows.append((np.stack(keys, 1), r.norms.numpy()[valid]))

    def write(self, writer, docs, rejects) -> None:
        writer.write("documents", pa.Table.from_pylist(docs, schema=DOCUMENTS_SCHEMA))
        writer.write("rejects", pa.Table.from_pylist(rejects, schema=REJECTS_SCHEMA))
        if self.a.tokens:
            writer.write("tokens", self._token_table())
        if self.a.residual_norms:
            writer.write("residual_norms", _norm_table(self.norm_rows))
        if self.act_cfg is not None and self.act_cfg.layers:
            writer.write("activations", activation_table(self.act_rows, self.act_cfg.dtype))

    def _token_table(self) -> pa.Table:
        """The shard's ``tokens`` rows from the batches' columns; category names from their ids, token texts
        from the categorizer's table, surprisal NaN (no context) or absent (no LM head) as null."""
        if not self.token_cols:
            return TOKENS_SCHEMA.empty_table()
        arrays = ("doc_id", "window_index", "position", "token_id", "role", "type8", "lengths")
        col = {k: np.concatenate([c[k] for c in self.token_cols]) for k in arrays}
        sources = [s for c in self.token_cols for s in c["sources"]]  # per window
        parts = [c["surprisal"] for c in self.token_cols]
        surprisal = None if parts[0] is None else np.concatenate(parts)
        n = len(col["token_id"])

        def names(ids: np.ndarray, values) -> pa.Array:  # ids: indices into values, per token
            return pa.DictionaryArray.from_arrays(pa.array(ids.astype(np.int32)), pa.array(values, pa.string())).dictionary_decode()

        return pa.table({
            "doc_id": pa.array(col["doc_id"], pa.int64()),
            "window_index": pa.array(col["window_index"], pa.int32()),
            "position": pa.array(col["position"], pa.int32()),
            "token_id": pa.array(col["token_id"], pa.int32()),
            "token": self.cats.text_array(col["token_id"]),
            "role": names(col["role"], ROLE),
            "type8": names(col["type8"], TYPE8),
            "source": names(np.repeat(np.arange(len(sources)), col["lengths"]), sources),
            "surprisal": (pa.nulls(n, pa.float32()) if surprisal is None
                          else pa.array(surprisal, pa.float32(), mask=np.isnan(surprisal))),
        }, schema=TOKENS_SCHEMA)


def _norm_table(norm_rows) -> pa.Table:
    if not norm_rows:
        return NORMS_SCHEMA.empty_table()
    keys = np.concatenate([k for k, _ in norm_rows])  # (N, 3)
    norms = np.concatenate([n for _, n in norm_rows])  # (N, L+1)
    L1 = norms.shape[1]
    return pa.table({
        "doc_id": pa.array(np.repeat(keys[:, 0], L1), pa.int64()),
        "window_index": pa.array(np.repeat(keys[:, 1], L1), pa.int32()),
        "position": pa.array(np.repeat(keys[:, 2], L1), pa.int32()),
        "layer": pa.array(np.tile(np.arange(L1), len(keys)), pa.int16()),
        "norm": pa.array(norms.ravel(), pa.float64()),
    }, schema=NORMS_SCHEMA)


TOKENS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                           ("token_id", pa.int32()), ("token", pa.string()), ("role", pa.string()),
                           ("type8", pa.string()), ("source", pa.string()), ("surprisal", pa.float32())])
NORMS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                          ("layer", pa.int16()), ("norm", pa.float64())])
DOCUMENTS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("file", pa.string()), ("record", pa.int64()),
                              ("source", pa.string()), ("n_chars", pa.int64()), ("n_windows", pa.int32()),
                              ("n_tokens", pa.int64()), ("cut", pa.bool_())])
REJECTS_SCHEMA = pa.schema([("file", pa.string()), ("record", pa.int64()), ("reason", pa.string()),
                            ("detail", pa.string())])
