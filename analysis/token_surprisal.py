"""Per-token surprisal (METHODS.md §5), s_t = -log p(x_t | x_<t) in nats, from the LM head's logits: the ``tokens``
and ``activations`` tables' ``surprisal`` column, and the interventions' effect on it. A producer of values per
token (:class:`~actlake.analysis.protocol.TokenValues`); the computation in chunks of logits is
:func:`~actlake.analysis.engine.surprisal.token_surprisal`.

It runs where the worker's model was loaded with its LM head, which ``analyses.surprisal`` decides (null: a causal
LM's; true: a model that is not one is refused; false: off), and is checked on each worker's first batch against
the model's own logits (:mod:`~actlake.analysis.engine.selfcheck`).
"""

from __future__ import annotations

import torch

from actlake.analysis.engine.surprisal import token_surprisal
from actlake.analysis.protocol import LogitsBatch, TokenValues


class Surprisal(TokenValues):
    """(B, T) float32 surprisal of each pass on the model's device: NaN at a window's first token and at padding."""

    name = "surprisal"
    about = "Per-token surprisal -log p(token | earlier tokens of its window), nats, in `tokens` and `activations`."
    sites = frozenset({"logits"})
    value_docs = {"surprisal": "−log p(token | earlier tokens of its window), nats, `analyses.surprisal`; NULL for a "
                               "window's first token and when off"}

    def add_logits(self, out: LogitsBatch) -> None:
        self.surprisal = token_surprisal(out.head, out.last_hidden, out.ids, out.mask, transform=out.transform)

    def values(self) -> dict[str, torch.Tensor]:
        return {"surprisal": self.surprisal}

    def check(self, check, values: dict, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        check.surprisal(values["surprisal"][0, :len(ids)], logits, ids, mask)
