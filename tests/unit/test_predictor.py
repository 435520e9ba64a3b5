"""Next-hidden-state predictor (METHODS.md §6): learning, metrics against references, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actlake.errors import ConfigError
from actlake.jobs.train.predictor.metrics import spearman, spearman_by_position
from actlake.jobs.train.predictor.model import (
    NextStatePredictor,
    PredictorConfig,
    PredictorTrainer,
    default_heads,
    fit_standardisation,
    lr_at,
    run_steps,
)

torch.set_num_threads(1)
D, T = 16, 16


def linear_windows(n: int, seed: int = 0, rho: float = 0.95) -> np.ndarray:
    """(n, T, D) windows with h_{t+1} = A h_t exactly, A random with spectral radius rho."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((D, D))
    a *= rho / np.abs(np.linalg.eigvals(a)).max()
    h = np.empty((n, T, D), np.float32)
    h[:, 0] = rng.standard_normal((n, D)) * 2.0 + 1.0
    for t in range(1, T):
        h[:, t] = h[:, t - 1] @ a.T
    return h


def small_cfg(steps: int, lr: float = 3e-3) -> PredictorConfig:
    return PredictorConfig(d_model=D, n_heads=4, head_dim=32, lr=lr, warmup_steps=steps // 10, total_steps=steps)


def train_and_eval(h: np.ndarray, steps: int = 400):
    tr, te = h[:4096], h[4096:]
    mean, std = fit_standardisation([tr])
    trainer = PredictorTrainer(small_cfg(steps), mean, std, seed=0)
    run_steps(trainer, tr, None, steps, 64)
    return trainer, trainer.evaluate(te)


def test_learns_linear_dynamics():
    _, ev = train_and_eval(linear_windows(4096 + 512))
    assert ev.r2 > 0.95, ev.r2
    assert ev.mse_by_position.shape == (T - 1,) and ev.residual_norm.shape == (512, T - 1)


def test_noise_is_unpredictable():
    h = np.random.default_rng(1).standard_normal((4096 + 512, T, D)).astype(np.float32) * 3.0 - 2.0
    _, ev = train_and_eval(h, steps=300)
    assert abs(ev.r2) < 0.05, ev.r2


def test_evaluate_agrees_with_predict_and_r2_score():
    from sklearn.metrics import r2_score as sk_r2

    h = linear_windows(300, seed=3)
    valid = np.ones(h.shape[:2], dtype=bool)
    valid[::3, 12:] = False  # right padding
    valid[1::5, :2] = False  # left padding
    mean, std = fit_standardisation([(h, valid)])
    trainer = PredictorTrainer(small_cfg(30), mean, std, seed=1)
    run_steps(trainer, h, valid, 30, 32)
    ev = trainer.evaluate(h, valid, batch_size=37)
    pred = trainer.predict(h, valid, batch_size=41)
    m = valid[:, :-1] & valid[:, 1:]  # (N, T-1)
    assert np.isnan(pred[~m]).all() and np.isfinite(pred[m]).all()
    tgt, est = h[:, 1:][m].astype(np.float64), pred[m].astype(np.float64)  # (n, D)
    assert ev.n_targets == m.sum()
    assert ev.mse == pytest.approx(((tgt - est) ** 2).mean(), rel=1e-4)
    assert ev.r2 == pytest.approx(sk_r2(tgt, est, multioutput="variance_weighted"), abs=1e-4)
    sq = ((h[:, 1:].astype(np.float64) - pred) ** 2).sum(-1)  # (N, T-1)
    np.testing.assert_allclose(ev.residual_norm[m], np.sqrt(sq[m]), rtol=1e-3)
    assert np.isnan(ev.residual_norm[~m]).all()
    by_pos = np.nansum(np.where(m, sq, np.nan), 0) / (m.sum(0) * D)
    np.testing.assert_allclose(ev.mse_by_position, by_pos, rtol=1e-4)


def test_train_step_returns_original_unit_mse():
    h = linear_windows(8, seed=4) * 10.0 + 5.0
    mean, std = fit_standardisation([h])
    trainer = PredictorTrainer(small_cfg(10), mean, std)
    expected = ((h[:, 1:] - trainer.predict(h)) ** 2).mean()
    assert trainer.train_step(torch.from_numpy(h)) == pytest.approx(expected, rel=1e-4)
    assert trainer.step == 1


def test_resume_is_exact(tmp_path):
    h = linear_windows(256, seed=5)
    mean, std = fit_standardisation([h[:128], h[128:]])
    cfg = small_cfg(40)
    full = PredictorTrainer(cfg, mean, std, seed=7)
    ref = run_steps(full, h, None, 40, 16)
    first = PredictorTrainer(cfg, mean, std, seed=7)
    part = run_steps(first, h, None, 20, 16)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    resumed = PredictorTrainer(cfg, np.zeros(D), np.ones(D), seed=123)  # all overwritten by the load
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt"))  # weights_only default: tensors/builtins only
    assert resumed.step == 20 and resumed.lr == first.lr == lr_at(20, cfg)
    rest = run_steps(resumed, h, None, 20, 16)
    np.testing.assert_allclose(part + rest, ref, rtol=0, atol=1e-6)
    assert resumed.step == full.step == 40 and resumed.lr == full.lr
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)


def test_load_rejects_other_config():
    trainer = PredictorTrainer(small_cfg(10), np.zeros(D), np.ones(D))
    other = PredictorTrainer(PredictorConfig(d_model=D, n_heads=2, head_dim=32), np.zeros(D), np.ones(D))
    with pytest.raises(ConfigError, match="n_heads"):
        other.load_state_dict(trainer.state_dict())


def test_predictor_is_causal_and_ignores_padding():
    torch.manual_seed(0)
    model = NextStatePredictor(D, 3, 8)
    h = torch.randn(2, T, D)
    out = model(h)
    assert out.shape == (2, T - 1, D)
    h2 = h.clone()
    h2[:, 9:] = torch.randn(2, T - 9, D)  # change the future from position 9 on
    torch.testing.assert_close(model(h2)[:, :9], out[:, :9])
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[:, :3] = False  # left padding: the padded keys must not matter to later queries
    h3 = h.clone()
    h3[:, :3] = 100.0
    a, b = model(h, valid), model(h3, valid)
    assert torch.isfinite(b).all()
    torch.testing.assert_close(a[:, 3:], b[:, 3:])
    out.sum().backward()
    assert model.log_slope.grad is not None and model.log_slope.grad.abs().sum() > 0


def test_lr_schedule():
    cfg = PredictorConfig(d_model=4, lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3)  # half-way through the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4) and lr_at(10_000, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(9, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_train_lm_uses_the_same_schedule():
    """One warm-up-cosine schedule (``actlake.jobs.train.training.warmup_cosine_lr``) for both training loops."""
    from types import SimpleNamespace

    from actlake.jobs.train.lm.loop import lr_at as lm_lr_at

    t = SimpleNamespace(lr=1e-3, warmup_steps=10, steps=110)
    cfg = PredictorConfig(d_model=4, lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert [lm_lr_at(s, t) for s in range(0, 200, 7)] == [lr_at(s, cfg) for s in range(0, 200, 7)]


def test_default_heads_matches_paper():
    assert default_heads(16, 64) == (32, 128)  # Pythia-410m -> 32 x 128 (4x width)


def test_fit_standardisation_over_valid_tokens():
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((10, 6, 3)) * [1.0, 5.0, 0.1] + [1e4, -3.0, 0.0]).astype(np.float32)
    valid = rng.random((10, 6)) > 0.3
    mean, std = fit_standardisation([(h[:4], valid[:4]), (torch.from_numpy(h[4:]), valid[4:])])
    rows = h[valid].astype(np.float64)
    np.testing.assert_allclose(mean, rows.mean(0), rtol=1e-12)
    np.testing.assert_allclose(std, rows.std(0), rtol=1e-9)


def test_user_errors_raise_config_error():
    trainer = PredictorTrainer(small_cfg(10), np.zeros(D), np.ones(D))
    with pytest.raises(ConfigError, match="shape"):
        trainer.train_step(torch.zeros(2, T, D + 1))
    with pytest.raises(ConfigError, match="valid"):
        trainer.train_step(torch.zeros(2, T, D), torch.ones(2, T - 1, dtype=torch.bool))
    with pytest.raises(ConfigError, match="no valid"):
        trainer.train_step(torch.zeros(2, T, D), torch.zeros(2, T, dtype=torch.bool))
    with pytest.raises(ConfigError, match="mean"):
        PredictorTrainer(small_cfg(10), np.zeros(D - 1), np.ones(D))
    with pytest.raises(ConfigError, match="warmup_steps"):
        PredictorConfig(d_model=D, warmup_steps=50, total_steps=10).validate()
    with pytest.raises(ConfigError, match="fewer than 2"):
        fit_standardisation([])


def test_r2_of_constant_targets_is_sklearns():
    """One R² (sklearn's): constant targets give 0.0 unless predicted exactly (not NaN)."""
    from sklearn.metrics import r2_score as sk_r2

    h = np.full((40, T, D), 2.5, np.float32)
    mean, std = fit_standardisation([h])
    trainer = PredictorTrainer(small_cfg(10), mean, std, seed=0)
    run_steps(trainer, h, None, 3, 8)
    ev = trainer.evaluate(h)
    pred = trainer.predict(h)
    assert ev.var == 0 and ev.mse > 0
    assert ev.r2 == sk_r2(h[:, 1:].reshape(-1, D), pred.reshape(-1, D), multioutput="variance_weighted") == 0.0


def brute_spearman(x, y) -> float:
    """Spearman from its definition, in plain Python: average ranks by counting (O(n²)), then Pearson of the ranks."""
    x, y = [float(v) for v in x], [float(v) for v in y]

    def ranks(v):
        return [1 + sum(w < a for w in v) + (sum(w == a for w in v) - 1) / 2 for a in v]

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5


def test_spearman_matches_brute_force_with_ties():
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8, rel=1e-12)  # 1 - 6·Σd²/(n(n²-1)), Σd² = 4
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / 10 ** 0.5, rel=1e-12)  # ranks 1, 2.5, 2.5, 4
    assert spearman([1.0, 2.0], [2.0, 1.0]) == pytest.approx(-1.0, rel=1e-12)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 7, 300).astype(float)  # many ties
    y = x + rng.integers(0, 5, 300)
    assert spearman(x, y) == pytest.approx(brute_spearman(x, y), rel=1e-10)
    z = rng.standard_normal(300)
    assert spearman(z, y) == pytest.approx(brute_spearman(z, y), rel=1e-10)
    assert np.isnan(spearman(np.ones(5), np.arange(5.0)))
    with pytest.raises(ConfigError):
        spearman(x, y[:-1])
    with pytest.raises(ConfigError, match="at least 2"):
        spearman([1.0], [2.0])
    with pytest.raises(ConfigError, match="NaN or inf"):
        spearman([1.0, np.nan, 3.0], [1.0, 2.0, 3.0])


def test_spearman_by_position_matches_brute_force_per_column():
    rng = np.random.default_rng(1)
    norms = rng.standard_normal((50, 6))
    surpr = norms * rng.random(6) + rng.standard_normal((50, 6))
    surpr[:, 2] = np.round(surpr[:, 2])  # ties
    valid = rng.random((50, 6)) > 0.2
    valid[:, 5] = False
    valid[:2, 5] = True  # too few pairs -> NaN
    got = spearman_by_position(norms, surpr, valid)
    assert got.dtype == np.float64
    for p in range(5):
        sel = valid[:, p]
        assert got[p] == pytest.approx(brute_spearman(norms[sel, p], surpr[sel, p]), rel=1e-10)
    assert np.isnan(got[5])
