"""Per-token surprisal from a causal LM head (METHODS.md §5): s_t = -log p(x_t | x_<t), in nats.

Logits are formed in chunks of tokens from the final (normalised) hidden state, so a batch never
holds all (B, T, V) logits at once.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 1024
"""Tokens whose logits are formed at once."""


@torch.no_grad()
def token_surprisal(head: torch.nn.Module, last_hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """(B, T, d), (B, T), (B, T) -> (B, T) float32 surprisal; NaN at position 0 and at padding.

    Position t is scored from the hidden state at t - 1 (the prediction of token t).
    """
    B, T, _ = last_hidden.shape
    out = torch.full((B, T), float("nan"), dtype=torch.float32)
    if T < 2:
        return out
    valid = (mask[:, 1:] & mask[:, :-1]).to(last_hidden.device)  # (B, T-1): predicted token and context real
    rows, cols = valid.nonzero(as_tuple=True)
    h = last_hidden[:, :-1][rows, cols]  # (N, d)
    target = ids.to(last_hidden.device)[:, 1:][rows, cols]  # (N,)
    nll = torch.empty(len(rows), dtype=torch.float32, device=last_hidden.device)
    for s in range(0, len(rows), chunk):
        logits = head(h[s : s + chunk]).float()  # (n, V)
        lp = torch.log_softmax(logits, dim=-1)
        nll[s : s + chunk] = -lp.gather(1, target[s : s + chunk, None])[:, 0]
    out[rows.cpu(), cols.cpu() + 1] = nll.cpu()
    return out
