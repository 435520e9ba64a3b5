"""External next-hidden-state predictor f_θ (METHODS.md §6; seed 003 §3.1–3.2).

ĥ_{t+1} = f_θ(h_≤t): ONE causal multi-head self-attention layer over h_1..h_t (queries,
keys and values all from the frozen model's hidden states at one layer) followed by an
output projection to d. No MLP, no residual skip, no LayerNorm: the inputs are
standardised per dimension by :class:`PredictorTrainer` instead.

Positions. Attention alone is permutation-invariant over the past, so without position
information the query at t cannot single out h_t (the state to "copy/transform") from
h_1..h_{t-1}. Each head adds an ALiBi-style learned recency bias to its logits,
    logit(m, n) = q_m·k_n / √d_h − s_h (m − n),   s_h = exp(log_slope_h) > 0,
with slopes initialised geometrically from 4 (head 0: ≈98 % of its weight on the last
state) down to 2⁻⁸ (long-range heads); the slopes are trained (no weight decay). This is
relative (window-offset invariant), extrapolates to any T, and needs no extra width; the
content term q·k is unchanged, so heads can still attend by content. We chose it over RoPE
because a RoPE model has to *learn* a recency preference from q/k biases, which is slow
at the paper's learning rate, while the linear test h_{t+1} = A h_t needs it from step 0.

Loss. Targets are standardised too; the optimised loss weights dimension j by
std_j² / mean(std²), so it is proportional to the paper's original-unit MSE/d (eq. 2) and
its optimum is the one R² measures, while gradients stay O(1). Reported MSE and R² are in
original units. Padding: a target h_{t+1} counts only when valid[t] and valid[t+1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import ConfigDict

from actlake.errors import ConfigError
from actlake.jobs.train.training import warmup_cosine_lr
from actlake.train_config import AdamW, Warmup

from .metrics import RunningMoments, fit_standardisation

__all__ = ["EvalResult", "NextStatePredictor", "PredictorConfig", "PredictorTrainer", "default_heads",
           "fit_standardisation", "lr_at", "pair_mask", "run_steps"]


class PredictorConfig(AdamW.with_defaults(lr=3e-4, weight_decay=0.01), Warmup):
    """Architecture and optimisation of the predictor (paper: 32 heads × 128, 30,000 steps); AdamW's
    weight decay applies to weight matrices only (not biases, slopes). Built by code, not read from YAML:
    numbers convert (lax types)."""

    model_config = ConfigDict(strict=False)

    d_model: int
    """width d of the analysed hidden states (input and output width)."""
    n_heads: int = 4
    """attention heads of the predictor."""
    head_dim: int = 64
    """query/key/value width per head."""
    total_steps: int = 2000
    """step at which the cosine decay reaches min_lr_ratio·lr (held there afterwards)."""
    grad_clip: float = 1.0
    """max global gradient L2 norm; 0 disables clipping."""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of lr."""

    def validate(self) -> "PredictorConfig":
        """Raise ConfigError naming the invalid field(s); return self."""
        bad = [k for k in ("d_model", "n_heads", "head_dim", "total_steps") if int(getattr(self, k)) < 1]
        bad += [] if 0 <= self.warmup_steps <= self.total_steps else ["warmup_steps (must be in [0, total_steps])"]
        bad += [] if self.lr > 0 and self.weight_decay >= 0 and self.grad_clip >= 0 else ["lr/weight_decay/grad_clip"]
        bad += [] if 0 <= self.min_lr_ratio <= 1 else ["min_lr_ratio"]
        if bad:
            raise ConfigError(f"PredictorConfig: invalid {', '.join(bad)} in {self!r}")
        return self


def default_heads(model_n_heads: int, model_head_dim: int) -> tuple[int, int]:
    """(n_heads, head_dim) with 4× the q/k/v width of one attention layer of the analysed model.

    Doubles both, which reproduces the paper's 32 × 128 for Pythia-410m (16 × 64).
    """
    if model_n_heads < 1 or model_head_dim < 1:
        raise ConfigError(f"default_heads: need positive sizes, got {model_n_heads} x {model_head_dim}")
    return 2 * model_n_heads, 2 * model_head_dim


def lr_at(step: int, cfg: PredictorConfig) -> float:
    """Learning rate used by optimizer step ``step`` (0-based): ``warmup_cosine_lr`` with the config's
    lr, warmup_steps, total_steps and min_lr_ratio."""
    return warmup_cosine_lr(step, cfg.lr, cfg.warmup_steps, cfg.total_steps, cfg.min_lr_ratio)


def pair_mask(valid: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """(B, T-1) bool: the prediction at t of h_{t+1} counts (both positions valid)."""
    if valid is None:
        return torch.ones(shape[0], shape[1] - 1, dtype=torch.bool)
    return valid[:, :-1] & valid[:, 1:]


class NextStatePredictor(torch.nn.Module):
    """One causal multi-head self-attention layer with learned recency slopes and an output projection."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.qkv = torch.nn.Linear(d_model, 3 * n_heads * head_dim)
        self.out = torch.nn.Linear(n_heads * head_dim, d_model)
        self.log_slope = torch.nn.Parameter(torch.linspace(math.log(4.0), math.log(2.0 ** -8), n_heads))  # (H,)

    def _bias(self, t: int, valid: torch.Tensor | None, device) -> torch.Tensor:
        """(B or 1, H, t, t) additive logits: −s_h (m − n) on allowed keys n ≤ m, −inf elsewhere."""
        pos = torch.arange(t, device=device)
        dist = (pos[:, None] - pos[None, :]).to(self.log_slope.dtype)  # (t, t) m − n
        allowed = (dist >= 0)[None, None]  # (1, 1, t, t) causal
        if valid is not None and not bool(valid.all()):
            # padded keys are hidden; the diagonal stays so that no row is empty (no NaN)
            eye = torch.eye(t, dtype=torch.bool, device=device)
            allowed = allowed & (valid[:, None, None, :] | eye)  # (B, 1, t, t)
        bias = -self.log_slope.exp()[None, :, None, None] * dist  # (1, H, t, t)
        return torch.where(allowed, bias, float("-inf"))

    def forward(self, h: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, T, d), valid (B, T) bool or None -> ĥ (B, T-1, d); ĥ[:, t] predicts h[:, t+1] from h[:, :t+1]."""
        if h.dim() != 3 or h.shape[1] < 2:
            raise ConfigError(f"NextStatePredictor expects h of shape (B, T>=2, d), got {tuple(h.shape)}")
        x = h[:, :-1]  # (B, T', d): the last state is only ever a target
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, T', d_h)
        vmask = None if valid is None else valid[:, :-1].to(torch.bool)
        bias = self._bias(t, vmask, x.device)  # (B or 1, H, T', T')
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=bias.to(qkv.dtype))  # (B, H, T', d_h)
        return self.out(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T', d)


@dataclass
class EvalResult:
    """Held-out evaluation of the predictor, original units."""

    mse: float
    """mean over valid targets of ‖h_{t+1} − ĥ_{t+1}‖² / d."""
    r2: float
    """1 − mse / Var, Var = mean per-dimension population variance of the valid targets: sklearn's
    ``r2_score(..., multioutput="variance_weighted")``; constant targets: 1.0 for exact predictions, else 0.0."""
    mse_by_position: np.ndarray
    """(T-1,) mse per position; index t (0-based) is the prediction of h[:, t+1]; NaN if no valid target."""
    residual_norm: np.ndarray
    """(N, T-1) float32 ‖r_{t+1}‖ per window and position; NaN where the target is not valid."""
    var: float = float("nan")
    """the Var of the R² denominator."""
    n_targets: int = 0
    """number of valid (window, position) targets."""

def _cpu(obj):
    """Recursively detach tensors to CPU copies (checkpoints load on any device)."""
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj


class PredictorTrainer:
    """Model + AdamW + step counter as one plain object: one ``train_step`` is one optimizer step.

    ``state_dict`` holds only tensors and builtins (``torch.load(weights_only=True)`` reads it)
    and resumes bit-for-bit: model, optimizer moments, step, mean/std and the batch generator.
    """

    def __init__(self, cfg: PredictorConfig, mean: np.ndarray, std: np.ndarray, seed: int = 0,
                 device: str | torch.device | None = None):
        self.cfg = cfg.validate()
        self.seed = int(seed)
        """seed of the model initialisation and of ``generator``."""
        self.device = torch.device(device or "cpu")
        self._set_standardisation(mean, std)
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
            torch.manual_seed(self.seed)
            self.model = NextStatePredictor(cfg.d_model, cfg.n_heads, cfg.head_dim).to(self.device)
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr_at(0, cfg))
        self.generator = torch.Generator().manual_seed(self.seed)
        """CPU generator for ``sample_indices`` (part of the checkpoint)."""
        self.step = 0
        """optimizer steps taken so far."""

    def _set_standardisation(self, mean, std) -> None:
        mean, std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        d = self.cfg.d_model
        if mean.shape != (d,) or std.shape != (d,):
            raise ConfigError(f"PredictorTrainer: mean {mean.shape} and std {std.shape} must be ({d},)")
        if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
            raise ConfigError("PredictorTrainer: mean must be finite and std finite and > 0")
        self.mean, self.std = mean, std
        self._mean = torch.tensor(mean, dtype=torch.float32, device=self.device)  # (d,)
        self._std = torch.tensor(std, dtype=torch.float32, device=self.device)  # (d,)
        self._w = torch.tensor(std ** 2 / np.mean(std ** 2), dtype=torch.float32, device=self.device)  # (d,)

    @property
    def lr(self) -> float:
        """Learning rate the next ``train_step`` will use."""
        return lr_at(self.step, self.cfg)

    def _inputs(self, h, valid) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = torch.as_tensor(h)
        if h.dim() != 3 or h.shape[1] < 2 or h.shape[2] != self.cfg.d_model:
            raise ConfigError(f"expected h of shape (B, T>=2, {self.cfg.d_model}), got {tuple(h.shape)}")
        if valid is not None:
            valid = torch.as_tensor(valid)
            if tuple(valid.shape) != tuple(h.shape[:2]):
                raise ConfigError(f"valid {tuple(valid.shape)} must be (B, T) = {tuple(h.shape[:2])}")
            valid = valid.to(self.device, torch.bool)
        return h.to(self.device, torch.float32), valid

    def train_step(self, h, valid=None) -> float:
        """One AdamW step on a batch h (B, T, d); returns its original-unit MSE/d before the step."""
        h, valid = self._inputs(h, valid)
        self.model.train()
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.cfg)
        z = (h - self._mean) / self._std  # (B, T, d)
        err = (z[:, 1:] - self.model(z, valid)) ** 2  # (B, T-1, d) standardised units
        m = pair_mask(valid, tuple(h.shape[:2])).to(self.device)  # (B, T-1)
        n = m.sum()
        if int(n) == 0:
            raise ConfigError("train_step: the batch has no valid (t, t+1) pair")
        loss = ((err * self._w).mean(-1) * m).sum() / n
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach()) * float(np.mean(self.std ** 2))

    def sample_indices(self, n: int, batch_size: int) -> np.ndarray:
        """(batch_size,) window indices drawn uniformly with replacement from ``generator``."""
        if n < 1 or batch_size < 1:
            raise ConfigError(f"sample_indices: need n >= 1 and batch_size >= 1, got {n}, {batch_size}")
        return torch.randint(n, (batch_size,), generator=self.generator).numpy()

    @torch.no_grad()
    def _batches(self, h, valid, batch_size: int):
        """Yield (slice, z (b,T,d), ẑ (b,T-1,d), pair mask (b,T-1)) over h in order, eval mode."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.model.eval()
        for i in range(0, len(h), batch_size):
            sl = slice(i, min(i + batch_size, len(h)))
            hb, vb = self._inputs(h[sl], None if valid is None else valid[sl])
            z = (hb - self._mean) / self._std  # (b, T, d)
            yield sl, z, self.model(z, vb), pair_mask(vb, tuple(hb.shape[:2])).to(self.device)

    def evaluate(self, h, valid=None, batch_size: int = 64) -> EvalResult:
        """MSE, R², per-position MSE and ‖r‖ on windows h (N, T, d) (no gradients)."""
        n_win, t = len(h), int(h.shape[1])
        sse, cnt = np.zeros(t - 1), np.zeros(t - 1)
        norms = np.full((n_win, t - 1), np.nan, dtype=np.float32)
        mom = RunningMoments(self.cfg.d_model)  # of the standardised targets
        for sl, z, zhat, m in self._batches(h, valid, batch_size):
            sq = (((z[:, 1:] - zhat) * self._std).double() ** 2).sum(-1)  # (b, T-1) ‖r‖², original units
            sq = torch.where(m, sq, 0.0).cpu().numpy()
            mk = m.cpu().numpy()
            sse += sq.sum(0)
            cnt += mk.sum(0)
            norms[sl] = np.where(mk, np.sqrt(sq), np.nan)
            mom.update(z[:, 1:][m].double().cpu().numpy())
        if mom.count < 2:
            raise ConfigError(f"evaluate: need at least 2 valid targets, got {mom.count}")
        d = self.cfg.d_model
        mse = float(sse.sum() / (cnt.sum() * d))
        var = float(np.mean(self.std ** 2 * mom.variance))  # Var_j(h) = std_j² Var_j(z)
        with np.errstate(invalid="ignore", divide="ignore"):
            by_pos = np.where(cnt > 0, sse / (cnt * d), np.nan)
        # R² = sklearn's r2_score(targets, predictions, multioutput="variance_weighted"), streamed as 1 − MSE/Var;
        # constant targets as sklearn has them: 1.0 for exact predictions, else 0.0
        r2 = 1.0 - mse / var if var > 0 else (1.0 if mse == 0 else 0.0)
        return EvalResult(mse, r2, by_pos, norms, var, int(mom.count))

    def predict(self, h, valid=None, batch_size: int = 64) -> np.ndarray:
        """ĥ (N, T-1, d) float32 in original units; ĥ[:, t] predicts h[:, t+1]; NaN where not a valid target."""
        out = np.empty((len(h), int(h.shape[1]) - 1, self.cfg.d_model), dtype=np.float32)
        for sl, _, zhat, m in self._batches(h, valid, batch_size):
            hhat = zhat * self._std + self._mean  # (b, T-1, d)
            out[sl] = torch.where(m[..., None], hhat, float("nan")).cpu().numpy()
        return out

    def state_dict(self) -> dict:
        """Everything needed to resume exactly; CPU tensors and builtins only."""
        return {"cfg": self.cfg.model_dump(), "seed": self.seed, "step": self.step,
                "mean": torch.from_numpy(self.mean.copy()), "std": torch.from_numpy(self.std.copy()),
                "model": _cpu(self.model.state_dict()), "optimizer": _cpu(self.optimizer.state_dict()),
                "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a ``state_dict``; the config must equal this trainer's (ConfigError names the fields)."""
        mine = self.cfg.model_dump()
        diff = sorted(k for k in set(mine) | set(sd["cfg"]) if mine.get(k) != sd["cfg"].get(k))
        if diff:
            raise ConfigError("PredictorTrainer.load_state_dict: checkpoint config differs in "
                              + ", ".join(f"{k} ({sd['cfg'].get(k)} vs {mine.get(k)})" for k in diff))
        self._set_standardisation(sd["mean"].numpy(), sd["std"].numpy())
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])
        self.step = int(sd["step"])
        self.seed = int(sd["seed"])
        self.generator.set_state(sd["generator"])


def run_steps(trainer: PredictorTrainer, h, valid=None, n_steps: int = 1, batch_size: int = 32) -> list[float]:
    """``n_steps`` train steps on batches of h (N, T, d) drawn by ``trainer.sample_indices``; the losses."""
    losses = []
    for _ in range(n_steps):
        idx = trainer.sample_indices(len(h), batch_size)
        losses.append(trainer.train_step(h[idx], None if valid is None else valid[idx]))
    return losses
