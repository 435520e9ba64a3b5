"""A worker's first batch, checked against the model's own numbers: a declaration that does not match the
model (a wrong q/k/v layout, RoPE layout, a missing norm, attention outside the interface, a logit
transform not declared) stops the analyses it would make wrong, before anything is written.

- key path: k rebuilt from x along the declared path (:mod:`actlake.architectures`: W_K, b_K, key norm,
  RoPE) equals the k the kernel received (what the contributions assume);
- attention: the engine's weights times V equal the kernel's output on every valid query (softcapping,
  sinks, position biases or masks the engine does not know change it);
- layers: every attention layer of the model was recorded (call-order layers: the pass made the declared number of
  attention calls; more stop the batch at once);
- surprisal: equals -log softmax of the model's own logits (its full forward pass, one sequence);
- hidden states: those the block hooks hand the analyses equal the model's ``output_hidden_states`` (the same pass).

Tolerances are relative to the largest value compared: float32 models 1e-3 (they agree to about 1e-6),
16-bit models 3e-2 (the model rounds k and its output to 2^-8); a wrong declaration is off by O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actlake.analysis.engine import rope
from actlake.analysis.engine.attention_weights import explicit_products
from actlake.errors import AnalysisError


@dataclass
class SelfCheck:
    dtype: torch.dtype
    attention: list[str]
    """Names of the enabled attention analyses (what a wrong attention read makes wrong)."""
    key_path: list[str]
    """Names of those that use the key path (W_K, b_K, the key norm, RoPE: the contributions)."""
    hidden: list[str] = field(default_factory=list)
    """Names of the enabled analyses that read hidden states."""
    failures: list[str] = field(default_factory=list)
    _layers: dict = field(default_factory=dict)

    @property
    def tolerance(self) -> float:
        return 1e-3 if self.dtype in (torch.float32, torch.float64) else 3e-2

    def layer(self, lq, t: dict) -> None:
        """One recorded layer (``t``: the recorder's tensors, its value among them)."""
        self._layers[lq.layer] = lq
        if lq.x is None or lq.w_key is None:
            return
        k = torch.einsum("btd,hdk->bhtk", lq.x, lq.w_key)  # (B, H_kv, T, d_h)
        if lq.b_key is not None:
            k = k + lq.b_key[None, :, None]
        k = lq.scale_keys(k, per_query_head=False)
        if lq.key_shift is not None:  # a key LayerNorm's bias, after its 1 / r_n; clipped keys' correction per key
            k = k + (lq.key_shift if lq.shift_per_token else lq.key_shift[None, :, None]).to(k.dtype)
        if lq.cos is not None:
            k = rope.apply(k, rope.factors(lq.cos, lq.sin, 1.0, *lq.unrotation[2:]))
        if lq.key_gain is not None:  # a key norm after RoPE: its gain multiplies the rotated k
            k = k * lq.key_gain[None, :, None].to(k.dtype)
        self._compare("the key path (k rebuilt from the key projection's input along the declared path)",
                      lq.layer, k, lq.key, lq.valid, self.key_path)

    def kernel_output(self, layer: int, value: torch.Tensor, output: torch.Tensor) -> None:
        """The kernel's attention output (B, T, H, d_v) of ``layer``, against the engine's weights times V."""
        lq = self._layers.get(layer)
        if lq is None or value is None:
            return
        ours = explicit_products(lq, {"output"}, value.detach().float(), lq.max_elements)["output"]
        self._compare("the attention weights (the engine's weights times V against the model's attention output)",
                      layer, ours, output.detach().float().transpose(1, 2), lq.valid, self.attention)

    def layers(self, attention_layers: list[int], seen: set) -> None:
        missing = sorted(set(attention_layers) - seen)
        if missing and self.attention:
            self.failures.append(f"attention layers {missing} of {len(attention_layers)} never called the transformers "
                                 "attention interface (nothing recorded there; for call-order layers: the pass made "
                                 "fewer attention calls than its config declares); affected: "
                                 + ", ".join(self.attention))

    def surprisal(self, ours: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """``ours`` (T,) float32 surprisal of one sequence against -log softmax of the model's ``logits`` (T, V)."""
        lp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, ids[1:, None].to(logits.device))[:, 0]
        keep = (mask[1:].bool() & mask[:-1].bool()).to(logits.device)
        ref, got = -lp[keep], ours[1:].to(logits.device)[keep]
        if ref.numel() == 0:
            return
        err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0))
        if not err <= self.tolerance:
            self.failures.append(f"surprisal differs from the model's own logits by {err:.2e} (relative; tolerance "
                                 f"{self.tolerance:g}): an output-logit transform is not declared; affected: surprisal")

    def hidden_states(self, ours: dict, theirs) -> None:
        """``ours`` {layer: (T, d)} from the block hooks against the model's ``output_hidden_states`` (1, T, d) each."""
        if not self.hidden:
            return
        odd = next((i for i, h in enumerate(theirs) if h.dim() != 3 or h.shape[0] != 1), None)
        if odd is None:
            odd = next((i for i, h in ours.items() if h.dim() != 2), None)
        if odd is not None:
            shape = tuple(theirs[odd].shape) if odd < len(theirs) else tuple(ours[odd].shape)
            self.failures.append(f"hidden state {odd} has shape {shape}, not one vector per token of one sequence "
                                 f"(several residual streams?); affected: {', '.join(self.hidden)}")
            return
        if sorted(ours) != list(range(len(theirs))):
            self.failures.append(f"the block hooks gave hidden states {sorted(ours)}, the model {len(theirs)} of them; "
                                 f"affected: {', '.join(self.hidden)}")
            return
        for layer, h in enumerate(theirs):
            a, b = ours[layer].float(), h[0].float().to(ours[layer].device)
            err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
            if not err <= self.tolerance:
                self.failures.append(f"hidden state {layer}: the block hooks' differs from the model's output_hidden_states "
                                     f"by {err:.2e} of the largest value; affected: {', '.join(self.hidden)}")

    def _compare(self, what: str, layer: int, ours, theirs, valid, affected: list[str]) -> None:
        keep = valid.bool()[:, None, :, None].to(ours.device)
        a, b = ours.float() * keep, theirs.float().to(ours.device) * keep
        if not bool(torch.isfinite(b).all()):
            return  # inf/NaN tokens leave the statistics anyway
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        if not err <= self.tolerance:
            self.failures.append(f"layer {layer}: {what} differs by {err:.2e} of the largest value (tolerance "
                                 f"{self.tolerance:g}); affected: {', '.join(affected) or 'none enabled'}")

    def raise_if_failed(self, model_type: str) -> None:
        if self.failures:
            raise AnalysisError(f"self-check of the first batch failed for model_type {model_type!r}: the numbers "
                                "would be silently wrong, so nothing is written: " + "; ".join(self.failures[:4])
                                + (f" (and {len(self.failures) - 4} more)" if len(self.failures) > 4 else ""))
