"""Surprisal in chunks of logits equals cross-entropy over the whole batch at once."""

from __future__ import annotations

import pytest
import torch

from actlake.analysis.engine.surprisal import token_surprisal


@pytest.mark.parametrize("chunk_logits", [1, 3 * 50, 7 * 50 + 11, 1 << 24])
def test_chunked_surprisal_equals_cross_entropy(chunk_logits):
    g = torch.Generator().manual_seed(0)
    B, T, d, V = 3, 9, 16, 50
    head = torch.nn.Linear(d, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, d, generator=g))
    hidden = torch.randn(B, T, d, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 1:] = 0  # one real token: nothing to score
    got = token_surprisal(head, hidden, ids, mask, chunk_logits=chunk_logits)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(head(hidden[:, :-1]).transpose(1, 2), ids[:, 1:], reduction="none")
    scored = (mask[:, 1:] * mask[:, :-1]).bool()
    torch.testing.assert_close(got[:, 1:][scored], want[scored], rtol=1e-6, atol=1e-6)
    assert bool(got[:, 0].isnan().all()) and bool(got[:, 1:][~scored].isnan().all())
    assert int(scored.sum()) == 8 + 5 + 0
