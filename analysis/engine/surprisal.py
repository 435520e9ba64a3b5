"""Per-token surprisal from a causal LM head (METHODS.md §5): s_t = -log p(x_t | x_<t), in nats.

Logits are formed in chunks of tokens from the final (normalised) hidden state, so a batch never
holds all (B, T, V) logits at once: about :data:`CHUNK_LOGITS` at a time, whatever the vocabulary.
"""

from __future__ import annotations

import torch

from actlake.analysis.engine.device import to_device

CHUNK_LOGITS = 1 << 24
"""Logits formed at once (tokens × vocabulary): with the float32 copy and its log-softmax about 170 MB of
device memory for a 16-bit model (Pythia's 50,304-token vocabulary: 333 tokens at a time; 1,024 tokens
at a time took 515 MB)."""


@torch.no_grad()
def scored_positions(mask: torch.Tensor, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The predictions surprisal scores (token t from position t - 1, both real), decided on the host from the
    (B, T) ``mask``: their (N,) indices into (B, T-1) and the scored tokens' indices into (B, T), on ``dev``."""
    T = mask.shape[1]
    valid = mask[:, 1:].bool() & mask[:, :-1].bool()  # (B, T-1): predicted token and context real
    scored = valid.reshape(-1).nonzero().flatten()  # (N,)
    return to_device(scored, dev), to_device(scored // (T - 1) * T + scored % (T - 1) + 1, dev)


def tokens_per_chunk(head: torch.nn.Module, chunk_logits: int) -> int:
    """Predictions per chunk so that a chunk's logits hold about ``chunk_logits`` values."""
    return max(1, chunk_logits // (getattr(head, "out_features", None) or head.weight.shape[0]))


def token_surprisal(head: torch.nn.Module, last_hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    chunk_logits: int = CHUNK_LOGITS, transform=None) -> torch.Tensor:
    """(B, T, d) on the model's device, (B, T), (B, T) on the host -> (B, T) float32 surprisal on the
    model's device; NaN at position 0 and at padding.

    Position t is scored from the hidden state at t - 1 (the prediction of token t); ``transform``: the
    model's own transform of its logits (scaling, softcapping), applied in float32. Which tokens are
    scored is decided on the host, so nothing waits for the device.
    """
    B, T, _ = last_hidden.shape
    dev = last_hidden.device
    out = torch.full((B, T), float("nan"), dtype=torch.float32, device=dev)
    if T < 2:
        return out
    flat, into_out = scored_positions(mask, dev)
    h = last_hidden[:, :-1].reshape(B * (T - 1), -1)[flat]  # (N, d)
    target = to_device(ids[:, 1:].reshape(-1), dev)[flat]  # (N,)
    nll = torch.empty(flat.shape[0], dtype=torch.float32, device=dev)
    chunk = tokens_per_chunk(head, chunk_logits)
    for s in range(0, flat.shape[0], chunk):
        logits = head(h[s : s + chunk]).float().to(dev)  # (n, V); with device_map the head may live elsewhere
        if transform is not None:
            logits = transform(logits)
        lp = torch.log_softmax(logits, dim=-1)
        nll[s : s + chunk] = -lp.gather(1, target[s : s + chunk, None])[:, 0]
    out.view(-1)[into_out] = nll
    return out
