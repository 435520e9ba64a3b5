"""Linear probes on h, ĥ, r and [ĥ, r] (METHODS.md §6; seed 003 §3.4, §4.4).

Multinomial logistic regression with class-balanced weights on features standardised with
the training split's mean/std; C chosen by validation macro-F1; macro-F1 reported on test.
Splits: per-class caps (document source: 4000/500/500 per class) or totals over all
classes (next-token type8: 40000/5000/5000).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from actlake.errors import ConfigError

from .metrics import macro_f1


@dataclass
class ProbeResult:
    """Outcome of one probe (one task × layer × representation)."""

    macro_f1: float
    """test macro-F1 at the chosen C (labels: union of test labels and predictions)."""
    val_macro_f1: float
    """validation macro-F1 at the chosen C (NaN when there is no validation split)."""
    n_train: int
    """training samples."""
    n_test: int
    """test samples."""
    classes: list
    """classes seen in training, sorted."""
    C: float
    """chosen inverse regularisation strength."""
    val_by_C: dict = field(default_factory=dict)
    """validation macro-F1 for every C tried."""
    n_val: int = 0
    """validation samples."""
    converged: bool = True
    """False if lbfgs hit max_iter for the chosen C."""


def _labels(labels) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ConfigError(f"labels must be a non-empty 1-D array, got shape {y.shape}")
    return y


def _triple(values, name: str) -> tuple[int, int, int]:
    vals = tuple(values)
    if len(vals) != 3 or not all(isinstance(v, (int, np.integer)) and v >= 0 for v in vals):
        raise ConfigError(f"{name} must be three non-negative integers (train, val, test), got {values!r}")
    return tuple(int(v) for v in vals)


def _allocate(n: int, caps: tuple[int, int, int]) -> tuple[int, int, int]:
    """Counts per split: the caps when n suffices, else shrunk in proportion (val/test rounded down)."""
    total = sum(caps)
    if n >= total:
        return caps
    k_val, k_test = n * caps[1] // total, n * caps[2] // total
    return min(caps[0], n - k_val - k_test), k_val, k_test


def _generator(rng) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def _take(idx: np.ndarray, counts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b, c = counts
    return idx[:a], idx[a:a + b], idx[a + b:a + b + c]


def split_per_class(labels, caps: tuple[int, int, int], rng=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (train, val, test) index arrays (sorted) with at most caps[i] samples per class.

    A class with fewer than sum(caps) samples is split in proportion to the caps.
    ``rng``: a numpy Generator or a seed.
    """
    y, caps, gen = _labels(labels), _triple(caps, "caps"), _generator(rng)
    parts = ([], [], [])
    for c in np.unique(y):
        idx = gen.permutation(np.flatnonzero(y == c))
        for part, chosen in zip(parts, _take(idx, _allocate(idx.size, caps))):
            part.append(chosen)
    return tuple(np.sort(np.concatenate(p)).astype(np.int64) for p in parts)


def split_total(labels, totals: tuple[int, int, int], rng=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Disjoint (train, val, test) index arrays (sorted) of the given total sizes over all classes.

    Uniformly random, not stratified; with fewer than sum(totals) samples the sizes shrink
    in proportion.
    """
    y, totals, gen = _labels(labels), _triple(totals, "totals"), _generator(rng)
    idx = gen.permutation(y.size)
    return tuple(np.sort(p).astype(np.int64) for p in _take(idx, _allocate(y.size, totals)))


def _check_split(n: int, split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(split) != 3:
        raise ConfigError(f"split must be (train_idx, val_idx, test_idx), got {len(split)} parts")
    tr, va, te = (np.asarray(s, dtype=np.int64).ravel() for s in split)
    allidx = np.concatenate([tr, va, te])
    if allidx.size and (allidx.min() < 0 or allidx.max() >= n):
        raise ConfigError(f"split indices must lie in [0, {n}), got range [{allidx.min()}, {allidx.max()}]")
    if np.unique(allidx).size != allidx.size:
        raise ConfigError("split: train, val and test indices must be disjoint and without repeats")
    return tr, va, te


def _fit_one(X, y, C: float, seed: int, max_iter: int) -> tuple[LogisticRegression, bool]:
    clf = LogisticRegression(C=C, class_weight="balanced", max_iter=max_iter, random_state=seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        clf.fit(X, y)
    return clf, not any(issubclass(w.category, ConvergenceWarning) for w in caught)


def fit_probe(X, y, split, Cs=(0.01, 0.1, 1.0), seed: int = 0, max_iter: int = 1000) -> ProbeResult:
    """Probe X (N, F) -> y (N,) on ``split`` = (train, val, test) indices; see the module docstring.

    Ties in validation macro-F1 go to the first C in ``Cs``. With an empty validation split
    ``Cs`` must hold exactly one value.
    """
    X, y = np.asarray(X), _labels(y)
    if X.ndim != 2 or X.shape[0] != y.size:
        raise ConfigError(f"fit_probe: X must be (N, F) with N = len(y) = {y.size}, got {X.shape}")
    tr, va, te = _check_split(y.size, split)
    if np.unique(y[tr]).size < 2 or te.size == 0:
        raise ConfigError(f"fit_probe: need >= 2 classes in train and >= 1 test sample; got "
                          f"{np.unique(y[tr]).size} classes in {tr.size} train, {te.size} test samples")
    Cs = tuple(float(c) for c in Cs)
    if not Cs or any(c <= 0 for c in Cs) or (va.size == 0 and len(Cs) != 1):
        raise ConfigError(f"fit_probe: Cs must be positive and non-empty (one value if val is empty), got {Cs}")
    scaler = StandardScaler().fit(X[tr])
    Xtr, Xva, Xte = (scaler.transform(X[i]) for i in (tr, va, te))
    best, val_by_C = None, {}
    for C in Cs:
        clf, ok = _fit_one(Xtr, y[tr], C, seed, max_iter)
        val_by_C[C] = macro_f1(y[va], clf.predict(Xva)) if va.size else float("nan")
        if best is None or val_by_C[C] > val_by_C[best[0]]:
            best = (C, clf, ok)
    C, clf, ok = best
    return ProbeResult(macro_f1(y[te], clf.predict(Xte)), val_by_C[C], int(tr.size), int(te.size),
                       clf.classes_.tolist(), C, val_by_C, int(va.size), ok)
