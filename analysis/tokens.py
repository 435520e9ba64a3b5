"""The ``tokens`` table: one row per real token of the shard, with its categories and surprisal (METHODS.md §5)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from actlake.analysis.protocol import BatchOutputs, ShardTable, TableDoc
from actlake.analysis.token_surprisal import Surprisal
from actlake.categories import ROLE, TYPE8

TOKENS_SCHEMA = pa.schema([("doc_id", pa.int64()), ("window_index", pa.int32()), ("position", pa.int32()),
                           ("token_id", pa.int32()), ("token", pa.string()), ("role", pa.string()),
                           ("type8", pa.string()), ("source", pa.string()), ("surprisal", pa.float32())])


def _names(ids: np.ndarray, values) -> pa.Array:
    """Strings from ``ids``, indices into ``values`` (one per row)."""
    return pa.DictionaryArray.from_arrays(pa.array(ids.astype(np.int32)), pa.array(values, pa.string())).dictionary_decode()


class Tokens(ShardTable):
    """Per batch, the real tokens' columns as arrays; one table per shard (category names from ids, token
    texts from the categorizer, surprisal (:class:`~actlake.analysis.token_surprisal.Surprisal`'s) NaN (no context)
    or absent (no LM head) as null)."""

    name = "tokens"
    about = 'The `tokens` table: one row per token (id, text, categories, surprisal).'
    tables = ("tokens",)
    schema = TOKENS_SCHEMA
    table_docs = {"tokens": TableDoc("token of a window", {
        "doc_id": "global document number", "window_index": "",
        "position": "within the window, special tokens included", "token_id": "", "token": "vocabulary piece",
        "role": "`bos` = [CLS]/BOS, `eos` = [SEP]/EOS, `period`, `comma`, `other`",
        "type8": "`newline`, `whitespace`, `letters`, `digits`, `punct_symbol`, `open_bracket`, `close_bracket`, "
                 "`other`",
        "source": "e.g. `pile_set_name`",
        "surprisal": Surprisal.value_docs["surprisal"]})}

    def collect(self, out: BatchOutputs) -> None:
        doc_id, window, position, lengths = out.token_keys()
        valid = out.mask.bool().numpy()  # (B, T)
        self.cats, self.sources, self.lengths = out.cats, [w.source for w in out.windows], lengths
        self.cols = {"doc_id": doc_id, "window_index": window, "position": position,
                     "token_id": out.ids.numpy()[valid], "role": out.role.numpy()[valid], "type8": out.type8.numpy()[valid]}
        self.surprisal = None if out.surprisal is None else out.surprisal.numpy()[valid]

    @classmethod
    def to_table(cls, parts: list["Tokens"], **options) -> pa.Table:
        if not parts:
            return TOKENS_SCHEMA.empty_table()
        col = {k: np.concatenate([p.cols[k] for p in parts]) for k in parts[0].cols}
        lengths = np.concatenate([p.lengths for p in parts])
        sources = [s for p in parts for s in p.sources]  # per window
        surprisal = None if parts[0].surprisal is None else np.concatenate([p.surprisal for p in parts])
        n = len(col["token_id"])
        return pa.table({
            "doc_id": pa.array(col["doc_id"], pa.int64()),
            "window_index": pa.array(col["window_index"], pa.int32()),
            "position": pa.array(col["position"], pa.int32()),
            "token_id": pa.array(col["token_id"], pa.int32()),
            "token": parts[0].cats.text_array(col["token_id"]),
            "role": _names(col["role"], ROLE),
            "type8": _names(col["type8"], TYPE8),
            "source": _names(np.repeat(np.arange(len(sources)), lengths), sources),
            "surprisal": (pa.nulls(n, pa.float32()) if surprisal is None
                          else pa.array(surprisal, pa.float32(), mask=np.isnan(surprisal))),
        }, schema=TOKENS_SCHEMA)
