"""The ``activations`` table (the activation store): sampled windows' hidden states, one row per (token, layer).

Columns: doc_id, window_index, position, token_id, token, role, type8, source, surprisal, layer, and ``h``, a
fixed-size float array of the hidden size (DuckDB reads it as ``FLOAT[d]``). Windows are sampled by a
hash of (seed, doc_id, window_index), so the sample does not depend on sharding. Read it back with
:mod:`actlake.storage.activations`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from actlake.analysis.engine.device import to_device, to_host
from actlake.analysis.protocol import BatchOutputs, HiddenBatch, ShardTable, TableDoc
from actlake.architectures import resolve_layers
from actlake.categories import ROLE, TYPE8
from actlake.hashing import unit_hash

META_BYTES = 48
"""Approximate bytes per row besides the vector (ids, token text, labels; before compression)."""


def window_sampled(cfg, doc_id: int, window: int) -> bool:
    """Deterministic Bernoulli(fraction) draw for one window."""
    if cfg is None or cfg.fraction >= 1.0:
        return True
    return unit_hash(f"{cfg.seed}:{doc_id}:{window}") < cfg.fraction


def bytes_per_token(n_layers_stored: int, d: int, dtype: str) -> int:
    return n_layers_stored * (d * (2 if dtype == "float16" else 4) + META_BYTES)


def add_token_columns(cols: dict, w, texts: list, roles: list, t8s: list, surprisal: list) -> None:
    """Append one window's per-token columns (those of ``cols``' keys that a window gives) to ``cols``."""
    T = len(w.ids)
    cols["doc_id"] += [w.doc_id] * T
    cols["window_index"] += [w.window] * T
    cols["position"] += range(T)
    cols["token_id"] += w.ids
    cols["token"] += texts
    cols["role"] += [ROLE[r] for r in roles]
    cols["type8"] += [TYPE8[t] for t in t8s]
    cols["source"] += [w.source] * T
    cols["surprisal"] += surprisal


def activation_table(rows: list, dtype: str = "float32") -> pa.Table:
    """rows: (window, token texts, role ids, type8 ids, surprisal list, {layer: (T, d) tensor}) per sampled window."""
    cols = {k: [] for k in ("doc_id", "window_index", "position", "token_id", "token", "role", "type8", "source",
                            "surprisal", "layer")}
    vecs = []
    for w, texts, roles, t8s, surprisal, acts in rows:
        for layer, h in sorted(acts.items()):
            add_token_columns(cols, w, texts, roles, t8s, surprisal)
            cols["layer"] += [layer] * len(w.ids)
            vecs.append(h.float().numpy())
    np_dtype, pa_dtype = (np.float16, pa.float16()) if dtype == "float16" else (np.float32, pa.float32())
    d = vecs[0].shape[1] if vecs else 0
    flat = np.concatenate(vecs).astype(np_dtype).ravel() if vecs else np.zeros(0, np_dtype)
    h = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa_dtype), d) if vecs else pa.array([], pa.list_(pa_dtype, 1))
    schema = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                        ("token_id", pa.int32()), ("token", pa.string()), ("role", pa.string()), ("type8", pa.string()),
                        ("source", pa.string()), ("surprisal", pa.float32()), ("layer", pa.int16())])
    base = pa.table(cols, schema=schema)
    return base.append_column("h", h)


class ActivationSample(ShardTable):
    """The sampled windows' rows of the stored layers, copied to pinned host memory without blocking as
    each hidden state comes by; their token columns at :meth:`collect`."""

    name = "activations"
    sites = frozenset({"hidden_states"})
    tables = ("activations",)
    table_docs = {"activations": TableDoc(  # its schema is activation_table's: h is as wide as the model
        "sampled token × stored hidden state (with `activations.layers`)", {
            "doc_id": "", "window_index": "", "position": "", "token_id": "", "token": "", "role": "",
            "type8": "as in `tokens`", "source": "", "surprisal": "NULL without an LM head", "layer": "hidden state",
            "h": "`FLOAT[d]`, the hidden state; `activations.dtype`"},
        note="`actlake export` turns it into SAE training data ([Activations for SAE training](sae.md))")}

    @classmethod
    def options_from(cls, cfg) -> dict:
        a = cfg.activations
        return {"layers": list(a.layers), "fraction": a.fraction, "seed": a.seed, "dtype": a.dtype}

    @classmethod
    def plan_note(cls, cfg, n_records: int | None) -> str | None:
        """The store's size per token and an upper bound for the documents about to run."""
        if n_records is None:
            return None
        from actlake.architectures import layers_of, read_model_config, text_config
        from actlake.config import resolve_model_path

        m = cfg.model
        hf = read_model_config(resolve_model_path(m.name_or_path), m.revision, m.trust_remote_code)
        a, t = cfg.activations, cfg.tokenization
        layers = resolve_layers(a.layers, layers_of(hf))
        width = text_config(hf).hidden_size
        per_token = bytes_per_token(len(layers), width, a.dtype)
        windows = 1 if t.overflow == "truncate" else t.max_windows_per_doc
        bound = n_records * windows * t.max_length * a.fraction * per_token
        return (f"activation store: hidden states {layers}, d = {width}, {a.dtype}: {per_token:,} bytes per token "
                f"before compression; at most {bound / 2**30:,.2f} GiB for {n_records:,} documents "
                f"(fraction {a.fraction:g} of windows)")

    @classmethod
    def create(cls, spec, layers=(), fraction=1.0, seed=0, dtype="float32") -> "ActivationSample":
        out = super().create(spec)
        out.store, out.sample = set(resolve_layers(layers, spec.n_layers)), _Sample(fraction, seed)
        out.keep, out.acts = None, {}
        return out

    def add_hidden(self, layer: int, h: torch.Tensor, batch: HiddenBatch) -> None:
        if self.keep is None:  # the batch's first call: which of its rows are sampled
            self.keep = [i for i, w in enumerate(batch.windows) if window_sampled(self.sample, w.doc_id, w.window)]
            self.rows = torch.tensor(self.keep, dtype=torch.long)
        if layer in self.store and self.keep:
            self.acts[layer] = to_host(h[to_device(self.rows, h.device)])  # (n, T, d)

    def collect(self, out: BatchOutputs) -> None:
        self.rows_out = []
        s_all = None if out.surprisal is None else out.surprisal.numpy()
        for j, i in enumerate(self.keep or []):
            w, T = out.windows[i], len(out.windows[i].ids)
            s = [None] * T if s_all is None else [None if v != v else v for v in s_all[i, :T].tolist()]
            self.rows_out.append((w, out.cats.texts(w.ids), out.role[i, :T].tolist(), out.type8[i, :T].tolist(), s,
                                  {lay: hs[j][:T] for lay, hs in self.acts.items()}))

    @classmethod
    def to_table(cls, parts: list["ActivationSample"], dtype: str = "float32", **options) -> pa.Table:
        return activation_table([r for p in parts for r in p.rows_out], dtype)


class _Sample:
    """What :func:`window_sampled` reads of ``activations`` (fraction, seed)."""

    def __init__(self, fraction: float, seed: int):
        self.fraction, self.seed = fraction, seed
