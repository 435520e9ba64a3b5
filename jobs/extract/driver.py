"""One shard's work on a loaded model, in stages: read -> batch -> forward with the producers -> write.

Every table comes from a producer (:mod:`actlake.analysis.protocol`): the analyses' mergeable statistics,
committed in the shard's group, and the shard tables (tokens, residual norms, activations, documents,
rejects, and custom ones), written with the shard. This module owns only the order of the stages, the
batches' queue on the device, and what happens when a batch runs out of memory or fails a device check.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter

import torch

from actlake.analysis.by_source import BySource, check_labels
from actlake.analysis.engine import capture
from actlake.analysis.engine.attention_weights import triton_kernels_on
from actlake.analysis.engine.device import to_device, to_host
from actlake.analysis.engine.layer_replay import LayerReplay
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
from actlake.analysis.engine.selfcheck import SelfCheck
from actlake.analysis.protocol import BatchOutputs, HiddenBatch, ModelSpec
from actlake.analysis.registry import custom_views, enabled, producer_views, products, shard_tables
from actlake.analysis.surprisal import token_surprisal
from actlake.batching import Window, collate, make_batches
from actlake.categories import ROLE, Categorizer, one_hot
from actlake.config import JobConfig
from actlake.errors import ActlakeError, AnalysisError, ConfigError
from actlake.jobs.extract.batch import BatchResult, DeviceChecks, HiddenSink, Launched
from actlake.jobs.extract.plan import Shard
from actlake.jobs.extract.read import read_shard
from actlake.model import LoadedModel
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
        self.mqk = m = ModelQK(lm.model, lm.family)
        self.inputs = capture.LayerInputs(lm.model, lm.family)  # hooks attached per batch, when needed
        self.stream = capture.HiddenStream(lm.model, lm.family)  # likewise
        self.oom_splits = 0
        self.checked = False
        """Whether the first batch's self-check (:mod:`~actlake.analysis.engine.selfcheck`) has passed."""
        self.tokenizing = threading.Lock()
        self.reader = None
        """A :class:`~actlake.jobs.extract.read.ReaderProcess` that reads shards instead of this process, or None."""
        self.analyses = enabled(cfg)  # (class, options) per enabled analysis
        tables = shard_tables(cfg)
        self.producers = [c for c, _ in self.analyses + tables]
        self.reading = [(c, o) for c, o in tables if c.of_reading]  # documents, rejects
        self.token_tables = [(c, o) for c, o in tables if not c.of_reading]  # made batch by batch
        self.views_to_check = [c for c in self.producers if getattr(c, "views", None)] if custom_views(self.producers) else []
        """Every producer's views, while a custom one declares views none has run: they run over the first shard."""
        self.triton = triton_kernels_on(cfg.analyses.triton_kernels, lm.device)
        unsafe = [c.name for c, _ in self.analyses + tables if "attention" in c.sites and not c.graph_safe]
        self.layer_graphs = layer_graphs_on(cfg.analyses.layer_graphs, lm.device, unsafe)
        self.strict = lm.device.type != "cuda"
        """run_batch's default: strict checks layer by layer on a CPU, device-side counts read once per batch on a GPU."""
        self.spec = ModelSpec(m.n_layers, m.n_heads, m.n_kv_heads, lm.model.config.hidden_size,
                              cfg.tokenization.max_length, lm.device)

    def read_shard(self, shard: Shard):
        """The reading stage (:func:`~actlake.jobs.extract.read.read_shard`, here or in :attr:`reader`): windows,
        documents, rejects."""
        if self.reader is not None:
            return self.reader.read(shard)
        return read_shard(shard, self.cfg, self.lm.tokenizer, self.tokenizing)

    def new_stats(self) -> dict:
        """Fresh accumulators of every enabled analysis, on the model's device: {name: Analysis}."""
        return {cls.name: cls.create(self.spec, **options) for cls, options in self.analyses}

    def shard_results(self, on_batch=None, docs_per_window: float = 0.0) -> "ShardResults":
        """An empty :class:`ShardResults` for a shard (or for texts, try-analysis): statistics by source label
        (:mod:`~actlake.analysis.by_source`), one label ``'*'`` without ``analyses.by_source``."""
        a = self.cfg.analyses
        stats = {name: BySource(zero, a.by_source, a.max_sources) for name, zero in self.new_stats().items()}
        return ShardResults(stats, on_batch, docs_per_window)

    # ------------------------------------------------------------------ one batch
    def run_batch(self, batch: list[Window], strict: bool | None = None) -> BatchResult:
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

    def launch(self, batch: list[Window], strict: bool | None = None) -> Launched:
        """:meth:`_launch`; on the first batch of a discovered family (:mod:`actlake.discovery`), an error of the
        engine's is the layout not fitting the model: an AnalysisError that says so and ends the job."""
        if self.checked or not self.lm.family.name.startswith("discovered:"):
            return self._launch(batch, strict)
        try:
            return self._launch(batch, strict)
        except (ActlakeError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the engine met in a layout it only guessed
            raise AnalysisError(f"model_type {self.lm.model.config.model_type!r} has no declaration, and the layout "
                                f"read off its modules does not fit it ({type(e).__name__}: {str(e)[:200]}); it needs "
                                "a declaration in actlake/architectures.py") from None

    @torch.inference_mode()
    def _launch(self, batch: list[Window], strict: bool | None = None) -> Launched:
        """:meth:`run_batch` up to its synchronisation: on a GPU the batch's work is queued (the host may
        prepare and queue the next batch while it runs) and :meth:`Launched.passed` waits for it."""
        a = self.cfg.analyses
        strict = self.strict if strict is None else strict
        strict = strict or (not self.checked and self.cfg.analyses.self_check)  # the self-checked batch: layer by layer
        stats = self.new_stats()
        parts = {cls.tables[0]: cls.create(self.spec, **options) for cls, options in self.token_tables}
        ids, mask = collate(batch, self.lm.tokenizer.pad_token_id)  # (B, T)
        role, type8 = self.cats.batch(ids.numpy(), mask.sum(1).numpy())  # (B, T) category ids, 0 on padding
        dev = self.lm.device
        producers = list(stats.values()) + list(parts.values())
        attention = [x for x in producers if "attention" in x.sites]
        sink = HiddenSink([x for x in producers if "hidden_states" in x.sites],
                          HiddenBatch(mask, role, type8, strict, self.triton, batch))
        with contextlib.ExitStack() as stack:
            inputs = stack.enter_context(self.inputs) if any("layer_inputs" in x.sites for x in attention) else None
            recorder = AttentionRecorder(self.mqk, mask, one_hot(role, len(ROLE), mask), [x.add_layer for x in attention],
                                         inputs=inputs, needs=products(attention), method=a.attention_weights,
                                         strict=strict, on_excluded=[x.nonfinite_excluded for x in attention],
                                         triton=self.triton,
                                         replay=LayerReplay(attention) if self.layer_graphs and not strict and attention else None)
            check = self._self_check(attention)
            recorder.check = check
            if attention:
                stack.enter_context(capture.recording(recorder))
            if sink.readers:  # else no hidden state is looked at
                stack.enter_context(self.stream(sink))
            out = self.lm.model(input_ids=to_device(ids, dev), attention_mask=to_device(mask, dev),
                                use_cache=False)  # causal models would keep every layer's keys and values
            if sink.readers:
                self.stream.last(out.last_hidden_state)
        surprisal = None
        if self.lm.lm_head is not None:
            surprisal = to_host(token_surprisal(self.lm.lm_head, out.last_hidden_state, ids, mask,
                                                transform=self.lm.logit_transform))
        if check is not None:
            self._finish_check(check, recorder, surprisal, ids, mask)
        result = BatchResult(BatchOutputs(batch, ids, mask, role, type8, self.cats, surprisal), stats, parts)
        checks = [] if strict else recorder.problems() + [t for x in producers for t in x.problems()]
        # the recorder (its layer graph, the buffers replays read) lives until the batch is waited for
        return Launched(batch, result, DeviceChecks(dev, checks, sink.devices), recorder)

    def _self_check(self, attention: list):
        """A :class:`SelfCheck` for this worker's first batch (``analyses.self_check``), else None."""
        if self.checked or not self.cfg.analyses.self_check:
            return None
        names = [x.name for x in attention]
        hidden = [c.name for c in self.producers if "hidden_states" in c.sites]
        return SelfCheck(self.lm.dtype, names, [x.name for x in attention if "layer_inputs" in x.sites], hidden)

    def _finish_check(self, check, recorder, surprisal, ids, mask) -> None:
        """The first batch's self-check: every attention layer recorded, surprisal against the model's own logits
        (its full forward pass on the batch's first sequence); raises AnalysisError naming what failed."""
        if check.attention:
            check.layers(self.mqk.n_layers, recorder.seen)
        if check.hidden or surprisal is not None:  # the model's own pass on the first sequence, the hooks on
            n = int(mask[0].sum())
            hooked: dict = {}
            model = self.lm.causal_lm if surprisal is not None and self.lm.causal_lm is not None else self.lm.model
            with self.stream(lambda layer, h: hooked.__setitem__(layer, h[0])):
                out = model(input_ids=to_device(ids[:1, :n], self.lm.device), output_hidden_states=True, use_cache=False)
                self.stream.last(getattr(out, "last_hidden_state", None) if model is self.lm.model else out.hidden_states[-1])
            check.hidden_states(hooked, out.hidden_states)
            if model is self.lm.causal_lm:
                check.surprisal(surprisal[0, :n], out.logits[0], ids[0, :n], mask[0, :n])
        check.raise_if_failed(self.lm.model.config.model_type)
        self.checked = True

    # ------------------------------------------------------------------ one shard
    def process(self, shard: Shard, layout: RunLayout, group: Group, compute_lock=None, on_batch=None) -> dict:
        """Run one shard: its tables go into their tables (not yet committed), its statistics into ``group``,
        which the caller commits (:mod:`actlake.storage.shards`). Returns the shard's summary.

        ``compute_lock`` is held only while the model runs: a worker running two shards at once (reading
        ahead, ``resources.read_ahead``) reads and tokenises one, and writes the other's tables, while the
        model runs the third. Batches are queued one ahead (:meth:`launch`): on a GPU the host prepares
        batch k+1 while the device runs batch k, and collects batch k's results while it runs k+1.
        ``on_batch(documents, tokens)`` is told of every finished batch (documents: the batch's share of the
        shard's, by windows), for progress."""
        t0 = time.perf_counter()
        windows, docs, rejects = self.read_shard(shard)
        read_s = time.perf_counter() - t0
        if self.cfg.analyses.by_source:  # before any compute: too many labels is a setting the corpus breaks
            check_labels({w.source for w in windows}, self.cfg.analyses.max_sources)
        with compute_lock or contextlib.nullcontext():
            t1 = time.perf_counter()
            batches = make_batches(windows, self.cfg.batching, self.cfg.analyses.by_source)
            acc = self.shard_results(on_batch, len(docs) / max(len(windows), 1))
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
            written = self.write_tables(files, acc, docs, rejects)
            if self.views_to_check:  # a custom view that does not run stops the job at its first shard, not at reduce
                reduced = {t: table for s in acc.stats.values() for t, table in s.to_tables(with_total=True).items()}
                producer_views(self.views_to_check, reduced | written)
                self.views_to_check = []
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

    def write_tables(self, files, acc: "ShardResults", docs: list, rejects: list) -> dict:
        """The shard tables of a shard's reading and batches, through ``files.write(table, arrow_table)``;
        returns them by name."""
        out = {}
        for cls, options in self.reading:
            part = cls.create(self.spec, **options)
            part.collect_read(docs, rejects)
            out[cls.tables[0]] = cls.to_table([part], **options)
        for cls, options in self.token_tables:
            out[cls.tables[0]] = cls.to_table(acc.parts.get(cls.tables[0], []), **options)
        for name, table in out.items():
            files.write(name, table)
        return out

    def _collect(self, launched: Launched, acc: "ShardResults") -> None:
        """Wait for a queued batch and add its results; a failed device check runs it again strictly."""
        if launched.passed():
            acc.add(launched.result)
            return
        log.warning("a check failed on the device (mask or inf/NaN); running the batch again strictly")
        for result in self.run_batch_resilient(launched.batch, strict=True):
            acc.add(result)

    def run_batch_resilient(self, batch: list[Window], strict: bool | None = None):
        """:meth:`run_batch`, halving the batch on out-of-memory (see :meth:`_split_on_oom`). Yields
        :class:`~actlake.jobs.extract.batch.BatchResult`."""
        return self._split_on_oom(lambda b: self.run_batch(b, strict), batch)

    def _split_on_oom(self, run, batch: list[Window], depth: int = 0):
        """``run(batch)``; on out-of-memory, split the batch in halves and retry (at most MAX_OOM_SPLITS deep).

        Each attempt accumulates into fresh producers, handed back only when it succeeded, so a
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


def layer_graphs_on(setting: bool | None, device: torch.device, unsafe: list[str]) -> bool:
    """``analyses.layer_graphs`` resolved for a worker's device: null is on for CUDA workers when no enabled
    attention analysis is unsafe (``unsafe``: the names of those not declared graph_safe), off otherwise."""
    if setting and unsafe:
        raise ConfigError(f"analyses.layer_graphs: true needs every attention analysis to be graph_safe; {unsafe} "
                          "are not (docs: Writing an analysis)")
    if setting is not None:
        return setting
    if device.type != "cuda":
        return False
    if unsafe:
        log.info("analyses.layer_graphs off: %s not declared graph_safe", unsafe)
        return False
    return True


class ShardResults:
    """A shard's finished batches: the analyses' statistics merged, the token tables' parts kept for writing."""

    def __init__(self, stats: dict, on_batch=None, docs_per_window: float = 0.0):
        self.stats = stats  # {name: BySource}
        self.parts: dict[str, list] = {}
        self.n_tokens = self.n_padded = 0
        self.on_batch, self.docs_per_window = on_batch, docs_per_window

    def add(self, r: BatchResult) -> None:
        """Take one finished batch (host copies complete, statistics on the device). Token tables gather host
        arrays only; their tables are built when the shard is written, outside the compute lock."""
        lengths = [len(w.ids) for w in r.batch]
        self.n_tokens += sum(lengths)
        self.n_padded += len(lengths) * max(lengths) - sum(lengths)
        for name, part in r.stats.items():
            acc = self.stats[name]
            acc.add(acc.label_of(r.batch), part)
        for table, part in r.parts.items():
            part.collect(r.outputs)
            self.parts.setdefault(table, []).append(part)
        if self.on_batch is not None:
            self.on_batch(len(lengths) * self.docs_per_window, sum(lengths))
