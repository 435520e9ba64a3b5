"""Metrics of the predictable/novel decomposition (METHODS.md §6): Spearman, macro-F1, running moments.

Spearman is ``scipy.stats.spearmanr``, macro-F1 sklearn's ``f1_score(average="macro")``, behind thin
guards that keep this module's errors (``ConfigError``) and NaN conventions; R² is sklearn's
``r2_score`` (``multioutput="variance_weighted"``), streamed in ``PredictorTrainer.evaluate``.
All computations are float64. Also: ``RunningMoments`` (a mergeable streaming statistic) and
per-dimension standardisation of hidden states.
"""

from __future__ import annotations

import warnings

import numpy as np

from actlake.errors import ConfigError


class RunningMoments:
    """Mergeable per-dimension count/mean/M2 over rows, float64 (Chan et al.'s pairwise merge); host numpy,
    one group (the extraction job's grouped, on-device counterpart is ``actlake.analysis.engine.moments.Moments``)."""

    def __init__(self, d: int):
        self.count = 0
        """number of rows seen."""
        self.mean = np.zeros(d)
        """(d,) running mean."""
        self.m2 = np.zeros(d)
        """(d,) sum of squared deviations from the mean."""

    def update(self, x: np.ndarray) -> None:
        """Add rows x (n, d); two-pass within the batch, so large means do not cancel."""
        x = np.asarray(x, dtype=np.float64).reshape(-1, self.mean.shape[0])
        n_b = x.shape[0]
        if n_b == 0:
            return
        mean_b = x.mean(0)
        m2_b = ((x - mean_b) ** 2).sum(0)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (self.count * n_b / n)
        self.count = n

    @property
    def variance(self) -> np.ndarray:
        """(d,) population variance (ddof=0); NaN before any row."""
        return self.m2 / self.count if self.count else np.full_like(self.m2, np.nan)


def _numpy(x, dtype) -> np.ndarray:
    """A numpy copy/view of an array or (any-device) torch tensor."""
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x, dtype=dtype)


def fit_standardisation(h_iter, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension mean and std (float64, population) over the valid tokens of an iterable.

    Items are h (B, T, d) or (h, valid) with valid (B, T) bool. std below ``eps`` is set to 1.
    """
    mom = None
    for item in h_iter:
        h, valid = item if isinstance(item, (tuple, list)) else (item, None)
        h = _numpy(h, np.float64)
        if h.ndim != 3 or (valid is not None and np.shape(valid) != h.shape[:2]):
            raise ConfigError(f"fit_standardisation expects h (B, T, d) and valid (B, T), got {h.shape}"
                              f" and {None if valid is None else tuple(np.shape(valid))}")
        mom = mom or RunningMoments(h.shape[-1])
        mom.update(h.reshape(-1, h.shape[-1]) if valid is None else h[_numpy(valid, bool)])
    if mom is None or mom.count < 2:
        raise ConfigError("fit_standardisation: fewer than 2 valid tokens in the training set")
    std = np.sqrt(mom.variance)
    return mom.mean.copy(), np.where(std < eps, 1.0, std)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties) of two 1-D arrays, ``scipy.stats.spearmanr``.

    NaN when either input is constant. Inputs must be finite (mask them first).
    """
    from scipy.stats import ConstantInputWarning, spearmanr

    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ConfigError(f"spearman: x has {x.size} values, y has {y.size}")
    if x.size < 2:
        raise ConfigError(f"spearman needs at least 2 pairs, got {x.size}")
    # scipy would propagate NaN (and rank inf like any value): refuse both, as callers must mask first
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ConfigError("spearman: inputs contain NaN or inf; select the valid pairs first")
    with warnings.catch_warnings():  # a constant input is an expected NaN here, not a warning
        warnings.simplefilter("ignore", ConstantInputWarning)
        return float(spearmanr(x, y).statistic)


def spearman_by_position(norms: np.ndarray, surprisal: np.ndarray, valid: np.ndarray | None = None,
                         min_pairs: int = 3) -> np.ndarray:
    """Spearman between ‖r‖ and surprisal at each position over windows.

    norms, surprisal, valid: (N, P). Returns (P,) float64; NaN where fewer than
    ``min_pairs`` valid finite pairs or a constant column.
    """
    norms, surprisal = np.asarray(norms, dtype=np.float64), np.asarray(surprisal, dtype=np.float64)
    if norms.ndim != 2 or norms.shape != surprisal.shape:
        raise ConfigError(f"spearman_by_position: norms {norms.shape} and surprisal {surprisal.shape} "
                          "must both be (N, P)")
    ok = np.isfinite(norms) & np.isfinite(surprisal)  # (N, P)
    if valid is not None:
        if np.shape(valid) != norms.shape:
            raise ConfigError(f"spearman_by_position: valid {np.shape(valid)} must be {norms.shape}")
        ok &= np.asarray(valid, dtype=bool)
    out = np.full(norms.shape[1], np.nan)
    for p in range(norms.shape[1]):
        sel = ok[:, p]
        if sel.sum() >= max(min_pairs, 2):
            out[p] = spearman(norms[sel, p], surprisal[sel, p])
    return out


def macro_f1(y_true, y_pred, labels=None) -> float:
    """Unweighted mean over labels of F1 = 2TP / (2TP + FP + FN); 0 for a label never true nor predicted.

    ``labels`` defaults to the sorted union of y_true and y_pred: sklearn
    ``f1_score(y_true, y_pred, labels=labels, average="macro", zero_division=0)``.
    Labels are class labels (sklearn refuses continuous floats and a mix of strings and numbers).
    """
    from sklearn.metrics import f1_score

    t, p = np.asarray(y_true).ravel(), np.asarray(y_pred).ravel()
    if t.shape != p.shape:
        raise ConfigError(f"macro_f1: y_true has {t.size} labels, y_pred has {p.size}")
    if t.size == 0:
        raise ConfigError("macro_f1: no samples")
    return float(f1_score(t, p, labels=None if labels is None else list(labels), average="macro", zero_division=0))
