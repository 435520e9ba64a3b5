"""Measurements for factored representations (METHODS.md §7) against closed forms and sklearn."""
import numpy as np
import pytest
from sklearn.decomposition import PCA
from sklearn.linear_model import LinearRegression
from sklearn.metrics import mean_squared_error, r2_score

from actlake.errors import ConfigError
from actlake.jobs.train.synthetic.factored import (
    affine_fit,
    effective_dimension,
    explained_variance,
    factored_dimension,
    joint_dimension,
    overlap,
    overlap_matrix,
    pca_subspace,
    position_centre,
)


def _orthonormal(rng, D, k):
    return np.linalg.qr(rng.standard_normal((D, k)))[0]  # (D, k)


def test_overlap_orthogonal_identical_and_random():
    rng, D, k = np.random.default_rng(0), 40, 3
    eye = np.eye(D)
    assert overlap(eye[:, :k], eye[:, k:2 * k]) == pytest.approx(0.0, abs=1e-15)
    U = _orthonormal(rng, D, k)
    assert overlap(U, U @ _orthonormal(rng, k, k)) == pytest.approx(1.0, abs=1e-12)  # same subspace, other basis
    vals = np.array([overlap(_orthonormal(rng, D, k), _orthonormal(rng, D, k)) for _ in range(2000)])
    se = vals.std() / np.sqrt(len(vals))
    assert abs(vals.mean() - k / D) < 4 * se  # E = k/D exactly for uniformly random subspaces
    M = overlap_matrix([eye[:, :2], eye[:, 2:5], U])
    np.testing.assert_allclose(np.diag(M), 1.0, atol=1e-12)
    np.testing.assert_allclose(M, M.T, atol=1e-12)
    assert M[0, 1] == 0.0


def test_affine_fit_matches_sklearn():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((300, 6))
    Y = X @ rng.standard_normal((6, 3)) * [1, 5, 0.1] + [1, -2, 3] + rng.standard_normal((300, 3)) * [0.5, 1, 0.3]
    fit = affine_fit(X, Y)
    np.testing.assert_allclose(fit.pred, LinearRegression().fit(X, Y).predict(X), atol=1e-10)
    assert fit.r2 == pytest.approx(r2_score(Y, fit.pred, multioutput="variance_weighted"), rel=1e-12)
    assert fit.rmse == pytest.approx(np.sqrt(mean_squared_error(Y, fit.pred)), rel=1e-12)
    exact = affine_fit(X, X @ rng.standard_normal((6, 2)) + 7.0)
    assert exact.r2 == pytest.approx(1.0, abs=1e-12) and exact.rmse < 1e-10
    assert affine_fit(X, Y[:, 0]).pred.shape == (300, 1)


def test_effective_dimension_known_rank_and_spectrum():
    rng, N, D = np.random.default_rng(2), 500, 20
    low_rank = rng.standard_normal((N, 3)) @ rng.standard_normal((3, D)) + 4.0
    assert (explained_variance(low_rank) > 1e-10).sum() == 3
    assert effective_dimension(low_rank, 1.0) == 3
    var = np.array([0.5, 0.3, 0.15, 0.05])
    Q = np.linalg.qr(rng.standard_normal((N, 4)) - rng.standard_normal((N, 4)).mean(0))[0]
    Q = np.linalg.qr(Q - Q.mean(0))[0]  # centred orthonormal columns
    X = (Q * np.sqrt(var)) @ _orthonormal(rng, D, 4).T + rng.standard_normal(D)  # PCA variances are var exactly
    ev = explained_variance(X)
    np.testing.assert_allclose(ev[:4], var, atol=1e-12)
    np.testing.assert_allclose(ev[4:], 0.0, atol=1e-12)
    for threshold, k in [(0.5, 1), (0.8, 2), (0.9, 3), (0.95, 3), (0.96, 4)]:
        assert effective_dimension(X, threshold) == k, threshold
    noisy = rng.standard_normal((200, 8)) * np.arange(1, 9)
    np.testing.assert_allclose(explained_variance(noisy), PCA().fit(noisy).explained_variance_ratio_, atol=1e-12)


def test_pca_subspace_and_position_centre():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((400, 10)) * np.linspace(5, 1, 10) @ _orthonormal(rng, 10, 10)
    V = pca_subspace(X, 3)
    np.testing.assert_allclose(V.T @ V, np.eye(3), atol=1e-12)
    ref = PCA(3).fit(X).components_.T  # (10, 3)
    for j in range(3):
        assert abs(V[:, j] @ ref[:, j]) == pytest.approx(1.0, abs=1e-8)
    pos = rng.integers(0, 5, 400)
    C = position_centre(X, pos)
    for p in range(5):
        np.testing.assert_allclose(C[pos == p], X[pos == p] - X[pos == p].mean(0), atol=1e-12)
    assert (factored_dimension([3, 3, 3, 3, 3]), joint_dimension([3, 3, 3, 3, 3])) == (10, 242)


def test_errors_name_the_parameter():
    X = np.zeros((5, 3))
    for make, pattern in [(lambda: effective_dimension(X, 0.0), "threshold"),
                          (lambda: overlap(np.eye(4)[:, :2], np.eye(4)[:, :2], k=3), "k: must be"),
                          (lambda: affine_fit(X, np.zeros(4)), "X, Y"),
                          (lambda: pca_subspace(np.ones(3), 1), "X: expected"),
                          (lambda: position_centre(X, [0, 1]), "positions")]:
        with pytest.raises(ConfigError, match=pattern):
            make()
