"""One shard's work on a loaded model, in stages: read -> batch -> forward with the producers -> write.

Every table comes from a producer (:mod:`actlake.analysis.protocol`): the analyses' mergeable statistics,
committed in the shard's group, and the shard tables (tokens, residual norms, activations, documents,
rejects, and custom ones), written with the shard, which read the per-token values (surprisal). This module
owns the order of the stages; the forward pass (the batches' queue on the device, out-of-memory splits, device
checks) is the engine's (:mod:`actlake.analysis.engine.forward`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import numpy as np

from actlake.analysis.by_source import BySource, check_labels
from actlake.analysis.engine.batch import BatchResult
from actlake.analysis.engine.forward import ForwardPass
from actlake.analysis.intervention_effects import InterventionEffects
from actlake.analysis.registry import custom_views, enabled, producer_views, shard_tables, token_values
from actlake.batching import make_batches
from actlake.config import JobConfig
from actlake.jobs.extract.interventions import resolve_interventions
from actlake.jobs.extract.plan import Shard
from actlake.jobs.extract.read import read_shard
from actlake.model import LoadedModel
from actlake.storage.layout import RunLayout
from actlake.storage.shards import ShardFiles
from actlake.tables import CLEAN


class Extractor:
    """Holds the model (loaded once per worker, in :attr:`forward`) and turns shards into committed tables."""

    def __init__(self, cfg: JobConfig, lm: LoadedModel):
        self.cfg, self.lm = cfg, lm
        self.tokenizing = threading.Lock()
        self.reader = None
        """A :class:`~actlake.jobs.extract.read.ReaderProcess` that reads shards instead of this process, or None."""
        tables = shard_tables(cfg)
        self.reading = [(c, o) for c, o in tables if c.of_reading]  # documents, rejects
        self.token_tables = [(c, o) for c, o in tables if not c.of_reading]  # made batch by batch
        self.interventions = resolve_interventions(cfg, lm.model.config)
        passes = [(c, o) for c, o in enabled(cfg) if c is not InterventionEffects]  # it reads the passes' sums
        values = token_values(cfg, lm.lm_head is not None)  # surprisal: where the model has its LM head
        self.forward = ForwardPass(cfg, lm, passes, self.token_tables, self.interventions, values)
        self.producers = self.forward.producers + [c for c, _ in self.reading]
        self.views_to_check = [c for c in self.producers if getattr(c, "views", None)] if custom_views(self.producers) else []
        """Every producer's views, while a custom one declares views none has run: they run over the first shard."""

    def read_shard(self, shard: Shard):
        """The reading stage (:func:`~actlake.jobs.extract.read.read_shard`, here or in :attr:`reader`): windows,
        documents, rejects."""
        if self.reader is not None:
            return self.reader.read(shard)
        return read_shard(shard, self.cfg, self.lm.tokenizer, self.tokenizing)

    def shard_results(self, on_batch=None, docs_per_window: float = 0.0) -> ShardResults:
        """An empty :class:`ShardResults` for a shard (or for texts, try-analysis): statistics by source label
        (:mod:`~actlake.analysis.by_source`), one label ``'*'`` without ``analyses.by_source``."""
        a = self.cfg.analyses
        stats = {name: BySource(zero, a.by_source, a.max_sources, interventions=bool(self.cfg.interventions))
                 for name, zero in self.forward.new_stats().items()}
        effects = None
        if self.interventions:
            effects = InterventionEffects.create(self.forward.spec, self.lm.lm_head is not None,
                                                 tuple(iv.name for iv in self.interventions))
            stats[effects.name] = BySource(effects, a.by_source, a.max_sources)
        return ShardResults(stats, on_batch, docs_per_window, effects)

    def process(self, shard: Shard, layout: RunLayout, group, compute_lock=None, on_batch=None) -> dict:
        """Run one shard: its tables go into their tables (not yet committed), its statistics into ``group``,
        which the caller commits (:mod:`actlake.storage.shards`). Returns the shard's summary.

        ``compute_lock`` is held only while the model runs: a worker running two shards at once (reading
        ahead, ``resources.read_ahead``) reads and tokenises one, and writes the other's tables, while the
        model runs the third. Batches are queued one ahead (:meth:`ForwardPass.run`).
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
            splits_before = self.forward.oom_splits
            for result in self.forward.run(batches):
                acc.add(result)
            acc.finish()
            splits = self.forward.oom_splits - splits_before
            compute_s = time.perf_counter() - t1
        files = ShardFiles(layout, shard.shard_id)
        try:
            t2 = time.perf_counter()
            written = self.write_tables(files, acc, docs, rejects)
            write_s = time.perf_counter() - t2
            if self.views_to_check:  # a custom view that does not run stops the job at its first shard, not at reduce
                reduced = {t: table for s in acc.stats.values() for t, table in s.to_tables(with_total=True).items()}
                producer_views(self.views_to_check, reduced | written)
                self.views_to_check = []
            summary = {"docs": len(docs), "windows": len(windows), "tokens": acc.n_tokens, "padded_tokens": acc.n_padded,
                       "batches": len(batches), "oom_splits": splits,
                       "dtype": str(self.lm.dtype).removeprefix("torch."),
                       "cut_docs": sum(d["cut"] for d in docs),
                       "rejects": dict(Counter(r["reason"] for r in rejects)), "seconds": time.perf_counter() - t0,
                       "read_seconds": read_s, "compute_seconds": compute_s, "write_seconds": write_s}
            if self.forward.spec.hybrid:
                summary["attention_layers"] = list(self.forward.spec.attention_layers)
            t3 = time.perf_counter()
            group.add(shard.shard_id, files.publish(), dict(summary), acc.stats)  # the record's copy, as it is now
            summary["merge_seconds"] = time.perf_counter() - t3  # publishing its files, merging into the open group
        except BaseException:
            files.abort()
            raise
        return summary

    def write_tables(self, files, acc: ShardResults, docs: list, rejects: list) -> dict:
        """The shard tables of a shard's reading and batches, through ``files.write(table, arrow_table)``;
        returns them by name."""
        out = {}
        for cls, options in self.reading:
            part = cls.create(self.forward.spec, **options)
            part.collect_read(docs, rejects)
            out[cls.tables[0]] = cls.to_table([part], **options)
        for cls, options in self.token_tables:
            out[cls.tables[0]] = cls.to_table(acc.parts.get(cls.tables[0], []), **options)
        for name, table in out.items():
            files.write(name, table)
        return out

class ShardResults:
    """A shard's finished batches: the analyses' statistics merged, the token tables' parts kept for writing."""

    def __init__(self, stats: dict, on_batch=None, docs_per_window: float = 0.0, effects=None):
        self.stats = stats  # {name: BySource}
        self.effects = effects
        """With interventions: the empty :class:`~actlake.analysis.intervention_effects.InterventionEffects`;
        :meth:`finish` fills ``stats[effects.name]`` from the windows' sums gathered in :attr:`sums`."""
        self.sums: dict[str, list] = {}  # pass -> [(sums, counts)] per batch
        self.windows: list = []
        self.parts: dict[str, list] = {}
        self.n_tokens = self.n_padded = 0
        self.on_batch, self.docs_per_window = on_batch, docs_per_window

    def add(self, r: BatchResult) -> None:
        """Take one finished batch (host copies complete, statistics on the device). Token tables gather host
        arrays only; their tables are built when the shard is written, outside the compute lock."""
        lengths = [len(w.ids) for w in r.batch]
        self.n_tokens += sum(lengths)
        self.n_padded += len(lengths) * max(lengths) - sum(lengths)
        for iv, stats in [(CLEAN, r.stats), *r.edited.items()]:
            for name, part in stats.items():
                acc = self.stats[name]
                acc.add(acc.label_of(r.batch), part, iv)
        for table, part in r.parts.items():
            part.collect(r.outputs)
            self.parts.setdefault(table, []).append(part)
        if r.window_sums:
            self.windows += r.batch
            for name, arrays in r.window_sums.items():
                self.sums.setdefault(name, []).append(arrays)
        if self.on_batch is not None:
            self.on_batch(len(lengths) * self.docs_per_window, sum(lengths))

    def finish(self) -> None:
        """The shard's paired effects: each document's mean of each quantity per pass (its windows' sums over
        their counts), edited - clean, added to ``intervention_effects`` under the document's source label."""
        if self.effects is None or not self.windows:
            return
        acc = self.stats[self.effects.name]
        keys = [(acc.label_of([w]), w.doc_id) for w in self.windows]
        docs = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        row = np.array([docs[k] for k in keys])
        means = {}
        for name, parts in self.sums.items():
            total = np.zeros((len(docs), parts[0][0].shape[1]))
            count = np.zeros_like(total)
            np.add.at(total, row, np.concatenate([p[0] for p in parts]))
            np.add.at(count, row, np.concatenate([p[1] for p in parts]))
            with np.errstate(invalid="ignore", divide="ignore"):
                means[name] = np.where(count > 0, total / count, np.nan)  # (D, K)
        labels = np.array([label for label, _ in docs])
        for label in dict.fromkeys(labels.tolist()):
            part, of = self.effects, labels == label
            for i, name in enumerate(self.effects.names):
                part = part.add_documents(i, means[CLEAN][of], means[name][of])
            acc.add(label, part)
        self.sums, self.windows = {}, []
