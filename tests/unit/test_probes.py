"""Linear probes and splits (METHODS.md §6): caps, disjointness, separable vs random labels, macro-F1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actlake.errors import ConfigError
from actlake.jobs.train.predictor.metrics import macro_f1
from actlake.jobs.train.predictor.probes import fit_probe, split_per_class, split_total

torch.set_num_threads(1)


def imbalanced_labels() -> np.ndarray:
    labels = np.array(["a"] * 1000 + ["b"] * 50 + ["c"] * 5 + ["d"] * 140)
    return np.random.default_rng(0).permutation(labels)


def assert_disjoint(*parts):
    allidx = np.concatenate(parts)
    assert np.unique(allidx).size == allidx.size


def test_split_per_class_respects_caps_and_is_disjoint():
    y = imbalanced_labels()
    caps = (100, 20, 20)
    tr, va, te = split_per_class(y, caps, np.random.default_rng(1))
    assert_disjoint(tr, va, te)
    for part, cap in zip((tr, va, te), caps):
        _, counts = np.unique(y[part], return_counts=True)
        assert (counts <= cap).all()
    assert [np.sum(y[p] == "a") for p in (tr, va, te)] == [100, 20, 20]  # enough samples: the caps
    assert [np.sum(y[p] == "d") for p in (tr, va, te)] == [100, 20, 20]  # exactly sum(caps)
    assert [np.sum(y[p] == "b") for p in (tr, va, te)] == [36, 7, 7]  # 50 split 100:20:20
    assert sum(np.sum(y[p] == "c") for p in (tr, va, te)) <= 5
    again = split_per_class(y, caps, 1)  # a seed gives the same as a Generator of that seed
    assert all(np.array_equal(a, b) for a, b in zip((tr, va, te), again))


def test_split_total_sizes_and_disjoint():
    y = imbalanced_labels()
    tr, va, te = split_total(y, (800, 100, 100), rng=0)
    assert (tr.size, va.size, te.size) == (800, 100, 100)
    assert_disjoint(tr, va, te)
    tr, va, te = split_total(y, (4000, 500, 500), rng=0)  # only 1195: shrunk in proportion
    assert (va.size, te.size) == (119, 119) and tr.size == 1195 - 238
    assert_disjoint(tr, va, te)


@pytest.mark.parametrize("caps", [(1, 2), (1, -2, 3), (1.5, 1, 1)])
def test_bad_caps_raise(caps):
    with pytest.raises(ConfigError, match="caps"):
        split_per_class(np.zeros(10), caps, 0)


def test_separable_data_gives_macro_f1_one():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 1200)
    centres = rng.standard_normal((4, 8)) * 10.0
    X = centres[y] + rng.standard_normal((1200, 8))
    res = fit_probe(X, y, split_per_class(y, (150, 50, 50), rng))
    assert res.macro_f1 > 0.99 and res.val_macro_f1 > 0.99
    assert res.classes == [0, 1, 2, 3] and res.n_train == 600 and res.n_test == 200 and res.n_val == 200


def test_random_labels_give_chance():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 3000)
    X = rng.standard_normal((3000, 10))
    res = fit_probe(X, y, split_total(y, (2000, 400, 600), rng))
    assert 0.15 < res.macro_f1 < 0.35, res.macro_f1  # chance is 1/4 for 4 balanced classes


def test_fit_probe_matches_sklearn_pipeline():
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    rng = np.random.default_rng(2)
    y = rng.integers(0, 3, 900)
    X = (rng.standard_normal((900, 6)) + 0.6 * np.eye(3, 6)[y]) * 10.0 ** np.arange(-2, 4)  # scales differ
    split = split_per_class(y, (200, 50, 50), rng)
    res = fit_probe(X, y, split, Cs=(0.001, 0.1, 10.0))
    assert res.C in (0.001, 0.1, 10.0) and res.val_macro_f1 == max(res.val_by_C.values())
    tr, va, te = split
    sc = StandardScaler().fit(X[tr])
    clf = LogisticRegression(C=res.C, class_weight="balanced", max_iter=1000).fit(sc.transform(X[tr]), y[tr])
    assert res.macro_f1 == pytest.approx(brute_macro_f1(y[te], clf.predict(sc.transform(X[te]))), abs=1e-9)


def test_fit_probe_errors():
    y = np.array([0, 0, 1, 1, 0, 1])
    X = np.zeros((6, 2))
    with pytest.raises(ConfigError, match="X must be"):
        fit_probe(X[:5], y, ([0, 2], [1], [3]))
    with pytest.raises(ConfigError, match="2 classes"):
        fit_probe(X, y, ([0, 1], [2], [3]))
    with pytest.raises(ConfigError, match="disjoint"):
        fit_probe(X, y, ([0, 2], [2], [3]))
    with pytest.raises(ConfigError, match=r"\[0, 6\)"):
        fit_probe(X, y, ([0, 2], [1], [9]))


def brute_macro_f1(t, p, labels=None) -> float:
    """Macro-F1 from its definition, in plain Python: per label 2TP / (2TP + FP + FN) by counting, 0 if undefined."""
    t, p = list(t), list(p)
    labels = sorted(set(t) | set(p)) if labels is None else list(labels)
    scores = []
    for c in labels:
        tp = sum(a == c and b == c for a, b in zip(t, p))
        fp = sum(a != c and b == c for a, b in zip(t, p))
        fn = sum(a == c and b != c for a, b in zip(t, p))
        scores.append(2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 0.0)
    return sum(scores) / len(scores)


@pytest.mark.parametrize("labels", [None, [0, 1, 2, 3, 9]])
def test_macro_f1_matches_brute_force(labels):
    rng = np.random.default_rng(0)
    t = rng.integers(0, 4, 500)
    p = np.where(rng.random(500) < 0.6, t, rng.integers(0, 5, 500))  # label 4 only predicted
    assert macro_f1(t, p, labels) == pytest.approx(brute_macro_f1(t, p, labels), rel=1e-12)
    s_t, s_p = np.array(list("abcab")), np.array(list("abbac"))
    assert macro_f1(s_t, s_p) == pytest.approx(0.5, rel=1e-12)  # a: 1, b: 2·1/(2+1+1), c: 0 (never right)
    assert macro_f1(s_t, s_p, ["a", "b", "c", "z"]) == pytest.approx(0.375, rel=1e-12)  # z never true nor predicted: 0
    with pytest.raises(ConfigError, match="no samples"):
        macro_f1([], [])
    with pytest.raises(ConfigError, match="y_pred has 2"):
        macro_f1([0, 1, 1], [0, 1])


def test_probes_use_only_the_predictors_held_out_windows(monkeypatch):
    """ĥ and r of a window the predictor trained on must not reach a probe: only held-out windows do."""
    from actlake.jobs.train.predictor import loop
    from actlake.jobs.train.predictor.config import PredictorJobConfig

    seen = []

    def features(trainer, h, valid):
        seen.append(h[:, 0, 0].astype(int).tolist())  # window i holds the value i
        return {rep: h[:, -1, :] + np.random.default_rng(0).standard_normal(h[:, -1, :].shape)
                for rep in loop.REPRESENTATIONS}

    monkeypatch.setattr(loop, "last_position_features", features)
    n, t, d = 80, 4, 3
    h = np.arange(n, dtype=float)[:, None, None] * np.ones((n, t, d))
    valid = np.ones((n, t), dtype=bool)
    valid[2, 1:] = False  # a one-token window: never probed
    held = np.zeros(n, dtype=bool)
    held[::2] = True
    meta = {"source": ["a", "a", "b", "b"] * (n // 4), "type8": np.zeros((n, t), dtype=int)}
    job = PredictorJobConfig()
    job.probes.tasks, job.probes.source_caps = ["source"], [10, 3, 3]
    rows = loop.probe_rows(job, None, h, valid, meta, held)
    assert seen == [[i for i in range(0, n, 2) if i != 2]]
    assert len(rows) == len(loop.REPRESENTATIONS) and all(r["n_train"] + r["n_test"] <= n // 2 for r in rows)
