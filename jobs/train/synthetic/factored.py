"""Measurements for factored representations (METHODS.md §7): effective dimension, affine fits,
factor subspaces and their overlaps. Numpy, float64; R² is sklearn's ``r2_score``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.metrics import r2_score

from actlake.errors import ConfigError


def _matrix(X, name: str) -> np.ndarray:
    """X as a finite float64 (N, D) array with N >= 1, D >= 1."""
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.shape[0] < 1 or X.shape[1] < 1:
        raise ConfigError(f"{name}: expected a non-empty 2-d array (N, D), got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ConfigError(f"{name}: contains NaN or infinite entries")
    return X


def _centred(X) -> np.ndarray:
    X = _matrix(X, "X")
    return X - X.mean(axis=0)  # (N, D)


def explained_variance(X) -> np.ndarray:
    """(min(N, D),) explained-variance ratios of the centred X (N, D), descending; zeros if X is constant."""
    Xc = _centred(X)
    G = Xc.T @ Xc if Xc.shape[0] >= Xc.shape[1] else Xc @ Xc.T  # the smaller Gram matrix
    var = np.clip(np.linalg.eigvalsh(G)[::-1], 0.0, None)  # (min(N, D),)
    total = var.sum()
    return var / total if total > 0 else np.zeros_like(var)


def effective_dimension(X, threshold: float = 0.95) -> int:
    """Smallest k with PCA cumulative explained variance >= threshold (X (N, D) centred); 0 if X is constant."""
    if not 0 < threshold <= 1:
        raise ConfigError(f"threshold: must be in (0, 1], got {threshold!r}")
    ratios = explained_variance(X)
    if ratios.sum() == 0:
        return 0
    cum = np.cumsum(ratios)
    return int(np.argmax(cum >= threshold - 1e-12)) + 1


@dataclass
class AffineFit:
    """Result of a least-squares affine map Y ≈ X A + c."""

    r2: float
    """sklearn ``r2_score(Y, pred, multioutput="variance_weighted")``: 1 - SSE/SST over all outputs."""
    rmse: float
    """sqrt of the mean squared error over all entries of Y."""
    pred: np.ndarray
    """(N, K) fitted values X A + c."""


def affine_fit(X, Y) -> AffineFit:
    """Least squares Y (N, K) or (N,) ≈ X (N, D) A + c, with intercept."""
    X = _matrix(X, "X")
    Y = np.asarray(Y, dtype=np.float64)
    Y = Y[:, None] if Y.ndim == 1 else Y  # (N, K)
    Y = _matrix(Y, "Y")
    if Y.shape[0] != X.shape[0]:
        raise ConfigError(f"X, Y: different numbers of rows, {X.shape[0]} vs {Y.shape[0]}")
    Xa = np.hstack([X, np.ones((len(X), 1))])  # (N, D+1)
    coef = np.linalg.lstsq(Xa, Y, rcond=None)[0]  # (D+1, K)
    pred = Xa @ coef  # (N, K)
    sse = float(((Y - pred) ** 2).sum())
    # constant Y: sklearn's choice, 1.0 for an exact fit, else 0.0
    r2 = float(r2_score(Y, pred, multioutput="variance_weighted"))
    return AffineFit(r2=r2, rmse=float(np.sqrt(sse / Y.size)), pred=pred)


def pca_subspace(X, k: int) -> np.ndarray:
    """(D, k) orthonormal top-k principal directions of the centred X (N, D) (sign: largest entry positive)."""
    Xc = _centred(X)
    if not (isinstance(k, (int, np.integer)) and 1 <= k <= Xc.shape[1]):
        raise ConfigError(f"k: must be an integer in [1, D = {Xc.shape[1]}], got {k!r}")
    _, vecs = np.linalg.eigh(Xc.T @ Xc)  # ascending eigenvalues
    U = vecs[:, ::-1][:, :k]  # (D, k)
    signs = np.sign(U[np.argmax(np.abs(U), axis=0), np.arange(k)])
    return U * np.where(signs == 0, 1.0, signs)


def overlap(U, V, k: int | None = None) -> float:
    """||U[:, :k]^T V[:, :k]||_F^2 / k for orthonormal columns U (D, a), V (D, b): the mean cos^2 of the
    principal angles (0 orthogonal, 1 identical, about k/D at random); k defaults to min(a, b)."""
    U, V = _matrix(U, "U"), _matrix(V, "V")
    if U.shape[0] != V.shape[0]:
        raise ConfigError(f"U, V: different ambient dimensions, {U.shape[0]} vs {V.shape[0]}")
    k = min(U.shape[1], V.shape[1]) if k is None else k
    if not (isinstance(k, (int, np.integer)) and 1 <= k <= min(U.shape[1], V.shape[1])):
        raise ConfigError(f"k: must be an integer in [1, {min(U.shape[1], V.shape[1])}], got {k!r}")
    M = U[:, :k].T @ V[:, :k]  # (k, k)
    return float((M**2).sum() / k)


def overlap_matrix(subspaces: list[np.ndarray], k: int | None = None) -> np.ndarray:
    """(N, N) pairwise overlaps of N subspaces (each (D, k_i) orthonormal); k defaults per pair to min(k_i, k_j)."""
    n = len(subspaces)
    out = np.empty((n, n))
    for i in range(n):
        for j in range(n):
            out[i, j] = overlap(subspaces[i], subspaces[j], k)
    return out


def _dims(state_dims) -> list[int]:
    dims = [int(d) for d in state_dims]
    if not dims or min(dims) < 1:
        raise ConfigError(f"state_dims: expected a non-empty list of positive integers, got {state_dims!r}")
    return dims


def factored_dimension(state_dims) -> int:
    """Sum over factors of d_n - 1: the dimension of the factored prediction."""
    return sum(d - 1 for d in _dims(state_dims))


def joint_dimension(state_dims) -> int:
    """prod(d_n) - 1: the dimension of the joint (tensor-product) prediction."""
    return int(np.prod(_dims(state_dims))) - 1


def position_centre(acts, positions) -> np.ndarray:
    """acts (N, D) minus the mean of the rows at the same position (positions (N,)) -> (N, D)."""
    acts = _matrix(acts, "acts")
    positions = np.asarray(positions)
    if positions.shape != (acts.shape[0],):
        raise ConfigError(f"positions: expected shape ({acts.shape[0]},) to match acts, got {positions.shape}")
    out = acts.copy()
    for p in np.unique(positions):
        rows = positions == p
        out[rows] -= acts[rows].mean(axis=0)
    return out
