"""The per-layer ops of the compact forward (`llama.LlamaFamilyForward`), one implementation per route.

A forward of T rows runs one `Ops` object, its plan (`LlamaFamilyForward.plan(T)`), chosen once per width when the
runner's settings change: the forward itself is straight-line code over the layers and never asks which op goes
where. Implementations:

  TorchOps          F.linear and torch ops (any device; what `torch.compile` fuses)
  CpuTransposedOps  TorchOps with every matmul from a pre-transposed [in, out] copy (small models on the CPU)
  TritonAttnOps     TorchOps with the attention through `kernels.rows_attention` (verify / hand-off widths)
  TritonStepOps     the one-token step through `draftsmith.decode.kernels` (gemv with its folds, rope_and_cache,
                    decode_attention); each op of TRITON_OPS not routed stays TorchOps'
  TritonRowsOps     the T-row step (matmuls: `experimental.gemm_rows`, or the gemv over rows; rows_attention)

The split between torch and kernels is made in the constructors (`TritonStepOps` binds each routed op's kernel
method over TorchOps' once), so every op of a plan runs the same launches, in the same order, as the op-by-op
forward it replaces did.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from draftsmith.decode.llama import _rms, _rotate_half, grouped_attention, linear_add, prepare_mask


def mlp_folds(silu: bool, routed: frozenset, one_row: bool = True) -> tuple[bool, bool]:
    """Where a forward computes silu(gate) * up: (in gate_up's epilogue, in down's prologue — the one-row gemv
    only); neither for another activation (torch computes it between the two matmuls)."""
    glu = silu and "gate_up" in routed
    return glu, silu and not glu and "down" in routed and one_row


def _realize(*xs):
    """`kernels.realize`: under torch.compile, index tensors as buffers made once per forward (else inductor
    re-computes them for every kernel call that takes them: 2-3 launches per layer in a traced round)."""
    from draftsmith.decode.kernels import realize

    return realize(*xs)


class Ops:
    """The ops of a forward of T rows over one layer `L` (an element of `layers`), in the order the forward calls
    them. `prepare(mask, positions, slots) -> (attn_mask, rope, slots)` runs once per forward: `attn_mask` is what
    `attention` takes as its mask, `rope` what `rope_cache` takes as its positions, `slots` what both take as slots.
    Shapes: h [T, H], q [1, T, nh, d], o [T, nh * d], logits [R, V] fp32."""

    name = "ops"
    routed: frozenset = frozenset()  # the ops of llama.TRITON_OPS this plan sends to draftsmith.decode.kernels
    layers: list  # what each layer's ops take as `L`

    def prepare(self, mask, positions, slots):
        raise NotImplementedError

    def qkv(self, h, L):
        raise NotImplementedError

    def rope_cache(self, qkv, positions, slots, kc, vc, L):
        raise NotImplementedError

    def attention(self, q, kc, vc, mask, slots, S):
        raise NotImplementedError

    def o_proj(self, o, h, L):
        raise NotImplementedError

    def mlp(self, h, L):
        raise NotImplementedError

    def lm_head(self, hs):
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(routed={sorted(self.routed)})"


class TorchOps(Ops):
    """F.linear and torch ops: HF's modules op for op (what a GPU runs with kernels="torch", and what torch.compile
    fuses). `f` is the LlamaFamilyForward (read at call time: the caches, RoPE tables and `attn_impl` it may swap)."""

    name = "torch"

    def __init__(self, f):
        self.f = f
        self.layers = f.layers
        self.eps = f.eps
        self.nh, self.nkv, self.d = f.n_heads, f.n_kv, f.head_dim

    # the matmul and the matmul + residual every op below takes (a plan may bind others: TritonAttnOps' lt_matmuls)
    _linear = staticmethod(F.linear)
    _linear_add = staticmethod(linear_add)

    def _lin(self, x, ws, bs):
        if len(ws) == 1:
            return self._linear(x, ws[0], bs[0])
        return torch.cat([self._linear(x, w, b) for w, b in zip(ws, bs)], -1)

    def _rope_rows(self, positions):
        f = self.f
        cos = f.cos.index_select(0, positions)[None, :, None, :]  # [1, T, 1, d]
        sin = f.sin.index_select(0, positions)[None, :, None, :]
        return cos, sin

    def prepare(self, mask, positions, slots):
        # the additive mask is built once per forward and shared by all layers (`llama.prepare_mask`)
        rope = self._rope_rows(positions)
        return prepare_mask(mask, self.nh // self.nkv, self.f.dtype), rope, slots

    def qkv(self, h, L):
        return self._lin(_rms(h, L.input_norm, self.eps), L.qkv, L.qkv_bias)

    def rope_cache(self, qkv, positions, slots, kc, vc, L):
        cos, sin = positions
        nh, nkv = self.nh, self.nkv
        qkv = qkv.view(1, qkv.shape[0], nh + 2 * nkv, self.d)
        qk, v = qkv[:, :, : nh + nkv], qkv[:, :, nh + nkv :]
        if L.qk_norm is not None:
            qk = _rms(qk, L.qk_norm, self.eps)
        qk = (qk * cos) + (_rotate_half(qk) * sin)  # RoPE on q and k heads in one pass
        q, k = qk[:, :, :nh], qk[:, :, nh:]
        kc.index_copy_(2, slots, k.transpose(1, 2))
        vc.index_copy_(2, slots, v.transpose(1, 2))
        return q

    def attention(self, q, kc, vc, mask, slots, S):
        f = self.f
        o = grouped_attention(q.transpose(1, 2), kc[:, :, :S], vc[:, :, :S], mask, f.scale, f.attn_impl)
        return o.transpose(1, 2).reshape(q.shape[1], self.nh * self.d)

    def o_proj(self, o, h, L):
        return self._linear_add(h, o, L.o, L.o_bias)

    def mlp(self, h, L):
        g, u = self._lin(_rms(h, L.post_norm, self.eps), L.gate_up, L.gate_up_bias).chunk(2, -1)
        return self._linear_add(h, self.f.act(g) * u, L.down, L.down_bias)

    def lm_head(self, hs):
        f = self.f
        return self._linear(_rms(hs, f.norm, self.eps), f.lm_head, None).float()


@dataclasses.dataclass
class TransposedLayer:
    """A layer's weights for `CpuTransposedOps`: the borrowed `LayerWeights` (norms, biases) and contiguous [in, out]
    copies of its four matrices."""

    w: object  # llama.LayerWeights
    qkv_t: torch.Tensor
    o_t: torch.Tensor
    gate_up_t: torch.Tensor
    down_t: torch.Tensor


class CpuTransposedOps(TorchOps):
    """TorchOps with every matmul as x @ W^T from a contiguous [in, out] copy (`LlamaFamilyForward.cpu_transposed`:
    MKL's x @ W.t(), what F.linear runs, takes ~2x as long for a small model's shapes): the same ops in the same
    order."""

    name = "cpu_transposed"

    def __init__(self, f, layers: list, lm_head_t: torch.Tensor):
        super().__init__(f)
        self.layers = layers
        self.lm_head_t = lm_head_t

    @staticmethod
    def _mm(x, wt, b):
        """x [T, in] @ wt [in, out] (+ b): F.linear with a pre-transposed weight."""
        return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)

    def qkv(self, h, L):
        return self._mm(_rms(h, L.w.input_norm, self.eps), L.qkv_t, L.w.qkv_bias[0])

    def rope_cache(self, qkv, positions, slots, kc, vc, L):
        return super().rope_cache(qkv, positions, slots, kc, vc, L.w)

    def o_proj(self, o, h, L):
        return h + self._mm(o, L.o_t, L.w.o_bias)

    def mlp(self, h, L):
        g, u = self._mm(_rms(h, L.w.post_norm, self.eps), L.gate_up_t, L.w.gate_up_bias[0]).chunk(2, -1)
        return h + self._mm(self.f.act(g) * u, L.down_t, L.w.down_bias)

    def lm_head(self, hs):
        x = _rms(hs, self.f.norm, self.eps)
        # one row: MKL's gemv over W [V, H] is as fast as the transposed copy (0.44 vs 0.46 ms at V=16384)
        logits = F.linear(x, self.f.lm_head) if x.shape[0] == 1 else torch.mm(x, self.lm_head_t)
        return logits.float()


@dataclasses.dataclass
class FusedLayer:
    """A layer for `TritonAttnOps` with KernelConfig.cluster_gemm_fused: the borrowed `LayerWeights`, whether it is the
    first (its q/k/v makes the norm's inputs from the embedding), the RMSNorm weight after its down projection (the
    next layer's input norm, the final norm after the last) and whether the next matmul folds that norm (keep)."""

    w: object  # llama.LayerWeights
    first: bool
    next_norm: torch.Tensor
    keep: bool


class TritonAttnOps(TorchOps):
    """A wider forward (a verify, a hand-off; up to `kernels.ROWS_ATTN_MAX` rows): torch's matmuls and norms, the
    attention through `kernels.rows_attention` — one kernel pair over the tree mask where torch needs the mask
    expanded, two batched matmuls, a softmax and two copies — and (with "rope" routed) q/k norm, RoPE and the cache
    writes through `kernels.rope_and_cache`, one kernel where a compiled torch forward takes two (BENCHMARKS.md,
    "the wide forwards' residual adds kept out of addmm"). Torch custom ops, so a compiled forward traces them."""

    name = "triton_attn"

    def __init__(self, f, routed: frozenset = frozenset({"attn"})):
        super().__init__(f)
        from draftsmith.decode import kernels as K

        self.K = K
        self.config = f.kernel_config
        self.routed = frozenset(routed)
        if "rope" in self.routed:
            self.rope_cache = self._rope_cache_kernel
        if self.config.lt_matmuls and f.device.type == "cuda":
            from draftsmith.decode.experimental.cublaslt import lt_linear

            self._lt_linear = lt_linear
            self._linear, self._linear_add = self._lt, self._lt_add
        elif self.config.cluster_gemm:  # (where the kernel does not run — not CUDA sm_90 — its ops are torch's)
            from draftsmith.decode.experimental import cluster_gemm

            self._cg_mod = cluster_gemm
            self._linear, self._linear_add = self._cg, self._cg_add
            if self.config.cluster_gemm_fused and self._can_fuse(f):
                ws = f.layers
                self.layers = [
                    FusedLayer(L, i == 0, ws[i + 1].input_norm if i + 1 < len(ws) else f.norm, i + 1 < len(ws))
                    for i, L in enumerate(ws)
                ]
                self.qkv, self.o_proj, self.mlp = self._qkv_fused, self._o_fused, self._mlp_fused
                self._rope_inner, self.rope_cache = self.rope_cache, self._rope_cache_fused
                if self.config.cluster_gemm_rope and "rope" in self.routed and all(L.qk_norm is None for L in ws):
                    # RoPE and the cache writes in q/k/v's reduction: qkv() hands h through, rope_cache() launches it
                    self.qkv, self.rope_cache = self._qkv_defer, self._qkv_rope_fused
                    if self.config.cluster_gemm_layer and "attn" in self.routed:
                        # and the attention and o in the same launch: prepare() keeps the mask for it, attention()
                        # and o_proj() hand on what it made
                        self.rope_cache, self.attention, self.o_proj = (
                            self._layer_fused,
                            self._attn_handed,
                            self._o_handed,
                        )
                        self._prepare_routed, self.prepare = self.prepare, self._prepare_keep_mask
                self._stream = None  # (hn, ssq) the last producer handed the next norm-folding matmul
                self._attn_mask = self._handed = None

    # experimental (KernelConfig.cluster_gemm): the layers' matmuls through our CUDA kernel where it takes the shape
    # (bias-free, at most its rows, N of its tile; a vocabulary-wide N — the lm_head — only where the plans or
    # cluster_gemm.PLANS name its shape, cuBLAS's otherwise), F.linear elsewhere
    def _cg_plan(self, x, w, b):
        cg = self._cg_mod
        if b is not None or x.dim() != 2:
            return None
        if (
            w.shape[0] > cg.N_MAX
            and tuple(w.shape) not in self.config.cluster_gemm_plans
            and tuple(w.shape) not in cg.PLANS
        ):
            return None
        plan = self._plan_of(w)
        return plan if cg.supports(x, w, plan[0], check_ptr=False) else None

    def _cg(self, x, w, b):
        plan = self._cg_plan(x, w, b)
        if plan is None:
            return F.linear(x, w, b)
        return self._cg_mod.cluster_gemm_op(x, w, plan[0], plan[1], self.config.pdl, self.config.cluster_gemm_late)

    def _cg_add(self, h, x, w, b):
        plan = self._cg_plan(x, w, b)
        if plan is None:
            return linear_add(h, x, w, b)
        return h + self._cg_mod.cluster_gemm_op(x, w, plan[0], plan[1], self.config.pdl, self.config.cluster_gemm_late)

    # experimental (KernelConfig.cluster_gemm_fused): the layer as q/k/v (its norm folded) -> RoPE -> attention -> o
    # (+ residual; h * post_norm and h's sums of squares out) -> gate/up (norm and silu * up folded) -> down (+ residual;
    # the next norm's inputs out): the producers hand (hn, ssq) to the next matmul through `_stream`, in the forward's
    # call order; the first layer's q/k/v makes them from the embedding (`cluster_gemm.norm_inputs`). A width the
    # kernel does not take (more rows than its tokens) takes the custom ops' torch fallbacks.
    @staticmethod
    def _can_fuse(f) -> bool:
        return (
            str(getattr(f.cfg, "hidden_act", "silu")) == "silu"
            and f.dtype == torch.bfloat16
            and all(
                len(L.qkv) == 1
                and len(L.gate_up) == 1
                and L.qkv_bias[0] is None
                and L.gate_up_bias[0] is None
                and L.o_bias is None
                and L.down_bias is None
                for L in f.layers
            )
        )

    def _plan_of(self, w):
        return self.config.cluster_gemm_plans.get((w.shape[0], w.shape[1])) or self._cg_mod.plan_for(*w.shape)

    def _norm_stream(self, h, first, nw):
        """(h * nw, h's sums of squares): the last producer's, or the first layer's from the embedding."""
        if first:
            return self._cg_mod.norm_inputs(h, nw)
        stream, self._stream = self._stream, None
        return stream

    def _normed(self, h, first, nw, w, glu):
        hn, ssq = self._norm_stream(h, first, nw)
        v, s = self._plan_of(w)
        return self._cg_mod.cluster_gemm_normed_op(hn, w, ssq, self.eps, glu, v, s, self.config.pdl,
                                                   self.config.cluster_gemm_late)  # fmt: skip

    def _produce(self, x, w, h, nw, keep=True):
        v, s = self._plan_of(w)
        h, hn, ssq = self._cg_mod.cluster_gemm_produce_op(x, w, h, nw, v, s, self.config.pdl,
                                                          self.config.cluster_gemm_late)  # fmt: skip
        if keep:  # (the last layer's are not used: the lm_head's norm is torch's)
            self._stream = (hn, ssq)
        return h

    def _qkv_fused(self, h, FL):
        return self._normed(h, FL.first, FL.w.input_norm, FL.w.qkv[0], False)

    def _rope_cache_fused(self, qkv, positions, slots, kc, vc, FL):
        return self._rope_inner(qkv, positions, slots, kc, vc, FL.w)

    @staticmethod
    def _qkv_defer(h, FL):
        return h

    def _qkv_rope_fused(self, h, positions, slots, kc, vc, FL):  # KernelConfig.cluster_gemm_rope
        hn, ssq = self._norm_stream(h, FL.first, FL.w.input_norm)
        w, f, c = FL.w.qkv[0], self.f, self.config
        v, s = self._plan_of(w)
        q = self._cg_mod.cluster_gemm_qkv_rope_op(
            hn, w, ssq, self.eps, positions, slots, f.cos, f.sin, kc, vc, self.nh, self.nkv, v, s, c.pdl,
            c.cluster_gemm_late,
        )  # fmt: skip
        return q.view(1, q.shape[0], self.nh, self.d)

    def _o_fused(self, o, h, FL):
        return self._produce(o, FL.w.o, h, FL.w.post_norm)

    # experimental (KernelConfig.cluster_gemm_layer): q/k/v, attention and o as one op, launched from rope_cache()
    def _prepare_keep_mask(self, mask, positions, slots):
        out = self._prepare_routed(mask, positions, slots)
        self._attn_mask = out[0]
        return out

    def _layer_fused(self, h, positions, slots, kc, vc, FL):
        hn, ssq = self._norm_stream(h, FL.first, FL.w.input_norm)
        w, wo, f, c = FL.w.qkv[0], FL.w.o, self.f, self.config
        (v, s), (ov, osp) = self._plan_of(w), self._plan_of(wo)
        q, a, h, hn, ssq = self._cg_mod.cluster_gemm_layer_op(
            hn, w, ssq, self.eps, positions, slots, f.cos, f.sin, kc, vc, self._attn_mask, f.scale, self.nh, self.nkv,
            wo, h, FL.w.post_norm, v, s, ov, osp, c.pdl, c.cluster_gemm_late,
        )  # fmt: skip
        self._handed = (a, h, hn, ssq)
        return q.view(1, q.shape[0], self.nh, self.d)

    def _attn_handed(self, q, kc, vc, mask, slots, S):
        return self._handed[0]

    def _o_handed(self, o, h, FL):
        _attn, h, hn, ssq = self._handed
        self._handed, self._stream = None, (hn, ssq)
        return h

    def _mlp_fused(self, h, FL):
        a = self._normed(h, False, FL.w.post_norm, FL.w.gate_up[0], True)
        return self._produce(a, FL.w.down, h, FL.next_norm, FL.keep)

    # experimental (KernelConfig.lt_matmuls): the matmuls through the cuBLASLt algorithm tuned for this width, F.linear
    # (and linear_add for the residual adds) where none was
    def _lt_algo(self, x, w, b):
        return None if b is not None else self.config.lt_tuned.get((x.shape[0], w.shape[0], w.shape[1], str(x.dtype)))

    def _lt(self, x, w, b):
        algo = self._lt_algo(x, w, b)
        return F.linear(x, w, b) if algo is None else self._lt_linear(x, w, algo, self.config.lt_search)

    def _lt_add(self, h, x, w, b):
        algo = self._lt_algo(x, w, b)
        # linear_add, not h + F.linear: inductor's addmm rewrite would bring back a memcpy a matmul (measured: the
        # first lt A/B, whose untuned fallback was `h + F.linear`, lost 0.1-0.2 ms a verify)
        return linear_add(h, x, w, b) if algo is None else h + self._lt_linear(x, w, algo, self.config.lt_search)

    def prepare(self, mask, positions, slots):
        # the kernels take the boolean mask, the positions and the slots, made once for all layers' calls (`_realize`)
        if "rope" in self.routed:
            return tuple(_realize(mask, positions, slots))
        mask, slots = _realize(mask, slots)
        return mask, self._rope_rows(positions), slots

    def _rope_cache_kernel(self, qkv, positions, slots, kc, vc, L):
        f = self.f
        return self.K.rope_and_cache(
            qkv, positions, slots, f.cos, f.sin, kc, vc, self.nh, self.nkv, L.qk_norm, self.eps, config=self.config
        )[None]  # [1, T, nh, d]

    def attention(self, q, kc, vc, mask, slots, S):
        return self.K.rows_attention(q[0], kc, vc, mask, self.f.scale, slots, config=self.config)  # [T, nh * d]


class TritonStepOps(TorchOps):
    """The one-token step through `draftsmith.decode.kernels`: norms, residual adds, silu*up, RoPE and the cache write
    folded into seven kernels a layer (BENCHMARKS.md "P1"). `routed` (a subset of llama.TRITON_OPS) says which ops
    take the kernels; the others keep TorchOps' — bound here, once."""

    name = "triton_step"
    one_row = True

    def __init__(self, f, routed: frozenset, rows: int = 1):
        """`rows`: the most rows the runner sends through the kernels (`LlamaFamilyForward._kernel_rows`); an lm_head
        over more (logits_rows) takes torch's."""
        super().__init__(f)
        from draftsmith.decode import kernels as K

        self.K = K
        self.routed = frozenset(routed)
        self.rows = rows
        self.config = f.kernel_config
        silu = str(getattr(f.cfg, "hidden_act", "silu")) == "silu"
        self.glu, self.fold_act = mlp_folds(silu, self.routed, self.one_row)
        # the matmul launcher with the runner's kernel settings (only where a matmul takes it)
        self.lin = functools.partial(self._launcher(), config=self.config) if self.routed - {"attn", "rope"} else None
        r = self.routed
        if "qkv" in r:
            self.qkv = self._qkv_kernel
        if "rope" in r:
            self.rope_cache = self._rope_cache_kernel
        # `KernelConfig.rope_fold` (read at call time: benchmarks flip it on the runner's config): the q/k/v matmul
        # (gemv, or gemm_rows for T rows) does RoPE and the cache writes in its epilogue — qkv() hands h through and
        # rope_cache() launches it
        self._can_fold_rope = {"qkv", "rope"} <= r and all(L.qk_norm is None for L in self.layers) and self.d % 2 == 0
        if self._can_fold_rope:
            self.qkv = self._qkv_or_defer
            self.rope_cache = self._rope_cache_or_fold
        if "attn" in r:
            self.attention = self._attention_kernel
        if "o" in r:
            self.o_proj = self._o_proj_kernel
        # the MLP: gate/up (with glu: silu(gate) * up in its epilogue), then down (with fold_act: silu(gate) * up in
        # its prologue; else torch's activation between the two)
        self._gate_up = self._gate_up_kernel if "gate_up" in r else self._gate_up_torch
        if self.glu:
            self._down = self._down_kernel if "down" in r else self._down_torch
        elif self.fold_act:
            self._down = self._down_fold
        else:
            self._down = self._act_down_kernel if "down" in r else self._act_down_torch
        if "lm_head" in r:
            self.lm_head = self._lm_head_kernel

    def _launcher(self):
        return self.K.gemv

    def prepare(self, mask, positions, slots):
        r = self.routed
        if positions.shape[0] > 1 and r & {"rope", "attn"}:
            # made once for all layers' kernel calls (`_realize`); the one-token step showed no re-computation
            mask, positions, slots = _realize(mask, positions, slots)
        rope = positions if "rope" in r else self._rope_rows(positions)
        return (mask if "attn" in r else self._mask(mask)), rope, slots

    def _mask(self, mask):
        return prepare_mask(mask, self.nh // self.nkv, self.f.dtype)

    def _qkv_kernel(self, h, L):
        return self.lin(h, L.qkv[0], L.input_norm, self.eps, bias=L.qkv_bias[0])

    def _fold_rope(self) -> bool:
        return self.config.rope_fold

    def _qkv_or_defer(self, h, L):
        return h if self._fold_rope() else self._qkv_kernel(h, L)

    def _rope_cache_or_fold(self, qkv, positions, slots, kc, vc, L):
        if not self._fold_rope():
            return self._rope_cache_kernel(qkv, positions, slots, kc, vc, L)
        f = self.f  # `qkv` is h here (`_qkv_or_defer`)
        rope = (positions, slots, f.cos, f.sin, kc, vc, self.nh, self.nkv)
        q = self.lin(qkv, L.qkv[0], L.input_norm, self.eps, bias=L.qkv_bias[0], rope=rope)
        return q.view(1, q.shape[0], self.nh, self.d)

    _rope_cache_kernel = TritonAttnOps._rope_cache_kernel  # q/k norm, RoPE and both cache writes in one kernel

    def _attention_kernel(self, q, kc, vc, mask, slots, S):
        return self.K.decode_attention(q, kc, vc, mask[0], self.f.scale, config=self.config, slot=slots)  # [1, nh*d]

    def _o_proj_kernel(self, o, h, L):
        return self.lin(o, L.o, bias=L.o_bias, residual=h)

    def mlp(self, h, L):
        return self._down(self._gate_up(h, L), h, L)

    def _gate_up_kernel(self, h, L):  # with glu: silu(gate) * up computed in its epilogue, [T, I]
        return self.lin(h, L.gate_up[0], L.post_norm, self.eps, bias=L.gate_up_bias[0], glu=self.glu)

    def _gate_up_torch(self, h, L):
        return self._lin(_rms(h, L.post_norm, self.eps), L.gate_up, L.gate_up_bias)

    def _down_kernel(self, gu, h, L):
        return self.lin(gu, L.down, bias=L.down_bias, residual=h)

    def _down_torch(self, gu, h, L):
        return h + F.linear(gu, L.down, L.down_bias)

    def _down_fold(self, gu, h, L):  # silu(gate) * up folded into the down projection
        return self.K.gemv(gu, L.down, bias=L.down_bias, residual=h, act_mul=True, config=self.config)

    def _act_down_kernel(self, gu, h, L):
        g, u = gu.chunk(2, -1)
        return self.lin(self.f.act(g) * u, L.down, bias=L.down_bias, residual=h)

    def _act_down_torch(self, gu, h, L):
        g, u = gu.chunk(2, -1)
        return h + F.linear(self.f.act(g) * u, L.down, L.down_bias)

    def _lm_head_kernel(self, hs):
        if hs.shape[0] <= self.rows:
            return self.lin(hs, self.f.lm_head, self.f.norm, self.eps).float()
        return TorchOps.lm_head(self, hs)


class TritonRowsOps(TritonStepOps):
    """The T-row step (`LlamaFamilyForward.triton_max_rows > 1`): the matmuls through `experimental.gemm_rows`, the
    attention through `kernels.rows_attention`; silu(gate) * up is folded into gate/up's epilogue (glu), never into
    down's prologue.

    From `gemm_rows.SSQ_MIN_K` hidden features on, the residual stream's producers (o with its residual, down with
    its residual) also return each row's sum of squares per output tile, and the next norm-folding matmul (gate/up,
    the next layer's q/k/v, the lm_head) takes the norm from them: a split-K matmul's programs would otherwise each
    read the rows' whole x for it. Handed from op to op with the tensor it describes (`_ssq`, matched by identity:
    a row selection before the lm_head, or the first layer's embedding, gets none and reads x)."""

    name = "triton_rows"
    one_row = False

    def __init__(self, f, routed: frozenset, rows: int = 1):
        super().__init__(f, routed, rows)
        from draftsmith.decode.experimental.gemm_rows import SSQ_MIN_K

        self.ssq_on = f.hidden_size >= SSQ_MIN_K
        self._ssq = None  # (the tensor, its ssq) of the last producer in this forward

    def _fold_rope(self) -> bool:
        return self.config.rope_fold and self.config.rope_fold_rows

    def _launcher(self):
        from draftsmith.decode.experimental.gemm_rows import gemm_rows

        return gemm_rows

    def prepare(self, mask, positions, slots):
        self._ssq = None
        return super().prepare(mask, positions, slots)

    def _ssq_of(self, h):
        return self._ssq[1] if self._ssq is not None and self._ssq[0] is h else None

    def _produce(self, x, w, bias, residual):
        """x @ w^T + bias + residual, the new residual stream; its ssq kept for the next norm."""
        if not self.ssq_on:
            return self.lin(x, w, bias=bias, residual=residual)
        y, ssq = self.lin(x, w, bias=bias, residual=residual, want_ssq=True)
        self._ssq = (y, ssq)
        return y

    def _attention_kernel(self, q, kc, vc, mask, slots, S):
        return self.K.rows_attention(q[0], kc, vc, mask, self.f.scale, slots, config=self.config)  # [T, nh * d]

    def _qkv_kernel(self, h, L):
        return self.lin(h, L.qkv[0], L.input_norm, self.eps, bias=L.qkv_bias[0], row_ssq=self._ssq_of(h))

    def _o_proj_kernel(self, o, h, L):
        return self._produce(o, L.o, L.o_bias, h)

    def _gate_up_kernel(self, h, L):
        return self.lin(
            h, L.gate_up[0], L.post_norm, self.eps, bias=L.gate_up_bias[0], glu=self.glu, row_ssq=self._ssq_of(h)
        )

    def _down_kernel(self, gu, h, L):
        return self._produce(gu, L.down, L.down_bias, h)

    def _lm_head_kernel(self, hs):
        ssq, self._ssq = self._ssq_of(hs), None  # the forward's last op: nothing kept past it
        if hs.shape[0] <= self.rows:
            return self.lin(hs, self.f.lm_head, self.f.norm, self.eps, row_ssq=ssq).float()
        return TorchOps.lm_head(self, hs)


__all__ = [
    "Ops",
    "TorchOps",
    "CpuTransposedOps",
    "TransposedLayer",
    "FusedLayer",
    "TritonAttnOps",
    "TritonStepOps",
    "TritonRowsOps",
    "mlp_folds",
]
