"""Token categories of METHODS.md: the ``role`` scheme (seed 001) and ``type8`` (seed 003)."""

from __future__ import annotations

import unicodedata

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
    """Per-token categories for one tokenizer, with a cache of decoded pieces."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        cls = getattr(tokenizer, "cls_token_id", None)
        sep = getattr(tokenizer, "sep_token_id", None)
        self.bos_id = cls if cls is not None else tokenizer.bos_token_id
        self.eos_id = sep if sep is not None else tokenizer.eos_token_id
        self.special = set(tokenizer.all_special_ids)
        self._cache: dict[int, tuple[str, int, int]] = {}
        period = tokenizer.convert_tokens_to_ids(".")
        comma = tokenizer.convert_tokens_to_ids(",")
        self._punct = {}
        for tid, name in ((period, "period"), (comma, "comma")):
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                self._punct[tid] = ROLE.index(name)

    def piece(self, tid: int) -> tuple[str, int, int]:
        """(token text, role id without position, type8 id) for a token id."""
        hit = self._cache.get(tid)
        if hit is None:
            text = self.tok.convert_ids_to_tokens(tid)
            decoded = self.tok.decode([tid])
            t8 = TYPE8.index("other") if tid in self.special else TYPE8.index(type8_of(decoded))
            role = self._punct.get(tid, ROLE.index("other"))
            if role == ROLE.index("other") and decoded.strip() in (".", ","):
                role = ROLE.index("period" if decoded.strip() == "." else "comma")
            hit = (text, role, t8)
            self._cache[tid] = hit
        return hit

    def window(self, ids: list[int]) -> tuple[list[str], list[int], list[int]]:
        """Texts, role ids and type8 ids of one window's tokens."""
        texts, roles, t8s = [], [], []
        for pos, tid in enumerate(ids):
            text, role, t8 = self.piece(tid)
            if tid == self.bos_id and (pos == 0 or self.bos_id != self.eos_id):
                role = ROLE.index("bos")
            elif tid == self.eos_id:
                role = ROLE.index("eos")
            texts.append(text)
            roles.append(role)
            t8s.append(t8)
        return texts, roles, t8s


def one_hot(ids: torch.Tensor, n: int, valid: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """(B, T) category ids -> (B, T, n) one-hot, zero on padding."""
    out = torch.nn.functional.one_hot(ids.clamp(min=0), n).to(dtype)
    return out * valid.unsqueeze(-1).to(dtype)
