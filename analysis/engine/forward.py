"""The forward pass: batches of windows in, each batch's producer results out, on the model's device.

:class:`ForwardPass` holds what a worker keeps for its model (the attention capture, the hidden-state stream,
the token categorizer) and runs the model over batches with every producer hooked in (:mod:`.recorder`,
:mod:`.capture`). :meth:`ForwardPass.run` queues each batch one ahead of the one whose results it hands back,
runs a batch again strictly when a device-side check failed, halves a batch that runs out of memory, and
checks the worker's first batch against the model's own numbers (:mod:`.selfcheck`). The extraction job and
``try-analysis`` both call it; it names no analysis.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from actlake.analysis.engine import capture
from actlake.analysis.engine.attention_weights import triton_kernels_on
from actlake.analysis.engine.batch import (
    BatchOutputs,
    BatchResult,
    DeviceChecks,
    HiddenBatch,
    HiddenSink,
    Launched,
    LogitsBatch,
    ModelSpec,
)
from actlake.analysis.engine.device import to_device, to_host
from actlake.analysis.engine.intervene import EditBatch, Editing, Intervention
from actlake.analysis.engine.layer_replay import LayerReplay
from actlake.analysis.engine.recorder import AttentionRecorder, ModelQK
from actlake.analysis.engine.resume import FromLayer, Skipping, Snapshot, Snapshots, same_statistics
from actlake.analysis.engine.selfcheck import SelfCheck
from actlake.analysis.engine.window_summary import WindowSums
from actlake.architectures import blocks, text_config
from actlake.batching import Window, collate
from actlake.categories import ROLE, Categorizer, one_hot
from actlake.config import JobConfig
from actlake.errors import ActlakeError, AnalysisError, ConfigError
from actlake.model import LoadedModel
from actlake.tables import CLEAN

log = logging.getLogger("actlake.extract")

MAX_OOM_SPLITS = 4
"""A batch that runs out of memory is halved at most this many times (down to 1/16)."""


class Pass(NamedTuple):
    """One forward pass of a batch (:meth:`ForwardPass._pass`)."""

    stats: dict
    """{name: Analysis} of this pass."""
    parts: dict
    """{table: ShardTable}: the token tables' parts (the clean pass's only)."""
    recorder: AttentionRecorder
    out: object
    """The model's output (``last_hidden_state``)."""
    checks: list
    """Device-side check counts (none when strict)."""
    devices: set
    check: SelfCheck | None
    """The first batch's self-check (the clean pass's), else None."""
    sums: WindowSums | None
    """With interventions: the per-window sums of :mod:`.window_summary`."""
    snapshots: dict
    """{hidden state a: Snapshot} the clean pass left for the edited passes that start at a (:mod:`.resume`)."""
    values: dict
    """{name: TokenValues} of this pass (per-token values: surprisal), filled by :meth:`ForwardPass._logits`."""


class _Tables:
    """Per-window sums as tables, for :func:`~.resume.same_statistics`."""

    def __init__(self, sums: WindowSums):
        self.sums = sums

    def to_tables(self) -> dict:
        import pyarrow as pa

        return {"mass": pa.table({"v": to_host(self.sums.mass).numpy().reshape(-1)}),
                "norm": pa.table({"v": to_host(self.sums.norm).numpy().reshape(-1)})}


class ForwardPass:
    """A worker's model with every enabled producer hooked in. ``analyses``, ``token_tables`` and ``token_values``:
    (class, options) of the statistics, of the shard tables made batch by batch and of the per-token values
    (:class:`~actlake.analysis.protocol.TokenValues`) the others read; each batch gets fresh instances."""

    def __init__(self, cfg: JobConfig, lm: LoadedModel, analyses: list, token_tables: list,
                 interventions: tuple[Intervention, ...] = (), token_values: list = ()):
        self.cfg, self.lm = cfg, lm
        self.interventions = tuple(interventions)
        """Each batch runs again under each of them (:mod:`.intervene`), after the clean pass."""
        self.blocks = blocks(lm.model, lm.family)
        self.skip_layers = True
        """Edited passes start at their first edited hidden state (:mod:`.resume`), until the first batch's check
        finds that this model's blocks cannot be skipped."""
        self.resume_checked = False
        self.analyses, self.token_tables, self.token_values = analyses, token_tables, list(token_values)
        self.cats = Categorizer(lm.tokenizer)
        capture.install(lm.model)
        self.mqk = m = ModelQK(lm.model, lm.family)
        self.inputs = capture.LayerInputs(lm.model, lm.family)  # hooks attached per batch, when needed
        self.stream = capture.HiddenStream(lm.model, lm.family)  # likewise
        self.spec = ModelSpec(m.n_layers, m.n_heads, m.n_kv_heads, text_config(lm.model.config).hidden_size,
                              cfg.tokenization.max_length, lm.device, tuple(m.attention_layers))
        if self.spec.hybrid:
            others = sorted(set(range(m.n_layers)) - set(m.attention_layers))
            log.warning("model_type %r is a hybrid: layers %s have no attention (linear attention, recurrent or "
                        "state-space blocks), so the attention tables have rows for layers %s only",
                        lm.model.config.model_type, others, list(m.attention_layers))
        self.producers = [c for c, _ in analyses + token_tables + self.token_values]
        logits = [c.name for c in self.producers if "logits" in c.sites]
        if logits and lm.lm_head is None:
            raise ConfigError(f"{logits} read the LM head's logits, and model {lm.path} was loaded without one (it is "
                              "not a causal LM, or analyses.surprisal is false)")
        self.oom_splits = 0
        self.checked = False
        """Whether the first batch's self-check (:mod:`~actlake.analysis.engine.selfcheck`) has passed."""
        self.triton = triton_kernels_on(cfg.analyses.triton_kernels, lm.device)
        unsafe = [c.name for c in self.producers if "attention" in c.sites and not c.graph_safe]
        unsafe += ["interventions' per-window sums"] * bool(self.interventions)
        self.layer_graphs = layer_graphs_on(cfg.analyses.layer_graphs, lm.device, unsafe)
        self.strict = lm.device.type != "cuda"
        """run_batch's default: strict checks layer by layer on a CPU, device-side counts read once per batch on a GPU."""

    def new_stats(self) -> dict:
        """Fresh accumulators of every enabled analysis, on the model's device: {name: Analysis}."""
        return {cls.name: cls.create(self.spec, **options) for cls, options in self.analyses}

    def run(self, batches: Iterable[list[Window]]) -> Iterator[BatchResult]:
        """Every batch's results, in order: a batch is queued on the device before the previous one's results
        are read (on a GPU the host prepares batch k+1 while the device runs batch k); a batch whose device
        check failed runs again strictly; one that runs out of memory is halved (its halves' results come back)."""
        pending = None  # the batch queued before this one: its results are read once this one is queued
        for batch in batches:
            for launched in self._split_on_oom(self.launch, batch):
                if pending is not None:
                    yield from self._collect(pending)
                pending = launched
        if pending is not None:
            yield from self._collect(pending)

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
        prepare and queue the next batch while it runs) and :meth:`Launched.passed` waits for it. The clean pass
        first, then one pass per intervention (:mod:`.intervene`) over the same windows."""
        strict = self.strict if strict is None else strict
        strict = strict or (not self.checked and self.cfg.analyses.self_check)  # the self-checked batch: layer by layer
        ids, mask = collate(batch, self.lm.tokenizer.pad_token_id)  # (B, T)
        role, type8 = self.cats.batch(ids.numpy(), mask.sum(1).numpy())  # (B, T) category ids, 0 on padding
        clean = self._pass(batch, ids, mask, role, type8, strict, tables=True)
        values = {k: to_host(v) for k, v in self._logits(clean, ids, mask).items()}  # the clean pass's, on the host
        if clean.check is not None:
            self._finish_check(clean.check, clean.recorder, clean.values, values, ids, mask)
        checks, devices, keep, edited, window_sums = clean.checks, clean.devices, [], {}, {}
        if self.interventions:
            window_sums[CLEAN] = clean.sums.sums(values)
        for iv in self.interventions:
            valid, roles = to_device(mask.bool(), self.lm.device), to_device(role, self.lm.device)
            select = iv.selected(valid, roles)
            snap = clean.snapshots.get(min(iv.layers)) if self.skip_layers else None
            with Editing(self.lm.model, self.lm.family, iv, select, EditBatch(valid, roles, select, batch)):
                p = self._pass(batch, ids, mask, role, type8, strict, start=snap)
                if snap is not None and not self.resume_checked:  # the first batch: against the full edited pass
                    p = self._check_resume(p, self._pass(batch, ids, mask, role, type8, strict), iv)
            edited[iv.name], checks, devices = p.stats, checks + p.checks, devices | p.devices
            keep.append(p.recorder)
            window_sums[iv.name] = p.sums.sums(self._logits(p, ids, mask, clean.out.last_hidden_state), values)
        self.resume_checked = self.resume_checked or bool(clean.snapshots)
        result = BatchResult(BatchOutputs(batch, ids, mask, role, type8, self.cats, **values), clean.stats,
                             clean.parts, edited, window_sums)
        # the recorders (their layer graphs, the buffers replays read) live until the batch is waited for
        return Launched(batch, result, DeviceChecks(self.lm.device, checks, devices), clean.recorder, keep)

    def _logits(self, p: Pass, ids, mask, clean=None) -> dict:
        """Every producer of pass ``p`` that reads the ``logits`` gets the pass's final hidden state and the LM head
        (``clean``: an edited pass's clean final hidden state); returns the pass's per-token values on the device,
        by name (none without an LM head)."""
        if self.lm.lm_head is None:
            return {}
        out = LogitsBatch(self.lm.lm_head, self.lm.logit_transform, p.out.last_hidden_state, ids, mask, clean)
        for x in [*p.stats.values(), *p.parts.values(), *p.values.values(), p.sums]:
            if x is not None and "logits" in x.sites:
                x.add_logits(out)
        return {k: v for x in p.values.values() for k, v in x.values().items()}

    def _check_resume(self, resumed: Pass, full: Pass, iv) -> Pass:
        """The first batch's edited pass, resumed from the clean pass's snapshot, against the full edited pass: the
        same statistics, or the full pass's and every later edited pass runs in full (a model whose blocks carry
        state from one to the next cannot skip the first ones), said once."""
        differs = same_statistics(resumed.stats, full.stats) or same_statistics(
            {"window_sums": _Tables(resumed.sums)}, {"window_sums": _Tables(full.sums)})
        if differs is None:
            return resumed
        log.warning("model_type %r: an edited pass started at hidden state %d differs from the full edited pass "
                    "(%s, intervention %r); every edited pass runs every layer", self.lm.model.config.model_type,
                    min(iv.layers), differs, iv.name)
        self.skip_layers = False
        return full

    def _pass(self, batch, ids, mask, role, type8, strict: bool, tables: bool = False,
              start: Snapshot | None = None) -> Pass:
        """One forward pass over a batch with every analysis hooked in (and, with ``tables``, the token tables and
        the first batch's self-check, and the snapshots edited passes start from: :mod:`.resume`). ``start``: an
        edited pass that starts at the snapshot's hidden state, with its statistics so far."""
        a = self.cfg.analyses
        stats, sums = start.fresh() if start is not None else (self.new_stats(), None)
        parts = {cls.tables[0]: cls.create(self.spec, **options) for cls, options in self.token_tables} if tables else {}
        values = {cls.name: cls.create(self.spec, **options) for cls, options in self.token_values}
        dev = self.lm.device
        producers = list(stats.values()) + list(parts.values()) + list(values.values())
        attention = [x for x in producers if "attention" in x.sites]
        check = self._self_check(attention) if tables else None
        if self.interventions and sums is None:
            sums = WindowSums(self.spec, mask)  # for the paired effects
        if sums is not None:
            producers.append(sums)
            attention.append(sums)
        sink = HiddenSink([x for x in producers if "hidden_states" in x.sites],
                          HiddenBatch(mask, role, type8, strict, self.triton, batch))
        starts = {min(iv.layers) for iv in self.interventions} - {0} if tables and self.skip_layers else set()
        snapshots = Snapshots(self.blocks, starts, stats, sums, shared=(self.lm.model, self.lm.tokenizer, self.spec))
        with contextlib.ExitStack() as stack:
            if starts:
                stack.enter_context(snapshots)
            if start is not None:
                stack.enter_context(Skipping(self.blocks, start))
            inputs = stack.enter_context(self.inputs) if any("layer_inputs" in x.sites for x in attention) else None
            recorder = AttentionRecorder(self.mqk, mask, one_hot(role, len(ROLE), mask), [x.add_layer for x in attention],
                                         inputs=inputs, needs=frozenset().union(*(x.products for x in attention)), method=a.attention_weights,
                                         strict=strict, on_excluded=[x.nonfinite_excluded for x in attention],
                                         triton=self.triton,
                                         replay=LayerReplay(attention) if self.layer_graphs and not strict and attention
                                         and sums is None else None)
            recorder.check = check
            if attention:
                stack.enter_context(capture.recording(recorder))
            if sink.readers:  # else no hidden state is looked at
                stack.enter_context(self.stream(sink if start is None else FromLayer(sink, start.a)))
            out = self.lm.model(input_ids=to_device(ids, dev), attention_mask=to_device(mask, dev),
                                use_cache=False)  # causal models would keep every layer's keys and values
            if sink.readers:
                self.stream.last(out.last_hidden_state)
        checks = [] if strict else recorder.problems() + [t for x in producers for t in x.problems()]
        return Pass(stats, parts, recorder, out, checks, set(sink.devices), check, sums, snapshots.taken, values)

    def _self_check(self, attention: list):
        """A :class:`SelfCheck` for this worker's first batch (``analyses.self_check``), else None."""
        if self.checked or not self.cfg.analyses.self_check:
            return None
        names = [x.name for x in attention]
        hidden = [c.name for c in self.producers if "hidden_states" in c.sites]
        return SelfCheck(self.lm.dtype, names, [x.name for x in attention if "layer_inputs" in x.sites], hidden)

    def _finish_check(self, check, recorder, producers: dict, values: dict, ids, mask) -> None:
        """The first batch's self-check: every attention layer recorded, the per-token values of ``producers`` that
        read the logits (``values``: the clean pass's on the host) against the model's own logits (its full forward
        pass on the batch's first sequence); raises AnalysisError naming what failed."""
        if check.attention:
            check.layers(self.mqk.attention_layers, recorder.seen)
        readers = [x for x in producers.values() if "logits" in x.sites]
        if check.hidden or readers:  # the model's own pass on the first sequence, the hooks on
            n = int(mask[0].sum())
            hooked: dict = {}
            model = self.lm.causal_lm if readers and self.lm.causal_lm is not None else self.lm.model
            with self.stream(lambda layer, h: hooked.__setitem__(layer, h[0])):
                out = model(input_ids=to_device(ids[:1, :n], self.lm.device), output_hidden_states=True, use_cache=False)
                self.stream.last(getattr(out, "last_hidden_state", None) if model is self.lm.model else out.hidden_states[-1])
            check.hidden_states(hooked, out.hidden_states)
            if model is self.lm.causal_lm:
                for x in readers:
                    x.check(check, values, out.logits[0], ids[0, :n], mask[0, :n])
        check.raise_if_failed(self.lm.model.config.model_type)
        self.checked = True

    def _collect(self, launched: Launched) -> Iterator[BatchResult]:
        """Wait for a queued batch and yield its results; a failed device check runs it again strictly."""
        if launched.passed():
            yield launched.result
            return
        log.warning("a check failed on the device (mask or inf/NaN); running the batch again strictly")
        yield from self.run_batch_resilient(launched.batch, strict=True)

    def run_batch_resilient(self, batch: list[Window], strict: bool | None = None):
        """:meth:`run_batch`, halving the batch on out-of-memory (see :meth:`_split_on_oom`). Yields
        :class:`~actlake.analysis.engine.batch.BatchResult`."""
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
