"""The models trained on synthetic processes, saved and loaded as Hugging Face-style folders.

* ``transformer``: transformers' GPT2LMHeadModel (``save_pretrained`` / ``from_pretrained``).
* ``rnn`` / ``lstm``: a small recurrent LM with the same two methods (config.json + model.safetensors).

``final_residual`` returns what the analysis reads: the final residual stream, i.e. the input of
GPT-2's final layer norm (captured with a hook removed in ``finally``), or the top recurrent layer's
hidden state.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from actlake.jobs.train.synthetic.config import SyntheticModelConfig


class RecurrentLM(nn.Module):
    """Embedding -> multi-layer RNN/LSTM -> linear head."""

    def __init__(self, arch: str, vocab_size: int, hidden: int, n_layers: int):
        super().__init__()
        self.config = {"arch": arch, "vocab_size": vocab_size, "hidden": hidden, "n_layers": n_layers}
        self.embed = nn.Embedding(vocab_size, hidden)
        rnn = nn.LSTM if arch == "lstm" else nn.RNN
        self.rnn = rnn(hidden, hidden, num_layers=n_layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))  # (B, T, hidden)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(input_ids))  # (B, T, V)

    def save_pretrained(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "actlake_recurrent", **self.config}, indent=2))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, folder / "model.safetensors")

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "RecurrentLM":
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("model_type")
        model = cls(**cfg)
        model.load_state_dict(load_file(folder / "model.safetensors"))
        return model


def build_model(cfg: SyntheticModelConfig, arch: str, vocab_size: int, seed: int) -> nn.Module:
    """A freshly initialised model; ``vocab_size`` includes BOS."""
    torch.manual_seed(seed)
    if arch == "transformer":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=vocab_size, n_positions=cfg.context, n_embd=cfg.d_model, n_layer=cfg.n_layers,
                            n_head=cfg.n_heads, n_inner=cfg.d_mlp, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
        return GPT2LMHeadModel(config)
    return RecurrentLM(arch, vocab_size, cfg.d_model, cfg.n_layers)


def load_model(folder: str | Path) -> nn.Module:
    folder = Path(folder)
    kind = json.loads((folder / "config.json").read_text()).get("model_type")
    if kind == "actlake_recurrent":
        return RecurrentLM.from_pretrained(folder)
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(folder)


def logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T, V); ``model`` may be wrapped in DistributedDataParallel."""
    if isinstance(getattr(model, "module", model), RecurrentLM):
        return model(input_ids)
    return model(input_ids=input_ids).logits


@torch.no_grad()
def final_residual(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Final residual stream (B, T, D): GPT-2's input to ``ln_f``, or the top recurrent layer."""
    if isinstance(model, RecurrentLM):
        return model.hidden(input_ids)
    captured = []
    handle = model.transformer.ln_f.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
    try:
        model.transformer(input_ids=input_ids)
    finally:
        handle.remove()
    return captured[0]


def with_bos(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """(B, L) -> (B, L): [BOS, x1 .. x(L-1)], the model input predicting x1 .. xL."""
    bos = torch.full((tokens.shape[0], 1), bos_id, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([bos, tokens[:, :-1]], dim=1)
