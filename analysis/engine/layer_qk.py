"""Everything the attention analyses need about one layer of one batch, in one place.

:class:`BatchInfo` holds what is the same for every layer of a batch (masks,
categories, pair counts) and computes each once; :class:`LayerQK` adds one
layer's tensors and computes the products of its attention weights the analyses
read, all in one pass (:mod:`actlake.analysis.engine.attention_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from actlake.analysis.engine import attention_weights as aw
from actlake.analysis.engine import rope
from actlake.analysis.engine.device import to_device
from actlake.analysis.engine.heads import allowed_pairs, capped, expand_kv

HOST_FACTS = ("needs_mask", "has_invalid", "lengths", "key_order")
"""Facts about a batch that depend on its values and steer Python code: computed from host tensors
(:meth:`BatchInfo.to`), so that no layer waits for the device to answer them."""


@dataclass(eq=False)
class BatchInfo:
    """A batch's masks and token categories, on the model's device, shared by every attention layer (C = 5 token
    roles, in the order of ``actlake.categories.ROLE``: bos, eos, period, comma, other)."""

    valid: torch.Tensor
    """(B, T) 1 for real tokens, 0 for padding."""
    causal: bool
    """Whether a query sees only earlier keys (a decoder)."""
    key_onehot: torch.Tensor
    """(B, T, C) key categories (zero on padding), float64."""
    query_onehot: torch.Tensor
    """(B, T, C) query categories (zero on padding), float64."""
    window: int | None = None
    """A sliding window W shorter than the batch's windows (0 <= m - n < W causal, |m - n| < W bidirectional), or
    None: every earlier (causal) or every (bidirectional) key is seen."""

    def __post_init__(self):
        if self.window is not None and self.window >= self.valid.shape[1]:
            self.window = None  # the window covers every pair of the batch

    @cached_property
    def pair_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: key n is a real token the query at m may see (n <= m when causal; within the
        window). Query validity is not part of it: statistics weight queries by ``valid``."""
        return allowed_pairs(self.valid, self.causal, self.window)

    @cached_property
    def weight_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: the pairs whose weights are computed. ``pair_mask`` on valid queries; every
        key for padded or excluded queries, so no softmax row is empty (their weights are then dropped)."""
        return self.pair_mask | ~self.valid.bool()[:, None, :, None]

    @cached_property
    def weight_mask_additive(self) -> torch.Tensor:
        """(B, 1, T, T) float32: 0 on ``weight_mask``, -inf elsewhere."""
        zero = torch.zeros(self.weight_mask.shape, dtype=torch.float32, device=self.valid.device)
        return zero.masked_fill_(~self.weight_mask, float("-inf"))

    @cached_property
    def needs_mask(self) -> list[bool]:
        """Per sequence: does ``weight_mask`` exclude any pair? (Not for a bidirectional, unpadded one.)"""
        if self.causal or self.window is not None:
            return [True] * self.valid.shape[0]
        return (~self.valid.bool().all(1)).tolist()

    @cached_property
    def has_invalid(self) -> list[bool]:
        """Per sequence: any padded or excluded token?"""
        return (~self.valid.bool().all(1)).tolist()

    @cached_property
    def lengths(self) -> list[int] | None:
        """Per sequence, its number of valid tokens when they are a prefix (right padding, nothing
        excluded), else None."""
        n = self.valid.sum(1).long()  # whole counts whatever the mask's dtype
        prefix = torch.arange(self.valid.shape[1], device=self.valid.device)[None] < n[:, None]
        return n.tolist() if bool((prefix == self.valid.bool()).all()) else None

    @cached_property
    def validf(self) -> torch.Tensor:
        return self.valid.to(torch.float32)

    def sum_over_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        """For each key n, the sum of ``per_query`` (B, H, T, ...) over the queries m that may attend to n.

        Bidirectional: all valid queries. Causal: valid queries m >= n (a reverse cumulative sum; on a
        GPU one product with an upper-triangular matrix of ones, which tensor cores run far faster
        than a scan). ``per_query`` must already be zero on padded queries.
        """
        if self.window is not None:
            return windowed_sum(per_query, self.window, self.causal)
        if not self.causal:
            return per_query.sum(2, keepdim=True).expand_as(per_query)
        if per_query.device.type == "cpu":
            return per_query.flip(2).cumsum(2).flip(2)
        cache = self.__dict__.setdefault("_upper", {})
        return reverse_cumsum_by_product(per_query, cache)

    @cached_property
    def queries_per_key(self) -> torch.Tensor:
        """(B, T) float64: valid queries that may attend to each key (0 on padded keys)."""
        v = self.valid.to(torch.float64)
        return self.sum_over_queries(v[:, None, :])[:, 0] * v

    @cached_property
    def queries_per_key_f32(self) -> torch.Tensor:
        """:attr:`queries_per_key` in float32 (whole numbers up to T: exact)."""
        return self.queries_per_key.float()

    @cached_property
    def key_order(self) -> "KeyOrder":
        """The batch's valid keys sorted by category (:class:`KeyOrder`)."""
        B, T, C = self.key_onehot.shape
        cat = self.key_onehot.argmax(-1).reshape(-1)
        cat = torch.where(self.key_onehot.sum(-1).reshape(-1) > 0, cat, C)  # C: not a key
        order = torch.argsort(cat, stable=True)
        ends = torch.bincount(cat, minlength=C + 1)[:C].cumsum(0).tolist()
        spans = list(zip([0] + ends[:-1], ends))
        member = torch.zeros(C, ends[-1], dtype=torch.float32, device=cat.device)
        for c, (a, b) in enumerate(spans):
            member[c, a:b] = 1
        order = order[: ends[-1]]
        return KeyOrder(order // T, order % T, order, spans, member)

    @cached_property
    def n_valid(self) -> torch.Tensor:
        """() float64: valid queries of the batch."""
        return self.valid.sum().to(torch.float64)

    @cached_property
    def valid_mean_weights(self) -> torch.Tensor:
        """(B, 1, T, 1) float32: 1 / (valid tokens of the sequence) on valid tokens, 0 elsewhere; a product
        with it is the mean over each sequence's valid tokens."""
        v = self.validf
        return (v / v.sum(-1, keepdim=True).clamp(min=1))[:, None, :, None]

    @cached_property
    def pairs_by_key_category(self) -> torch.Tensor:
        """(C,) float64: valid pairs with the key in each category."""
        return torch.einsum("bt,btc->c", self.queries_per_key, self.key_onehot.to(torch.float64))

    @cached_property
    def queries_by_category(self) -> torch.Tensor:
        """(C,) float64: valid queries of each category."""
        return self.query_onehot.to(torch.float64).sum((0, 1))

    def padded_key_onehot(self, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, T, max(width, C)) key categories with zero columns added: matrix kernels are much faster on
        a product 8 or 16 wide than 5 wide, and attention kernels want V as wide as q."""
        cache = self.__dict__.setdefault("_padded_onehot", {})
        if (width, dtype) not in cache:
            onehot = self.key_onehot
            out = onehot.new_zeros(*onehot.shape[:2], max(width, onehot.shape[-1]), dtype=dtype)
            out[..., : onehot.shape[-1]] = onehot
            cache[width, dtype] = out
        return cache[width, dtype]

    def distance_index(self, T: int) -> torch.Tensor:
        """(T, T) long: m - n + T - 1 for query m and key n."""
        cache = self.__dict__.setdefault("_distance_index", {})
        if T not in cache:
            m = torch.arange(T, device=self.valid.device)
            cache[T] = m[:, None] - m[None, :] + (T - 1)
        return cache[T]

    def pairs_by_distance(self, max_len: int) -> torch.Tensor:
        """(2 * max_len - 1,) float64: valid pairs at each m - n (index m - n + max_len - 1)."""
        cache = self.__dict__.setdefault("_pairs_by_distance", {})
        if max_len not in cache:
            counts = (self.pair_mask[:, 0] & self.valid.bool()[:, :, None]).to(torch.float64).sum(0)  # (T, T)
            cache[max_len] = diagonal_sums(counts[None], max_len)[0]
        return cache[max_len]

    def to(self, device) -> "BatchInfo":
        """This batch on ``device``, with :data:`HOST_FACTS` computed here (on the host tensors) and carried
        over: the device copy never has to be read back to steer the analyses."""
        out = BatchInfo(to_device(self.valid, device), self.causal, to_device(self.key_onehot, device),
                        to_device(self.query_onehot, device), self.window)
        for name in HOST_FACTS:
            value = getattr(self, name)
            out.__dict__[name] = value.to(device) if isinstance(value, KeyOrder) else value
        return out

    def select(self, rows: slice) -> "BatchInfo":
        return BatchInfo(self.valid[rows], self.causal, self.key_onehot[rows], self.query_onehot[rows], self.window)

    def windowed(self, window: int | None) -> "BatchInfo":
        """This batch with a sliding window (the host facts carried over: a window changes none of them but
        ``needs_mask``)."""
        out = BatchInfo(self.valid, self.causal, self.key_onehot, self.query_onehot, window)
        for name in HOST_FACTS:
            if name in self.__dict__ and name != "needs_mask":
                out.__dict__[name] = self.__dict__[name]
        return out


@dataclass(frozen=True)
class KeyOrder:
    """A batch's valid keys sorted by category: ``x[seq, pos]`` (N, ...) holds them category by
    category, category c in rows ``spans[c]``. Found on the host (the spans steer Python code)."""

    seq: torch.Tensor
    """(N,) long: the sequence of each sorted key."""
    pos: torch.Tensor
    """(N,) long: its position."""
    rows: torch.Tensor
    """(N,) long: seq * T + pos, its row in a (B * T, ...) view: for a contiguous x, ``x.view(B * T, -1)
    .index_select(0, rows)`` gathers the same rows as ``x[seq, pos]``, several times faster on a CPU."""
    spans: list
    """Per category, (start, end) of its rows."""
    member: torch.Tensor
    """(C, N) float32: 1 where row n is a key of category c (a product with it sums by category)."""

    def to(self, device) -> "KeyOrder":
        seq, pos, rows, member = (to_device(t, device) for t in (self.seq, self.pos, self.rows, self.member))
        return KeyOrder(seq, pos, rows, self.spans, member)


def windowed_sum(per_query: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """(B, H, T, ...) -> the same, summed at each n over the positions m with 0 <= m - n < ``window`` (causal) or
    |m - n| < ``window``: differences of one cumulative sum."""
    T = per_query.shape[2]
    c = torch.nn.functional.pad(per_query.movedim(2, -1).cumsum(-1), (1, 0))  # (..., T + 1): c[i] = sum of m < i
    n = torch.arange(T, device=per_query.device)
    hi = (n + window).clamp(max=T)  # m < n + W
    lo = n if causal else (n - window + 1).clamp(min=0)
    return (c[..., hi] - c[..., lo]).movedim(-1, 2)


def reverse_cumsum_by_product(per_query: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """(B, H, T, ...) -> the same, summed over positions m >= n at each n: one product with a (T, T)
    upper-triangular matrix of ones (kept in ``cache`` per dtype)."""
    T = per_query.shape[2]
    cache = {} if cache is None else cache
    if per_query.dtype not in cache:
        cache[per_query.dtype] = torch.ones(T, T, dtype=per_query.dtype, device=per_query.device).triu()
    x = per_query.reshape(*per_query.shape[:3], -1)  # (B, H, T, X)
    return torch.matmul(cache[per_query.dtype], x).reshape(per_query.shape)


def diagonal_sums(a: torch.Tensor, max_len: int) -> torch.Tensor:
    """(H, T, T) -> (H, 2 * max_len - 1): sums of a[:, m, n] over m - n = i - (max_len - 1)."""
    H, T, _ = a.shape
    m = torch.arange(T, device=a.device)
    index = (m[:, None] - m[None, :] + max_len - 1).reshape(-1)
    out = torch.zeros(H, 2 * max_len - 1, dtype=a.dtype, device=a.device)
    return out.index_add_(1, index, a.reshape(H, -1))


@dataclass(eq=False)
class LayerQK:
    """One attention layer of one batch, as ``Producer.add_layer`` receives it: q and k as the model's attention
    kernel received them, the batch (``valid``, categories), and with the ``layer_inputs`` site what k was made
    from; ``product`` gives the attention products the analyses declared, computed once for all of them."""

    layer: int
    """The block's index (0-based), as in the tables' ``layer`` column for attention statistics."""
    query: torch.Tensor
    """(B, H, T, d_h) q as the model uses it (after RoPE), float32."""
    key: torch.Tensor
    """(B, H_kv, T, d_h) k as the model uses it (after RoPE), float32."""
    scaling: float
    """The factor on q·k before the softmax (usually 1/sqrt(d_h); the model's own, read from its kernel call)."""
    batch: BatchInfo
    """The batch's masks and token categories (:class:`BatchInfo`), shared by every layer."""
    x: torch.Tensor | None = None
    """(B, T, d) the input of the key projection (METHODS.md x), float32."""
    w_key: torch.Tensor | None = None
    """(H_kv, d, d_h) key projection per key head."""
    b_key: torch.Tensor | None = None
    """(H_kv, d_h) key bias, or None."""
    cos: torch.Tensor | None = None
    """(B, T, rot) rotary cos (None without RoPE), in the layout of ``unrotation``."""
    sin: torch.Tensor | None = None
    """(B, T, rot) rotary sin, like ``cos``."""
    unrotation: tuple | None = None
    """:func:`~actlake.analysis.engine.rope.factors` of R_n^T for cos and sin (None: computed when first used)."""
    needs: frozenset = frozenset()
    """Products of the attention weights the analyses will read (computed together, once)."""
    method: str = "explicit"
    """``explicit``: weights in blocks; ``fused``: one-hot V through the fused kernel when that suffices;
    ``flash``: FlashAttention (causal, GPU); ``padded``: the Triton kernels (bidirectional, right padding, GPU)."""
    value: torch.Tensor | None = None
    """(B, H_kv, T, d_h) float32 value, for the ``output`` product."""
    max_elements: int | None = None
    """Attention weights per explicit block (None: the device default)."""
    native: tuple | None = None
    """(query, key, value) as the model's kernel received them (its dtype), for ``method == "flash"``."""
    triton: bool = False
    """With ``method == "flash"``: the ``distance`` and ``weighted_qsum`` products from the Triton kernels
    (:mod:`~actlake.analysis.engine.kernels`) instead of explicit blocks and FlashAttention's backward."""
    key_scale: torch.Tensor | None = None
    """(B, H_kv, T) float32 1 / r_n of a key norm (METHODS.md §3: k = R(g (x W_K + b_K) / r)), or None."""
    key_scale_dims: torch.Tensor | None = None
    """(d_h,) float32: 1 on the dims of k that ``key_scale`` scales, 0 on the others (multi-head latent attention:
    the latent part of k is normed, its rotary part is not); None: every dim."""
    key_gain: torch.Tensor | None = None
    """(H_kv, d_h) float32 gain g of a key norm after RoPE (METHODS.md §3: k' = g ⊙ R_n(x W_K + b_K) / r_n), applied
    to q' before the un-rotation (:meth:`unrotate`); None: any gain is folded into ``w_key``."""
    key_shift: torch.Tensor | None = None
    """(H_kv, d_h) float32 bias beta of a key LayerNorm (k = R_n(g ⊙ (y P) / r_n + beta)), added after the norm's
    1 / r_n: a term of the score no dimension of x owns, part of the bias term (not scaled by ``key_scale``); or
    (B, H_kv, T, d_h), one per key: clipped keys' correction clamp(y) - y (``clip_qkv``); or None."""
    softcap: float | None = None
    """Attention logit softcapping: weights from cap * tanh(score / cap) (contributions are of the score)."""
    sinks: torch.Tensor | None = None
    """(H,) float32 learned sink logits (gpt-oss): one more column in each query's softmax that no key owns, so
    the weights over keys sum to 1 minus the sink's share (the ``sink`` product)."""
    _cache: dict = field(default_factory=dict, repr=False)

    # shortcuts to the batch
    @property
    def valid(self) -> torch.Tensor:
        """(B, T): 1 for real tokens, 0 for padding (``batch.valid``)."""
        return self.batch.valid

    @property
    def causal(self) -> bool:
        """Whether a query sees only earlier keys (``batch.causal``)."""
        return self.batch.causal

    @property
    def key_onehot(self) -> torch.Tensor:
        """(B, T, C) float64: each key token's category, one-hot over the C categories (zero on padding)."""
        return self.batch.key_onehot

    @property
    def query_onehot(self) -> torch.Tensor:
        """(B, T, C) float64: each query token's category, one-hot (zero on padding)."""
        return self.batch.query_onehot

    @property
    def n_heads(self) -> int:
        """H, the query heads (``query.shape[1]``); ``key`` has H_kv <= H (grouped-query attention)."""
        return self.query.shape[1]

    @property
    def key_per_query_head(self) -> torch.Tensor:
        """(B, H, T, d_h): key head h // (H / H_kv) for each query head h."""
        if "k" not in self._cache:
            self._cache["k"] = expand_kv(self.key, self.n_heads)
        return self._cache["k"]

    @property
    def valid_query(self) -> torch.Tensor:
        """(B, H, T, d_h) q, zero on padded or excluded queries."""
        if "valid_query" not in self._cache:
            has_invalid = any(self.batch.has_invalid)
            self._cache["valid_query"] = self.query * self.batch.validf[:, None, :, None] if has_invalid else self.query
        return self._cache["valid_query"]

    @property
    def key_norms(self) -> torch.Tensor:
        """(B, H, T) ||k'_n|| per query head."""
        if "key_norms" not in self._cache:
            self._cache["key_norms"] = self.key_per_query_head.norm(dim=-1)
        return self._cache["key_norms"]

    @property
    def key_norms_safe(self) -> torch.Tensor:
        """(B, H, T) ||k'_n|| clamped to at least 1e-30, to divide by."""
        if "key_norms_safe" not in self._cache:
            self._cache["key_norms_safe"] = self.key_norms.clamp(min=1e-30)
        return self._cache["key_norms_safe"]

    def sum_over_queries(self, per_query: torch.Tensor) -> torch.Tensor:
        """For each key n, the sum of ``per_query`` (B, H, T, ...) over the queries that may attend to n (zero it
        on padded queries first)."""
        return self.batch.sum_over_queries(per_query)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """R_n^T (g ⊙ y) at each key position n (y: (B, H, T, ..., d_h)), g the gain of a key norm after RoPE
        (:attr:`key_gain`, 1 without one): the transpose of what follows the key projection's 1 / r_n; y itself
        without RoPE or such a gain."""
        if self.key_gain is not None:
            g = expand_kv(self.key_gain[None, :, None], y.shape[1])[0, :, 0]  # (H, d_h)
            y = y * g.reshape(1, g.shape[0], *(1,) * (y.dim() - 3), g.shape[1]).to(y.dtype)
        if self.cos is None:
            return y
        if self.unrotation is None:
            raise ValueError("LayerQK.unrotation must be set with cos and sin (rope.factors: it knows the layout)")
        return rope.apply(y, self.unrotation)

    def queries_per_key(self) -> torch.Tensor:
        """(B, T) float64: valid queries that may attend to each key (0 on padded keys)."""
        return self.batch.queries_per_key

    def weights(self) -> torch.Tensor:
        """(B, H, T, T) float32 attention weights: softmax over the keys each query may see (and the sink, which
        takes its share of each row, when the model has one), zero rows for padded or excluded queries. Built
        whole (O(B H T^2) memory), for analyses that need alpha itself;
        the built-in ones read :meth:`product` instead."""
        if "weights" not in self._cache:
            logits = torch.matmul(self.query * self.scaling, self.key_per_query_head.transpose(-1, -2))
            logits = capped(logits, self.softcap)
            logits = logits.masked_fill(~self.batch.weight_mask, float("-inf"))
            self._cache["weights"] = aw.softmax_with_sinks(logits, self.sinks)[0] * self.batch.validf[:, None, :, None]
        return self._cache["weights"]

    def product(self, name: str) -> torch.Tensor:
        """One of :data:`~actlake.analysis.engine.attention_weights.PRODUCTS` of this layer's attention weights.

        The first request computes every product in ``needs`` (plus this one) in a single pass
        (explicit blocks, or the fused kernel when ``method == "fused"`` and that suffices; with
        ``method == "flash"``, FlashAttention kernels for all but the distance profile, which explicit
        blocks give, or with ``triton`` the Triton kernels).
        """
        if name not in self._cache:
            todo = (set(self.needs) | {name}) - self._cache.keys()
            if self.method != "explicit" and self.sinks is not None:
                raise ValueError("a layer with sinks has its products from explicit weights only (method='explicit')")
            if self.method == "flash":
                flash = aw.FLASH | (aw.TRITON if self.triton else frozenset())
                self._cache.update(aw.flash_products(self, todo & flash))
                todo -= flash
            elif self.method == "padded":  # bidirectional, right padding, the Triton kernels on
                from actlake.analysis.engine.kernels import padded_products  # imports triton, there only

                self._cache.update(padded_products(self, todo & aw.PADDED))
                todo -= aw.PADDED
            if not todo:
                pass
            elif self.method == "fused" and not todo & aw.EXPLICIT_ONLY:
                self._cache.update(aw.fused_products(self, todo))
            else:
                self._cache.update(aw.explicit_products(self, todo, self.value, self.max_elements))
        return self._cache[name]

    def select(self, rows: slice) -> "LayerQK":
        """The same layer for a subset of the batch's sequences."""
        cut = lambda t: None if t is None else t[rows]
        return LayerQK(self.layer, self.query[rows], self.key[rows], self.scaling, self.batch.select(rows),
                       cut(self.x), self.w_key, self.b_key, cut(self.cos), cut(self.sin),
                       None if self.unrotation is None else (cut(self.unrotation[0]), cut(self.unrotation[1]), *self.unrotation[2:]),
                       self.needs,
                       "explicit" if self.method in ("flash", "padded") else self.method, cut(self.value),
                       self.max_elements, key_scale=cut(self.key_scale), key_gain=self.key_gain,
                       key_shift=cut(self.key_shift) if self.shift_per_token else self.key_shift,
                       softcap=self.softcap,
                       sinks=self.sinks,
                       key_scale_dims=self.key_scale_dims)

    @property
    def shift_per_token(self) -> bool:
        """:attr:`key_shift` is (B, H_kv, T, d_h), one per key (clipped keys' correction), not (H_kv, d_h)."""
        return self.key_shift is not None and self.key_shift.dim() == 4

    @property
    def key_scale_per_query_head(self) -> torch.Tensor | None:
        """(B, H, T) :attr:`key_scale` for each query head, or None."""
        if self.key_scale is None:
            return None
        return expand_kv(self.key_scale[..., None], self.n_heads)[..., 0]

    def scale_keys(self, y: torch.Tensor, per_query_head: bool = True) -> torch.Tensor:
        """y (B, H, T, ..., d_h) times the key scale at each key position n, on the dims it applies to
        (:attr:`key_scale_dims`); y itself without a key norm. ``per_query_head`` False: y has H_kv heads."""
        if self.key_scale is None:
            return y
        s = self.key_scale_per_query_head if per_query_head else self.key_scale  # (B, H, T)
        s = s.reshape(s.shape + (1,) * (y.dim() - 3))
        if self.key_scale_dims is not None:
            s = 1 + (s - 1) * self.key_scale_dims.to(s.dtype)
        return y * s


