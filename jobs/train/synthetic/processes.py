"""Generalised hidden Markov models and factored product processes (METHODS.md §7).

A GHMM is (eta0, {T(x)}): P(x1..xl) = eta0 T(x1)...T(xl) tau, tau the right eigenvector of
T.sum(0) for eigenvalue 1. Beliefs (predictive vectors) are rows normalised so eta @ tau == 1;
for an HMM they are posteriors over the hidden state. A ProductProcess emits one sub-token per
factor each step, joined by radix encoding (factor 0 most significant); joint hidden states are
ordered the same way (Kronecker products). float64 numpy, vectorised over sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce

import numpy as np

from actlake.errors import ConfigError

_EIG_TOL = 1e-6      # |lambda - 1| below this is eigenvalue 1
_NEG_TOL = 1e-10     # a word probability below -_NEG_TOL is an error
_CHECK_WORDS = 4096  # at most about this many words are enumerated when checking probabilities


def _array(value, name: str, ndim: int) -> np.ndarray:
    """A read-only float64 copy of value with ndim dimensions and finite entries."""
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: not a numeric array ({e})") from None
    if arr.ndim != ndim or not np.all(np.isfinite(arr)):
        raise ConfigError(f"{name}: expected a finite {ndim}-d array, got shape {arr.shape}")
    arr.flags.writeable = False
    return arr


def _scalar(name: str, value, lo: float, hi: float, integer: bool = False) -> float:
    """value as a float (or an int) in [lo, hi], else ConfigError naming the parameter."""
    ok = isinstance(value, (int, np.integer)) if integer else isinstance(value, (int, float, np.number))
    if not ok or isinstance(value, bool) or not lo <= value <= hi:  # also rejects NaN
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}: must be {kind} in [{lo}, {hi}], got {value!r}")
    return int(value) if integer else float(value)


def _int_array(value, name: str, high: int) -> np.ndarray:
    """value as an int64 array with entries in [0, high)."""
    arr = np.asarray(value)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= high):
        raise ConfigError(f"{name}: token ids must be in [0, {high}), got [{arr.min()}, {arr.max()}]")
    return arr


def _eigvec_one(M: np.ndarray, name: str) -> np.ndarray:
    """Right eigenvector of M (S, S) for its simple eigenvalue 1, largest entry scaled to 1."""
    vals, vecs = np.linalg.eig(M)
    hits = np.flatnonzero(np.abs(vals - 1) < _EIG_TOL)
    if hits.size != 1:
        what = "has no eigenvalue 1" if hits.size == 0 else "has a repeated eigenvalue 1, so it is ambiguous"
        raise ConfigError(f"{name}: T.sum(0) {what} (eigenvalues {np.round(vals, 6).tolist()})")
    v = np.real(vecs[:, hits[0]])
    return v / v[np.argmax(np.abs(v))]


def _normalise(u: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """Rows of u (N, S) divided by u @ tau; u @ tau <= 0 means an impossible token sequence."""
    z = u @ tau  # (N,)
    if np.any(z <= 0):
        raise ConfigError("tokens: a token sequence has zero probability under the process")
    return u / z[:, None]


def _check_words(T: np.ndarray, eta0: np.ndarray, tau: np.ndarray) -> None:
    """ConfigError if a short word (up to about _CHECK_WORDS of them) has a negative probability."""
    W = T @ tau  # (V, S): W[x] = T(x) tau
    u, length = eta0[None], 1  # (M, S): eta0 T(w) for every word w of length - 1
    while True:
        p = u @ W.T  # (M, V): P(w x)
        if p.min() < -_NEG_TOL:
            raise ConfigError(f"T: a word of length {length} gets negative probability {p.min():.3g} "
                              "(T and eta0 do not define a valid process)")
        if p.size * len(T) > _CHECK_WORDS:
            return
        u, length = np.einsum("ms,vst->mvt", u, T).reshape(-1, T.shape[1]), length + 1


@dataclass(frozen=True, eq=False)
class GHMM:
    """A generalised hidden Markov model; arrays are validated, copied and made read-only."""

    T: np.ndarray
    """(V, S, S) token matrices T(x); T.sum(0) must have a simple eigenvalue 1."""
    eta0: np.ndarray | None = None
    """(S,) initial belief; default the stationary left eigenvector of T.sum(0). Rescaled so eta0 @ tau == 1."""
    name: str = "ghmm"
    """Label for messages and reports."""
    tau: np.ndarray = field(init=False, repr=False)
    """(S,) right eigenvector of T.sum(0) for eigenvalue 1 with eta0 @ tau == 1 (all ones for an HMM)."""

    def __post_init__(self):
        T = _array(self.T, "T", 3)
        if T.shape[0] < 1 or T.shape[1] < 1 or T.shape[1] != T.shape[2]:
            raise ConfigError(f"T: expected shape (V, S, S) with V, S >= 1, got {T.shape}")
        Tsum = T.sum(0)  # (S, S)
        stochastic = np.allclose(Tsum.sum(1), 1.0, rtol=0, atol=1e-10)
        tau = np.ones(T.shape[1]) if stochastic else _eigvec_one(Tsum, "T")
        eta0 = _eigvec_one(Tsum.T, "eta0 (default)") if self.eta0 is None else _array(self.eta0, "eta0", 1)
        if eta0.shape != (T.shape[1],):
            raise ConfigError(f"eta0: expected shape ({T.shape[1]},) to match T, got {eta0.shape}")
        norm = eta0 @ tau
        if abs(norm) < 1e-12:
            raise ConfigError("eta0: eta0 @ tau is 0, so eta0 gives no sequence any probability")
        eta0 = eta0 / norm
        tau.flags.writeable = eta0.flags.writeable = False
        _check_words(T, eta0, tau)
        for key, val in (("T", T), ("eta0", eta0), ("tau", tau)):
            object.__setattr__(self, key, val)

    vocab_size = property(lambda self: self.T.shape[0], doc="V, the number of tokens.")
    n_states = property(lambda self: self.T.shape[1], doc="S, the dimension of the belief vectors.")


def from_matrices(T, eta0=None, name: str = "ghmm") -> GHMM:
    """A GHMM from token matrices T (V, S, S) and an optional initial belief eta0 (S,); ConfigError if invalid."""
    return GHMM(T, eta0, name)


def mess3(x: float = 0.15, alpha: float = 0.6) -> GHMM:
    """Mess3 (3 states, 3 tokens): T(k)[i, j] = P(i->j) P(k|j), P(i->j) = 1-2x if i == j else x,
    P(k|j) = alpha if k == j else (1-alpha)/2 (METHODS.md §7; paper x = 0.15, alpha = 0.6)."""
    x, alpha = _scalar("x", x, 0.0, 0.5), _scalar("alpha", alpha, 0.0, 1.0)
    P = np.full((3, 3), x)
    np.fill_diagonal(P, 1 - 2 * x)  # P[i, j] = P(i -> j)
    E = np.full((3, 3), (1 - alpha) / 2)
    np.fill_diagonal(E, alpha)  # E[j, k] = P(k | j)
    return GHMM(np.einsum("ij,jk->kij", P, E), name=f"mess3(x={x:g}, alpha={alpha:g})")


def bloch_walk(alpha: float = 1.0, beta: float = 3.0) -> GHMM:
    """The Bloch walk (3-dim GHMM, 4 tokens) of METHODS.md §7 with eta0 = [1, 0, 0] (paper alpha = 1, beta = 3)."""
    alpha, beta = _scalar("alpha", alpha, -1e150, 1e150), _scalar("beta", beta, -1e150, 1e150)
    if alpha == 0 and beta == 0:
        raise ConfigError("alpha, beta: must not both be 0 (gamma^2 = 1/(4(alpha^2+beta^2)))")
    g2 = 1 / (4 * (alpha**2 + beta**2))
    a, c = (alpha**2 - beta**2) * g2, 2 * alpha * beta * g2
    T = [[[0.25, 0, s * c], [0, a, 0], [s * c, 0, 0.25]] for s in (1, -1)]
    T += [[[0.25, s * c, 0], [s * c, 0.25, 0], [0, 0, a]] for s in (1, -1)]
    return GHMM(np.array(T), np.array([1.0, 0, 0]), name=f"bloch_walk(alpha={alpha:g}, beta={beta:g})")


def _check_factors(factors) -> list[list[GHMM]]:
    """factors as a list of variant lists, validated (a bare GHMM counts as [GHMM])."""
    if isinstance(factors, GHMM) or not isinstance(factors, (list, tuple)) or not factors:
        raise ConfigError("factors: expected a non-empty list of factors (each a GHMM or a list of variants)")
    out: list[list[GHMM]] = []
    for i, f in enumerate(factors):
        vs = [f] if isinstance(f, GHMM) else list(f) if isinstance(f, (list, tuple)) else []
        if not vs or not all(isinstance(g, GHMM) for g in vs):
            raise ConfigError(f"factors[{i}]: expected a GHMM or a non-empty list of GHMM variants")
        if len(vs) > 1 and (i == 0 or len(vs) != out[-1][0].vocab_size):
            want = "exactly 1 (factor 0 has no parent)" if i == 0 else f"1 or V_{i - 1} = {out[-1][0].vocab_size}"
            raise ConfigError(f"factors[{i}]: has {len(vs)} variants, expected {want}")
        for g in vs[1:]:
            if g.T.shape != vs[0].T.shape:
                raise ConfigError(f"factors[{i}]: variants differ in shape (V, S, S): {g.T.shape} vs {vs[0].T.shape}")
            if not (np.allclose(g.tau, vs[0].tau) and np.allclose(g.eta0, vs[0].eta0)):
                raise ConfigError(f"factors[{i}]: variants must share tau and eta0 (one belief space per factor)")
        out.append(vs)
    return out


def _chain(tables: list[np.ndarray]) -> np.ndarray:
    """Joint token probabilities from per-factor tables (n, P_i, V_i), P_i = 1 or V_{i-1}
    (row p: factor i's distribution when factor i-1 emitted p) -> (n, prod V_i)."""
    p = tables[0][:, 0]  # (n, V_0)
    for prev, q in zip(tables, tables[1:]):
        p = (p.reshape(len(p), -1, prev.shape[2])[..., None] * q[:, None]).reshape(len(p), -1)
    return p


def _draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of p (n, V) by inverse CDF -> (n,) int64."""
    c = np.cumsum(p, axis=1)  # (n, V)
    u = rng.random(len(p)) * c[:, -1]
    return np.minimum((c <= u[:, None]).sum(1), p.shape[1] - 1).astype(np.int64)


@dataclass(eq=False)
class ProductProcess:
    """N factors emit one sub-token each per step; the joint token is their radix encoding."""

    factors: list[list[GHMM]]
    """factors[i] is [g] for an independent factor, or a list of V_{i-1} variants: under hidden
    dependency, factor i uses variant factors[i][s] where s is factor i-1's sub-token of the same step
    (factor 0 must have exactly one). All variants of a factor share V, S, tau and eta0."""
    noise: float = 0.0
    """epsilon: the emitted joint token is replaced by a uniform random joint token with probability epsilon
    (the hidden states evolve as if the original token had been emitted)."""

    def __post_init__(self):
        self.factors = _check_factors(self.factors)
        self.noise = _scalar("noise", self.noise, 0.0, 1.0)
        self._T = [np.stack([g.T for g in vs]) for vs in self.factors]  # per factor (P_i, V_i, S_i, S_i)
        self._W = [T @ vs[0].tau for T, vs in zip(self._T, self.factors)]  # per factor (P_i, V_i, S_i)
        self._tau = [vs[0].tau for vs in self.factors]  # per factor (S_i,)
        self._tau_joint = reduce(np.kron, self._tau)  # (S_J,)
        self._eta0_joint = reduce(np.kron, [vs[0].eta0 for vs in self.factors])  # (S_J,)
        self._W_joint: np.ndarray | None = None  # (V, S_J), built on first use

    n_factors = property(lambda self: len(self.factors), doc="N, the number of factors.")
    vocab_sizes = property(lambda self: [vs[0].vocab_size for vs in self.factors], doc="[V_n] per factor.")
    state_dims = property(lambda self: [vs[0].n_states for vs in self.factors], doc="[S_n] per factor.")
    vocab_size = property(lambda self: int(np.prod(self.vocab_sizes)), doc="prod V_n, joint tokens.")
    bos_id = property(lambda self: self.vocab_size, doc="Id of the BOS token (one past the joint vocabulary).")

    def _strides(self) -> np.ndarray:
        return np.array([int(np.prod(self.vocab_sizes[i + 1:])) for i in range(self.n_factors)], dtype=np.int64)

    def encode(self, sub_tokens) -> np.ndarray:
        """Joint token ids from sub-tokens: (..., N) -> (...,), factor 0 most significant."""
        sub = _int_array(sub_tokens, "sub_tokens", max(self.vocab_sizes))
        if sub.shape[-1:] != (self.n_factors,) or np.any(sub >= np.array(self.vocab_sizes)):
            raise ConfigError(f"sub_tokens: expected shape (..., {self.n_factors}) with sub-token i < V_i = "
                              f"{self.vocab_sizes}, got shape {sub.shape}")
        return sub @ self._strides()

    def decode(self, tokens) -> np.ndarray:
        """Sub-tokens of joint token ids: (...,) -> (..., N)."""
        t = _int_array(tokens, "tokens", self.vocab_size)
        return (t[..., None] // self._strides()) % np.array(self.vocab_sizes)

    def _sub(self, tokens) -> np.ndarray:
        """Sub-tokens (n, L, N) of joint tokens (n, L) (no BOS)."""
        if np.ndim(tokens) != 2:
            raise ConfigError(f"tokens: expected shape (n_seqs, length) without BOS, got {np.shape(tokens)}")
        return self.decode(tokens)

    def _factor_run(self, i: int, x: np.ndarray, prev: np.ndarray | None, rng=None) -> np.ndarray:
        """Beliefs (n, L+1, S_i) of factor i along its sub-tokens x (n, L); prev (n, L) are factor i-1's
        (they pick the variant). With rng, x is filled in by sampling each step from the beliefs."""
        (n, L), T = x.shape, self._T[i]  # T (P_i, V_i, S_i, S_i)
        b = np.empty((n, L + 1, T.shape[2]))
        b[:, 0] = self.factors[i][0].eta0
        for t in range(L):
            var = prev[:, t] if len(self.factors[i]) > 1 else np.zeros(n, dtype=np.int64)  # (n,)
            if rng is not None:
                x[:, t] = _draw(self._factor_table(i, b[:, t])[np.arange(n), var], rng)
            b[:, t + 1] = _normalise((b[:, t, None] @ T[var, x[:, t]])[:, 0], self._tau[i])
        return b

    def _clean_beliefs(self, sub: np.ndarray) -> list[np.ndarray]:
        """Noise-free factor beliefs, per factor (n, L+1, S_i), from sub-tokens (n, L, N)."""
        return [self._factor_run(i, sub[:, :, i], sub[:, :, i - 1]) for i in range(self.n_factors)]

    def _factor_table(self, i: int, eta: np.ndarray) -> np.ndarray:
        """P_i(x | eta, variant p): eta (n, S_i) -> (n, P_i, V_i)."""
        W = self._W[i]  # (P_i, V_i, S_i)
        return (eta @ W.reshape(-1, W.shape[2]).T).reshape(len(eta), *W.shape[:2]) / (eta @ self._tau[i])[:, None, None]

    def _sample_clean(self, n: int, L: int, rng, sub: np.ndarray | None = None, only: int | None = None) -> np.ndarray:
        """Noise-free sub-tokens (n, L, N) sampled factor by factor (only factor `only` into a given sub)."""
        sub = np.zeros((n, L, self.n_factors), dtype=np.int64) if sub is None else sub
        for i in range(self.n_factors) if only is None else [only]:
            x = np.zeros((n, L), dtype=np.int64)
            self._factor_run(i, x, sub[:, :, i - 1], rng)
            sub[:, :, i] = x
        return sub

    def _joint_apply(self, eta: np.ndarray, x: np.ndarray) -> np.ndarray:
        """eta (n, S_J) @ T(x) for the noise-free joint matrices of sub-tokens x (n, N) -> (n, S_J)."""
        n, dims, u = len(eta), self.state_dims, eta
        for i in range(self.n_factors):
            M = self._T[i][x[:, i - 1] if len(self.factors[i]) > 1 else 0, x[:, i]]  # (n, S_i, S_i)
            u = u.reshape(n, int(np.prod(dims[:i])), dims[i], -1).transpose(0, 1, 3, 2)  # (n, A, R, S_i)
            u = (u @ M[:, None]).transpose(0, 1, 3, 2)  # (n, A, S_i, R)
        return u.reshape(n, -1)

    def _joint_iter(self, sub: np.ndarray):
        """Yield the joint belief (n, S_J) before the first token and after each of sub (n, L, N)."""
        eps, V = self.noise, self.vocab_size
        Tsum = self._joint_kron(self._T, summed=True) if eps > 0 else None  # (S_J, S_J)
        eta = np.tile(self._eta0_joint, (len(sub), 1))
        yield eta
        for t in range(sub.shape[1]):
            u = self._joint_apply(eta, sub[:, t])
            if eps > 0:
                u = (1 - eps) * u + (eps / V) * (eta @ Tsum)
            eta = _normalise(u, self._tau_joint)
            yield eta

    def _joint_probs(self, eta: np.ndarray) -> np.ndarray:
        """Noise-free P(x | eta) for every joint token: eta (n, S_J) -> (n, V)."""
        if self._W_joint is None:
            self._W_joint = self._joint_kron(self._W, summed=False)  # (V, S_J): W[x] = T(x) tau
        return (eta @ self._W_joint.T) / (eta @ self._tau_joint)[:, None]

    def _marginals(self, eta: np.ndarray) -> list[np.ndarray]:
        """Factor beliefs from joint beliefs, the other factors contracted with their tau: (n, S_J) -> [(n, S_i)]."""
        out, dims, one = [], self.state_dims, np.ones(1)
        for i in range(self.n_factors):
            left, right = reduce(np.kron, self._tau[:i], one), reduce(np.kron, self._tau[i + 1:], one)  # (A,), (R,)
            m = np.einsum("nasr,a,r->ns", eta.reshape(len(eta), len(left), dims[i], len(right)), left, right,
                          optimize=True)
            out.append(m / (m @ self._tau[i])[:, None])
        return out

    @staticmethod
    def _joint_kron(blocks: list[np.ndarray], summed: bool) -> np.ndarray:
        """Kronecker products over factors of per-factor blocks (P_i, V_i, *m), m = (S_i,) or (S_i, S_i),
        the variant chosen by the previous factor's token -> (V, *M) by joint token, or their sum (*M,)."""
        J = np.ones((1, 1) + (1,) * (blocks[0].ndim - 2))  # (A, V_prev, *M): A earlier tokens, V_prev the last
        for B in blocks:
            B = np.broadcast_to(B, (J.shape[1], *B.shape[1:]))  # (V_prev, V_i, *m)
            K = J[:, :, None, :, None] * B[None, :, :, None, :] if B.ndim == 3 else \
                J[:, :, None, :, None, :, None] * B[None, :, :, None, :, None, :]
            J = K.reshape(-1, B.shape[1], *(a * b for a, b in zip(J.shape[2:], B.shape[2:])))
            J = J.sum(0, keepdims=True) if summed else J
        return J.sum(1)[0] if summed else J.reshape(-1, *J.shape[2:])

    def sample(self, n_seqs: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """(n_seqs, length) joint token ids (int64), no BOS, sampled from exact beliefs (no hidden states)."""
        n, L = _scalar("n_seqs", n_seqs, 1, np.inf, True), _scalar("length", length, 0, np.inf, True)
        tokens = self.encode(self._sample_clean(n, L, rng))
        if self.noise > 0:
            mask = rng.random(tokens.shape) < self.noise
            tokens[mask] = rng.integers(0, self.vocab_size, int(mask.sum()))
        return tokens

    def sample_vary_one(self, factor: int, n_seqs: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """(n_seqs, length): factor `factor` sampled freshly per sequence, every other factor's sub-tokens
        one shared sampled sequence ("vary one", METHODS.md §7 (3)). No noise is applied; a dependent factor
        uses the shared sub-tokens of its parent, later factors keep theirs."""
        i = _scalar("factor", factor, 0, self.n_factors - 1, True)
        n, L = _scalar("n_seqs", n_seqs, 1, np.inf, True), _scalar("length", length, 0, np.inf, True)
        sub = np.repeat(self._sample_clean(1, L, rng), n, axis=0)  # (n, L, N)
        return self.encode(self._sample_clean(n, L, rng, sub, only=i))

    def factor_beliefs(self, tokens) -> list[np.ndarray]:
        """tokens (n, L) -> per factor (n, L+1, S_n): exact belief of each factor after every prefix
        (index 0 = before any token); with noise the marginals of the joint belief."""
        sub = self._sub(tokens)
        if self.noise == 0:
            return self._clean_beliefs(sub)
        steps = [self._marginals(eta) for eta in self._joint_iter(sub)]
        return [np.stack([s[i] for s in steps], axis=1) for i in range(self.n_factors)]

    def joint_beliefs(self, tokens) -> np.ndarray:
        """tokens (n, L) -> (n, L+1, prod S_n): exact belief over the joint state after every prefix."""
        return np.stack(list(self._joint_iter(self._sub(tokens))), axis=1)

    def _iter_probs(self, tokens):
        """Yield P(next joint token | prefix) (n, V) for the prefixes of length 0..L."""
        sub = self._sub(tokens)
        if self.noise == 0:
            beliefs = self._clean_beliefs(sub)
            for t in range(sub.shape[1] + 1):
                yield _chain([self._factor_table(i, b[:, t]) for i, b in enumerate(beliefs)])
        else:
            for eta in self._joint_iter(sub):
                yield (1 - self.noise) * self._joint_probs(eta) + self.noise / self.vocab_size

    def next_token_probs(self, tokens) -> np.ndarray:
        """tokens (n, L) -> (n, L+1, V): exact P(next joint token | prefix) for every prefix (rows sum to 1)."""
        return np.stack(list(self._iter_probs(tokens)), axis=1)

    def optimal_loss(self, tokens) -> np.ndarray:
        """(L,) mean over sequences of -log P(x_t | x_<t) in nats: the Bayes-optimal loss per position."""
        tokens = _int_array(tokens, "tokens", self.vocab_size)
        rows = np.arange(len(tokens))
        return np.array([-np.log(p[rows, tokens[:, t]]).mean()
                         for t, p in zip(range(tokens.shape[1]), self._iter_probs(tokens))])


def product(factors, noise: float = 0.0) -> ProductProcess:
    """Independent product of a list of GHMMs (optionally noisy)."""
    if isinstance(factors, GHMM) or not isinstance(factors, (list, tuple)):
        raise ConfigError("factors: expected a list of GHMM")
    return ProductProcess([[g] for g in factors], noise)
