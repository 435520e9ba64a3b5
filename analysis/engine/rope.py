"""Rotary position embeddings, in the two layouts Hugging Face models use.

R_n y = y cos(n) + rot(y) sin(n) on the first ``rot`` dims (partial rotary leaves the rest unchanged),
where rot pairs dimension i with i + rot/2 (``rotate_half``: Llama, GPT-NeoX) or 2i with 2i + 1
(``rotate_every_two``: GPT-J, Cohere; ``interleaved``). Either way rot(y) = swap(y) * signs, so R_n y
and R_n^T y = y cos(n) - rot(y) sin(n) are both y cos + swap(y) s for a signed sin s, which :func:`factors`
builds once per batch; :func:`apply` is then three operations. (With a scaled rotary, cos and sin carry
the scale, and R^T is still the transpose: what the contributions need.)
"""

from __future__ import annotations

import torch


def factors(cos: torch.Tensor, sin: torch.Tensor, sign: float, interleaved: bool = False, last: bool = False) -> tuple:
    """(cos, signed sin, interleaved, last), each tensor (B, 1, T, rot), from the model's (B, T, rot): R_n (``sign``
    1) or R_n^T (-1). ``last``: the rotated dims are the last ``rot`` of a head (multi-head latent attention), not
    the first."""
    rot = cos.shape[-1]
    signs = torch.tensor([-1.0, 1.0], dtype=sin.dtype, device=sin.device)
    signs = signs.repeat(rot // 2) if interleaved else signs.repeat_interleave(rot // 2)
    return cos[:, None], (sign * sin * signs)[:, None], interleaved, last


def apply(y: torch.Tensor, f: tuple) -> torch.Tensor:
    """R y (or R^T y) for y (B, H, T, ..., d_h): :func:`factors` broadcast over heads and any axes
    between T and d_h (several stacked vectors per token)."""
    c, s, interleaved, last = f
    for _ in range(y.dim() - 4):
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    c, s = c.to(y.dtype), s.to(y.dtype)
    rot, width = c.shape[-1], y.shape[-1]
    head = y[..., width - rot :] if last else y[..., :rot]
    shape = (rot // 2, 2) if interleaved else (2, rot // 2)
    swapped = head.unflatten(-1, shape).flip(-1 if interleaved else -2).flatten(-2)  # pairs exchanged
    out = torch.addcmul(head * c, swapped, s)
    if width == rot:
        return out
    return torch.cat([y[..., : width - rot], out] if last else [out, y[..., rot:]], dim=-1)


def from_model(kind: str, pe: tuple) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(cos, sin, interleaved) of full rotary width from the ``position_embeddings`` a model hands its attention
    modules (:data:`actlake.architectures.ROPE`)."""
    if kind == "sin_cos_half":  # GPT-J: (sin, cos), one angle per pair
        sin, cos = pe
        return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1), True
    if kind == "complex":  # Llama 4: x_pairs * freqs_cis, pairs (2i, 2i+1), angle i (pe: (freqs_cis, freqs_cis))
        return pe[0].real.repeat_interleave(2, -1), pe[0].imag.repeat_interleave(2, -1), True
    cos, sin = pe
    if kind == "half_negated":  # rotate_half = (x2, -x1): the rotation by -angle
        return cos, -sin, False
    if kind == "half_narrow":  # gpt-oss: rotate-half pairs, one angle per pair
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1), False
    if kind == "interleaved_half":  # GLM: rotate-half (cos, sin), one angle per pair taken and repeated
        half = cos.shape[-1] // 2
        return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1), True
    return cos, sin, kind == "interleaved"
