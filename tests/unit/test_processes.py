"""GHMMs and product processes (METHODS.md §7) against brute-force enumeration of the generative story."""
import itertools
from functools import reduce

import numpy as np
import pytest

from actlake.errors import ConfigError
from actlake.jobs.train.synthetic.factored import effective_dimension, explained_variance
from actlake.jobs.train.synthetic.processes import GHMM, ProductProcess, bloch_walk, from_matrices, mess3, product


def _mess3_params(x, alpha):
    """Mess3's transition P[i, j] = P(i -> j) and emission E[j, k] = P(k | j), written out (not from T)."""
    y, b = 1 - 2 * x, (1 - alpha) / 2
    P = np.array([[y, x, x], [x, y, x], [x, x, y]])
    E = np.array([[alpha, b, b], [b, alpha, b], [b, b, alpha]])
    return P, E


def _paths(pi, P, E, word):
    """(P(word), P(current state | word)) by an explicit loop over every hidden-state path s_0..s_l."""
    post = np.zeros(len(pi))
    for path in itertools.product(range(len(pi)), repeat=len(word) + 1):
        w = pi[path[0]]
        for t, k in enumerate(word):
            w *= P[path[t], path[t + 1]] * E[path[t + 1], k]
        post[path[-1]] += w
    return post.sum(), post / post.sum()


def _pair_params(p1, p2):
    """Joint transition / emission of two independent HMMs; joint state j1*3+j2, joint token k1*3+k2."""
    (P1, E1), (P2, E2) = p1, p2
    P, E = np.zeros((9, 9)), np.zeros((9, 9))
    for i1, i2, j1, j2 in itertools.product(range(3), repeat=4):
        P[i1 * 3 + i2, j1 * 3 + j2] = P1[i1, j1] * P2[i2, j2]
        E[j1 * 3 + j2, i1 * 3 + i2] = E1[j1, i1] * E2[j2, i2]  # here (i1, i2) is the token (k1, k2)
    return P, E


def _word_probability(g: GHMM, word) -> float:
    """P(x1..xl) = eta0 T(x1)...T(xl) tau."""
    u = g.eta0
    for x in word:
        u = u @ g.T[x]
    return float(u @ g.tau)


def _next_token_probs(g: GHMM, eta) -> np.ndarray:
    """P(x | eta) = eta T(x) tau / eta tau for every token x: eta (..., S) -> (..., V)."""
    return (eta @ (g.T @ g.tau).T) / (eta @ g.tau)[..., None]


def _update(g: GHMM, eta, x: int) -> np.ndarray:
    """The belief after token x: eta T(x) / eta T(x) tau, eta (S,)."""
    u = eta @ g.T[x]
    return u / (u @ g.tau)


def _joint_ghmm(proc: ProductProcess) -> GHMM:
    """The whole process as one GHMM over prod S_n states, from its definition: T(x) is the Kronecker product
    of the factors' T(x_i), factor i's variant the one x_{i-1} picks; with noise, mixed with a uniform token."""
    mats = []
    for x in itertools.product(*(range(v) for v in proc.vocab_sizes)):  # factor 0 most significant
        mats.append(reduce(np.kron, [vs[x[i - 1]].T[x[i]] if len(vs) > 1 else vs[0].T[x[i]]
                                     for i, vs in enumerate(proc.factors)]))
    T = np.array(mats)
    T = (1 - proc.noise) * T + proc.noise / proc.vocab_size * T.sum(0)
    return GHMM(T, reduce(np.kron, [vs[0].eta0 for vs in proc.factors]))


def _words(V, max_len):
    return [w for L in range(1, max_len + 1) for w in itertools.product(range(V), repeat=L)]


def _run(g: GHMM, tokens):
    """Beliefs (n, L+1, S) and predictions (n, L+1, V) stepping g one sequence and one token at a time."""
    n, L = tokens.shape
    beliefs, preds = np.zeros((n, L + 1, g.n_states)), np.zeros((n, L + 1, g.vocab_size))
    for s in range(n):
        eta = g.eta0.copy()
        for t in range(L + 1):
            beliefs[s, t], preds[s, t] = eta, _next_token_probs(g, eta)
            if t < L:
                eta = _update(g, eta, tokens[s, t])
    return beliefs, preds


def test_mess3_beliefs_equal_path_enumeration():
    g, (P, E) = mess3(0.15, 0.6), _mess3_params(0.15, 0.6)
    pi = np.full(3, 1 / 3)  # P is doubly stochastic, so the uniform distribution is stationary
    np.testing.assert_allclose(g.eta0, pi, atol=1e-12)
    np.testing.assert_allclose(g.tau, np.ones(3))
    for word in _words(3, 4):
        prob, post = _paths(pi, P, E, word)
        eta = g.eta0
        for x in word:
            eta = _update(g, eta, x)
        np.testing.assert_allclose(eta, post, atol=1e-12)
        np.testing.assert_allclose(_word_probability(g, word), prob, rtol=1e-10)


def test_product_of_two_mess3_beliefs_equal_path_enumeration():
    proc = product([mess3(0.15, 0.6), mess3(0.05, 0.8)])
    P, E = _pair_params(_mess3_params(0.15, 0.6), _mess3_params(0.05, 0.8))
    pi = np.full(9, 1 / 9)
    rng = np.random.default_rng(0)
    words = _words(9, 2) + [tuple(rng.integers(0, 9, 3)) for _ in range(20)]
    for word in words:
        _, post = _paths(pi, P, E, word)
        tokens = np.array([word])
        np.testing.assert_allclose(proc.joint_beliefs(tokens)[0, -1], post, atol=1e-12)
        f1, f2 = (b[0, -1] for b in proc.factor_beliefs(tokens))
        np.testing.assert_allclose(f1, post.reshape(3, 3).sum(1), atol=1e-12)
        np.testing.assert_allclose(f2, post.reshape(3, 3).sum(0), atol=1e-12)


@pytest.mark.parametrize("alpha, beta", [(1.0, 3.0), (2.0, -0.5)])
def test_bloch_walk_is_a_valid_process(alpha, beta):
    g = bloch_walk(alpha, beta)
    for L in range(1, 5):
        probs = np.array([_word_probability(g, w) for w in itertools.product(range(4), repeat=L)])
        assert probs.min() >= -1e-12
        assert probs.sum() == pytest.approx(1.0, abs=1e-12)
    for word in [()] + _words(4, 3):
        eta = g.eta0
        for x in word:
            eta = _update(g, eta, x)
        pred = _next_token_probs(g, eta)
        ratio = [_word_probability(g, word + (x,)) / _word_probability(g, word) for x in range(4)]
        np.testing.assert_allclose(pred, ratio, rtol=1e-10, atol=1e-14)
        assert pred.sum() == pytest.approx(1.0, abs=1e-12)


def _random_hmm(seed, S=3, V=2):
    """An HMM with random, non-symmetric transition and emission matrices."""
    rng = np.random.default_rng(seed)
    P, E = rng.dirichlet(np.ones(S), S), rng.dirichlet(np.ones(V), S)  # P[i, j], E[j, k]
    return from_matrices(np.einsum("ij,jk->kij", P, E), name=f"random{seed}")


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_product_predictions_equal_the_joint_ghmm(noise):
    gs = [_random_hmm(0), bloch_walk(), mess3(0.1, 0.7)]  # V = 2, 4, 3
    proc = product(gs, noise=noise)
    # the joint matrices from the definition: Kronecker products, then the noise mixture
    T = np.array([np.kron(np.kron(gs[0].T[a], gs[1].T[b]), gs[2].T[c])
                  for a in range(2) for b in range(4) for c in range(3)])  # (24, 27, 27)
    T = (1 - noise) * T + noise / 24 * T.sum(0)
    np.testing.assert_allclose(_joint_ghmm(proc).T, T, atol=1e-15)
    ref = GHMM(T, np.kron(np.kron(gs[0].eta0, gs[1].eta0), gs[2].eta0))
    tokens = proc.sample(40, 6, np.random.default_rng(1))
    beliefs, preds = _run(ref, tokens)
    probs = proc.next_token_probs(tokens)
    np.testing.assert_allclose(probs, preds, atol=1e-12)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(proc.joint_beliefs(tokens), beliefs, atol=1e-12)
    B = beliefs.reshape(40, 7, 3, 3, 3)
    t0, t1, t2 = (g.tau for g in gs)
    marginals = [np.einsum("nlijk,j,k->nli", B, t1, t2), np.einsum("nlijk,i,k->nlj", B, t0, t2),
                 np.einsum("nlijk,i,j->nlk", B, t0, t1)]
    for g, f, m in zip(gs, proc.factor_beliefs(tokens), marginals):
        np.testing.assert_allclose(f, m / (m @ g.tau)[..., None], atol=1e-12)
    if noise == 0:  # independent factors: the joint prediction is the product of the factor predictions
        p = [_next_token_probs(g, f) for g, f in zip(gs, proc.factor_beliefs(tokens))]
        outer = p[0][..., :, None, None] * p[1][..., None, :, None] * p[2][..., None, None, :]
        np.testing.assert_allclose(probs, outer.reshape(probs.shape), atol=1e-12)
    loss = -np.log(np.take_along_axis(preds[:, :-1], tokens[..., None], -1)[..., 0]).mean(0)
    np.testing.assert_allclose(proc.optimal_loss(tokens), loss, rtol=1e-12)


DEP_PARAMS = [(0.15, 0.6), [(0.05, 0.8), (0.3, 0.5), (0.2, 0.95)]]  # variants predict differently


def _dependent(noise=0.0):
    return ProductProcess([[mess3(*DEP_PARAMS[0])], [mess3(*p) for p in DEP_PARAMS[1]]], noise=noise)


def _dependent_word_probability(word):
    """P(word) of the hidden-dependency story by looping over both factors' hidden paths: factor 1 uses
    the parameters chosen by factor 0's sub-token of the same step."""
    P0, E0 = _mess3_params(*DEP_PARAMS[0])
    variants = [_mess3_params(*p) for p in DEP_PARAMS[1]]
    total, L = 0.0, len(word)
    for a in itertools.product(range(3), repeat=L + 1):
        for b in itertools.product(range(3), repeat=L + 1):
            w = 1 / 9
            for t, (k0, k1) in enumerate(word):
                P1, E1 = variants[k0]
                w *= P0[a[t], a[t + 1]] * E0[a[t + 1], k0] * P1[b[t], b[t + 1]] * E1[b[t + 1], k1]
            total += w
    return total


@pytest.mark.parametrize("noise", [0.0, 0.25])
def test_hidden_dependency_joint_ghmm_equals_enumeration(noise):
    proc, clean = _dependent(noise), _joint_ghmm(_dependent())
    joint, rng = _joint_ghmm(proc), np.random.default_rng(2)
    pairs = list(itertools.product(range(3), repeat=2))
    words = [(p,) for p in pairs] + list(itertools.product(pairs, repeat=2))[::3]
    words += [tuple(map(tuple, rng.integers(0, 3, (3, 2)))) for _ in range(5)]
    for word in words:
        ids = [k0 * 3 + k1 for k0, k1 in word]
        assert _word_probability(clean, ids) == pytest.approx(_dependent_word_probability(word), rel=1e-10)
    np.testing.assert_allclose(joint.T, (1 - noise) * clean.T + noise / 9 * clean.T.sum(0), atol=1e-15)
    tokens = proc.sample(30, 5, rng)
    beliefs, preds = _run(joint, tokens)
    np.testing.assert_allclose(proc.next_token_probs(tokens), preds, atol=1e-12)
    np.testing.assert_allclose(proc.joint_beliefs(tokens), beliefs, atol=1e-12)
    B = beliefs.reshape(30, 6, 3, 3)
    f0, f1 = proc.factor_beliefs(tokens)
    np.testing.assert_allclose(f0, B.sum(3), atol=1e-12)
    np.testing.assert_allclose(f1, B.sum(2), atol=1e-12)


@pytest.mark.parametrize("make", [lambda: _dependent(), lambda: _dependent(0.3),
                                  lambda: product([bloch_walk(), mess3()], noise=0.1)],
                         ids=["dependent", "dependent-noisy", "bloch-mess3-noisy"])
def test_sampled_word_frequencies_match_the_process(make):
    proc = make()
    joint, n, V = _joint_ghmm(proc), 20000, proc.vocab_size
    tokens = proc.sample(n, 2, np.random.default_rng(3))
    counts = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    expected = n * np.array([_word_probability(joint, [a, b]) for a in range(V) for b in range(V)])
    chi2 = ((counts - expected) ** 2 / expected).sum()
    dof = V * V - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof), chi2  # about 6 standard deviations
    probs = proc.next_token_probs(tokens)  # position 1: mean predictive = marginal of x_2
    np.testing.assert_allclose(probs[:, 1].mean(0), np.bincount(tokens[:, 1], minlength=V) / n, atol=0.02)


def test_vary_one_freezes_the_other_factors():
    proc = ProductProcess([[mess3()], [mess3(*p) for p in DEP_PARAMS[1]], [bloch_walk()]])
    for i in range(3):
        sub = proc.decode(proc.sample_vary_one(i, 64, 6, np.random.default_rng(i)))  # (64, 6, 3)
        for j in range(3):
            frozen = (sub[:, :, j] == sub[:1, :, j]).all()
            assert frozen == (j != i), (i, j)


def test_true_beliefs_have_the_factored_dimension():
    proc = product([mess3(0.15, 0.6), mess3(0.05, 0.8), mess3(0.1, 0.7)])
    tokens = proc.sample(3000, 8, np.random.default_rng(4))
    concat = np.concatenate([b[:, 1:].reshape(-1, 3) for b in proc.factor_beliefs(tokens)], axis=1)  # (24000, 9)
    assert (explained_variance(concat) > 1e-9).sum() == 6  # sum(d_n - 1)
    assert effective_dimension(concat, 0.95) <= 6
    joint = proc.joint_beliefs(tokens)[:, 1:].reshape(-1, 27)
    assert 6 < (explained_variance(joint) > 1e-9).sum() <= 26  # prod(d_n) - 1


def test_paper_process_loss_is_the_sum_of_factor_losses():
    gs = [mess3()] * 3 + [bloch_walk()] * 2
    proc = product(gs)
    assert (proc.vocab_size, proc.bos_id, proc.state_dims) == (432, 432, [3] * 5)
    tokens = proc.sample(2000, 8, np.random.default_rng(5))
    assert tokens.shape == (2000, 8) and tokens.dtype == np.int64 and tokens.max() < 432
    sub = proc.decode(tokens)
    np.testing.assert_array_equal(proc.encode(sub), tokens)
    loss = np.zeros(8)
    for i, g in enumerate(gs):
        b = proc.factor_beliefs(tokens)[i][:, :-1]  # (2000, 8, 3)
        loss -= np.log(np.take_along_axis(_next_token_probs(g, b), sub[..., i:i + 1], -1)[..., 0]).mean(0)
    np.testing.assert_allclose(proc.optimal_loss(tokens), loss, rtol=1e-10)


def test_config_errors_name_the_parameter():
    T = mess3().T.copy()
    bad = T.copy()
    bad[0, 0, 0] -= 1.5
    bad[1, 0, 0] += 1.5  # T.sum(0) unchanged, but P(token 0) = 1/3 - 1/2 < 0
    cases = [(lambda: from_matrices(np.ones((3, 3))), "T: expected a finite 3-d"),
             (lambda: from_matrices(np.ones((2, 3, 4))), "T: expected shape"),
             (lambda: from_matrices(bad), "T: .*negative"),
             (lambda: from_matrices(0.5 * T), "T: .*no eigenvalue 1"),
             (lambda: from_matrices(T, eta0=[1.0, 0.0]), "eta0: expected shape"),
             (lambda: mess3(alpha=1.5), "alpha: must be a number in"),
             (lambda: mess3(x=0.7), "x: must be a number in"),
             (lambda: bloch_walk(0, 0), "alpha, beta"),
             (lambda: product([mess3()], noise=1.5), "noise: must be a number in"),
             (lambda: ProductProcess([[mess3(), mess3()]]), r"factors\[0\]"),
             (lambda: ProductProcess([[mess3()], [mess3(), mess3()]]), r"factors\[1\]"),
             (lambda: ProductProcess([[bloch_walk()], [mess3(), bloch_walk(), mess3(), mess3()]]), r"factors\[1\]"),
             (lambda: product([mess3()]).factor_beliefs([0, 1]), "tokens: expected shape"),
             (lambda: product([mess3()]).next_token_probs([[0, 3]]), r"tokens: token ids must be in \[0, 3\)"),
             (lambda: product([mess3(), mess3()]).encode([[0, 3]]), "sub_tokens")]
    for make, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            make()
