"""Token categories of METHODS.md: the ``role`` scheme (seed 001) and ``type8`` (seed 003)."""

from __future__ import annotations

import unicodedata

import numpy as np
import torch

ROLE = ("bos", "eos", "period", "comma", "other")
"""``bos``: the leading special token ([CLS] or BOS); ``eos``: the separator/end token ([SEP] or EOS)."""
TYPE8 = ("newline", "whitespace", "letters", "digits", "punct_symbol", "open_bracket", "close_bracket", "other")
SCHEMES = {"all": ("all",), "role": ROLE, "type8": TYPE8}

_OPEN = set("([{<")
_CLOSE = set(")]}>")


def type8_of(text: str) -> str:
    """Category of one decoded token's text."""
    if "\n" in text or "\r" in text:
        return "newline"
    s = text.strip()
    if not s:
        return "whitespace"
    if s.startswith("##"):
        s = s[2:] or s
    if s.isalpha():
        return "letters"
    if s.isdigit():
        return "digits"
    if all(c in _OPEN for c in s):
        return "open_bracket"
    if all(c in _CLOSE for c in s):
        return "close_bracket"
    if all(unicodedata.category(c)[0] in "PS" for c in s):
        return "punct_symbol"
    return "other"


class Categorizer:
    """Per-token categories for one tokenizer. Each vocabulary entry is judged once, from its decoded text,
    the first time a batch holds it; a batch's categories are then array lookups (no Python per token).
    :meth:`batch` is called by one thread at a time (the worker's compute lock); :meth:`texts` and
    :meth:`text_array` may run beside it: entries are only ever filled in, and a grown table replaces the old
    one whole."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        cls = getattr(tokenizer, "cls_token_id", None)
        sep = getattr(tokenizer, "sep_token_id", None)
        self.bos_id = cls if cls is not None else tokenizer.bos_token_id
        self.eos_id = sep if sep is not None else tokenizer.eos_token_id
        self.special = set(tokenizer.all_special_ids)
        period = tokenizer.convert_tokens_to_ids(".")
        comma = tokenizer.convert_tokens_to_ids(",")
        self._punct = {}
        for tid, name in ((period, "period"), (comma, "comma")):
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                self._punct[tid] = ROLE.index(name)
        n = len(tokenizer)
        self._role = np.full(n, -1, np.int8)  # (V,) role id without position; -1: not judged yet
        self._t8 = np.zeros(n, np.int8)  # (V,) type8 id
        self._text: list[str | None] = [None] * n  # the token's text (convert_ids_to_tokens)

    def piece(self, tid: int) -> tuple[str, int, int]:
        """(token text, role id without position, type8 id) for a token id, judged from its decoded text."""
        text = self.tok.convert_ids_to_tokens(tid)
        decoded = self.tok.decode([tid])
        t8 = TYPE8.index("other") if tid in self.special else TYPE8.index(type8_of(decoded))
        role = self._punct.get(tid, ROLE.index("other"))
        if role == ROLE.index("other") and decoded.strip() in (".", ","):
            role = ROLE.index("period" if decoded.strip() == "." else "comma")
        return text, role, t8

    def _judge(self, ids: np.ndarray) -> None:
        """Fill in the entries of the ids (any shape) not judged yet."""
        if ids.size == 0:
            return
        top = int(ids.max())
        if top >= len(self._text):  # an id past len(tokenizer): grow, replacing the tables whole
            n = top + 1
            role, t8 = np.full(n, -1, np.int8), np.zeros(n, np.int8)
            role[: len(self._role)], t8[: len(self._t8)] = self._role, self._t8
            self._text, self._t8, self._role = self._text + [None] * (n - len(self._text)), t8, role
        role, t8, text = self._role, self._t8, self._text
        for tid in np.unique(ids[role[ids] < 0]).tolist():
            text[tid], r, t8[tid] = self.piece(tid)
            role[tid] = r  # last: it marks the entry done

    def batch(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) right-padded token ids and each row's length -> (B, T) int64 role and type8 ids, 0 on padding.

        ``role``'s positional rule: the leading special token is ``bos``, the separator/end token ``eos``; where
        they are one token (GPT-2's ``<|endoftext|>``) it is ``bos`` at position 0 and ``eos`` elsewhere."""
        valid = np.arange(ids.shape[1])[None] < lengths[:, None]  # (B, T)
        ids = np.where(valid, ids, 0)
        self._judge(ids)
        role, t8 = self._role[ids].astype(np.int64), self._t8[ids].astype(np.int64)  # (B, T)
        if self.eos_id is not None:
            role[ids == self.eos_id] = ROLE.index("eos")
        if self.bos_id is not None:
            if self.bos_id != self.eos_id:
                role[ids == self.bos_id] = ROLE.index("bos")
            else:
                role[:, 0][ids[:, 0] == self.bos_id] = ROLE.index("bos")
        role[~valid] = 0
        t8[~valid] = 0
        return torch.from_numpy(role), torch.from_numpy(t8)

    def texts(self, ids) -> list[str]:
        """The texts of token ids already seen in a batch."""
        text = self._text
        return [text[i] for i in ids]

    def text_array(self, ids: np.ndarray):
        """pyarrow string array of the texts of token ids already seen in a batch (one lookup table for all)."""
        import pyarrow as pa

        return pa.array(self._text, pa.string()).take(pa.array(ids))


def one_hot(ids: torch.Tensor, n: int, valid: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """(B, T) category ids -> (B, T, n) one-hot, zero on padding."""
    out = torch.nn.functional.one_hot(ids.clamp(min=0), n).to(dtype)
    return out * valid.unsqueeze(-1).to(dtype)
