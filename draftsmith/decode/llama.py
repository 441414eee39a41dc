"""A compact forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), gpt-fast style.

One readable file: it borrows the weights of a loaded HF model (no copies, except the fused qkv and
gate/up matrices), owns a static KV cache, takes explicit positions, cache slots and a boolean attention
mask (tree or causal), and returns logits plus the aux states (outputs of the drafter's aux layers,
layer-output ids). Every shape is static given (T, max_len), so a step can be captured in a CUDA graph.
A forward of T rows is straight-line code over one ops plan (`plan(T)`, a `draftsmith.decode.ops.Ops`: torch, the
CPU's transposed copies, or Triton kernels), chosen when the settings change, never op by op inside the forward.

Numerics follow HF's modules op for op (RMSNorm in fp32, RoPE tables from HF's own rotary module), so
greedy output matches HF's to the last bit in fp32; in bf16 tiny differences of matmul blocking remain.

Supported: `model_type` in {llama, mistral, qwen2, qwen3} (q/k norm, qkv bias, attention/mlp bias),
any static RoPE type (default, linear, llama3, yarn...). Not supported (use the generic HF path):
sliding windows shorter than the cache, dynamic NTK RoPE, MoE, other architectures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from draftsmith.common.hf import text_config
from draftsmith.decode.kernel_config import KernelConfig
from draftsmith.drafter.model import hf_rms_norm

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _text_config(config):
    return text_config(config)


def supports(config, max_len: int | None = None) -> tuple[bool, str]:
    """Whether the compact forward can run this config (and why not)."""
    cfg = _text_config(config)
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        return False, f"model_type {mt!r} is not in {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None):
        return False, "mixture-of-experts is not supported by the compact forward"
    window = getattr(cfg, "sliding_window", None)
    use_sw = getattr(cfg, "use_sliding_window", True)
    layer_types = getattr(cfg, "layer_types", None) or []
    if mt in ("qwen2", "qwen3"):
        use_sw = bool(getattr(cfg, "use_sliding_window", False)) or any(t == "sliding_attention" for t in layer_types)
    if window and use_sw and (max_len is None or max_len > window):
        return False, f"sliding window {window} < cache length {max_len}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) == "dynamic":
        return False, "dynamic NTK RoPE depends on the sequence length"
    return True, ""


_rms = hf_rms_norm  # HF's RMSNorm numerics, one fused kernel on CUDA


def linear_add(residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """residual + F.linear(x, w, bias), HF's residual add (the matmul rounded to the dtype, then the sum), with the
    matmul kept apart from the add under torch.compile: inductor rewrites add(mm(x, w^T), residual) into
    addmm(residual, x, w^T), which on CUDA copies the residual into the output buffer (a device-to-device memcpy in
    the graph, ~1.3 us) before a beta=1 GEMM — two per layer of a compiled 8B verify (docs/LOG.md, 2026-12-03).
    Through a 3-D linear the add sees a view, not the mm, so the pattern does not match and the add fuses into the
    next norm's kernel."""
    return residual + F.linear(x[None], w, bias)[0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def prepare_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] bool (True = attend) -> [1, 1, groups*T, S] additive mask for `grouped_attention`
    (built once per forward and shared by all layers)."""
    if groups > 1:
        mask = mask.repeat(groups, 1)
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return add[None, None]


ATTENTION_IMPLS = ("sdpa", "bmm", "split")
# the ops of a one-token step that `kernels = "triton"` can route to draftsmith.decode.kernels
TRITON_OPS = ("qkv", "rope", "attn", "o", "gate_up", "down", "lm_head")


def grouped_attention(q, k_cache, v_cache, mask, scale, impl: str = "sdpa"):
    """q [1, nh, T, d]; caches [1, nkv, S, d]; mask [T, S] bool (True = attend) or a `prepare_mask` result
    -> [1, nh, T, d].

    Query heads that share a KV head are folded into the query length, so the KV cache is read once and
    never repeated (any backend, any mask). `impl`:
      sdpa   F.scaled_dot_product_attention (with a mask on CUDA: cuDNN's fused kernel, which like the
             memory-efficient one parallelises over heads x query blocks only: at decode (a few query rows,
             8 KV heads) a handful of CTAs walk the whole cache);
      bmm    two batched matmuls around an fp32 softmax (HF "eager" numerics; cuBLAS tiles over the keys);
      split  flash-decoding in plain torch (experimental: `draftsmith.decode.experimental.split_attention`).
    """
    _, nh, t, d = q.shape
    nkv = k_cache.shape[1]
    g = nh // nkv
    if mask.dim() == 2:
        mask = prepare_mask(mask, g, q.dtype)
    q = q.reshape(1, nkv, g * t, d)
    if impl == "sdpa":
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale)
    elif impl == "bmm":
        out = _bmm_attention(q[0], k_cache[0], v_cache[0], mask[0, 0], scale)[None]
    elif impl == "split":  # experimental (draftsmith.decode.experimental): not chosen by "auto"
        from draftsmith.decode.experimental.split_attention import split_attention

        out = split_attention(q[0], k_cache[0], v_cache[0], mask[0, 0], scale)[None]
    else:
        raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
    return out.reshape(1, nh, t, d)


def _bmm_attention(q, k, v, add_mask, scale):
    """q [n, R, d], k/v [n, S, d], add_mask [R, S] additive -> [n, R, d]."""
    s = torch.baddbmm(add_mask.expand(q.shape[0], -1, -1), q, k.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(s, -1, dtype=torch.float32).to(q.dtype), v)


@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's tensors (borrowed from the HF model; qkv and gate/up concatenated when fused: then each of
    those lists holds one matrix, else the separate q/k/v or gate/up matrices). Biases and q/k norms may be None."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: list
    qkv_bias: list
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qk_norm: torch.Tensor | None  # q_norm repeated per q head, then k_norm per kv head: one norm over both
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: list
    gate_up_bias: list
    down: torch.Tensor
    down_bias: torch.Tensor | None


class _PlanSetting:
    """A setting of `LlamaFamilyForward` its ops plans are built from: assigning a different value (after `convert`;
    `same` says what counts as the same) rebuilds the plans (`invalidate_plans`). Stored as `_<name>`."""

    def __init__(self, convert=None, same=None, doc: str | None = None):
        self.convert, self.same, self.__doc__ = convert, same or (lambda a, b: a == b), doc

    def __set_name__(self, owner, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj, value) -> None:
        value = self.convert(value) if self.convert else value
        if not self.same(value, getattr(obj, self.attr)):
            setattr(obj, self.attr, value)
            obj.invalidate_plans()


class LlamaFamilyForward(torch.nn.Module):
    """Static-cache forward of a Llama-family decoder for batch size 1."""

    def __init__(
        self,
        cfg,
        weights: dict,
        cos: torch.Tensor,
        sin: torch.Tensor,
        aux_layers: Sequence[int],
        max_len: int,
        fuse: bool = True,
    ):
        super().__init__()
        self.cfg = cfg
        self.n_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.n_heads)
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.vocab_size = int(cfg.vocab_size)
        self.scale = self.head_dim**-0.5
        from transformers.activations import ACT2FN

        self.act = ACT2FN[getattr(cfg, "hidden_act", "silu")]
        self.aux_layers = [int(i) for i in aux_layers]
        self.max_len = int(max_len)
        self.attn_impl = "sdpa"  # see grouped_attention (read by the plans at call time)
        # The settings below choose each width's plan (`plan`): assigning one rebuilds the plans.
        # "triton": one-token steps run through `draftsmith.decode.kernels` (norms, residual adds, silu*up, RoPE
        # and the cache write folded into seven kernels a layer, BENCHMARKS.md "P1"); "torch": F.linear and separate
        # ops. `triton_ops` picks which of TRITON_OPS take the kernels (the others stay torch), so a benchmark can
        # route each op to whichever is faster. Wider forwards (a verify, a hand-off) take only the attention kernel
        # (`triton_ops_for`). `triton_max_rows` > 1 also sends forwards of up to that many tokens through the T-row
        # matmul kernels (`experimental.gemm_rows`): experimental and off by default — correct but slower than
        # cuBLAS so far (docs/LOG.md).
        self._kernels = "torch"
        # the kernels' launch settings (tiles, tuned tables, PDL): filled by `tune_kernels`; a benchmark assigns
        # its own (before the engine captures graphs)
        self._kernel_config = KernelConfig()
        self._triton_ops = frozenset(TRITON_OPS)
        self._triton_max_rows = 1
        self._plans = None  # width -> Ops, built by `invalidate_plans` once the weights are in place
        self._wide_plan = None
        self.w = weights
        self._layers = []
        for i in range(self.n_layers):
            p = f"layers.{i}."
            g = lambda n: weights.get(p + n)  # noqa: E731
            qkv = [g(f"self_attn.{n}_proj.weight") for n in "qkv"]
            qkv_b = [g(f"self_attn.{n}_proj.bias") for n in "qkv"]
            gu = [g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]
            gu_b = [g("mlp.gate_proj.bias"), g("mlp.up_proj.bias")]
            if fuse:
                qkv, gu = [torch.cat(qkv, 0)], [torch.cat(gu, 0)]
                qkv_b = [torch.cat(qkv_b, 0)] if qkv_b[0] is not None else [None]
                gu_b = [torch.cat(gu_b, 0)] if gu_b[0] is not None else [None]
            q_norm, k_norm = g("self_attn.q_norm.weight"), g("self_attn.k_norm.weight")
            # one RMSNorm over q and k heads together (per-head weights)
            qk_norm = (
                torch.cat([q_norm.expand(self.n_heads, -1), k_norm.expand(self.n_kv, -1)])
                if q_norm is not None
                else None
            )
            L = LayerWeights(
                input_norm=g("input_layernorm.weight"),
                post_norm=g("post_attention_layernorm.weight"),
                qkv=qkv,
                qkv_bias=qkv_b,
                q_norm=q_norm,
                k_norm=k_norm,
                qk_norm=qk_norm,
                o=g("self_attn.o_proj.weight"),
                o_bias=g("self_attn.o_proj.bias"),
                gate_up=gu,
                gate_up_bias=gu_b,
                down=g("mlp.down_proj.weight"),
                down_bias=g("mlp.down_proj.bias"),
            )
            self._layers.append(L)
        self.embed = weights["embed_tokens.weight"]
        self.norm = weights["norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        self.cos = cos.to(self.device, self.dtype).contiguous()  # [max_len, d] (rows indexed by the kernels)
        self.sin = sin.to(self.device, self.dtype).contiguous()
        self._alloc_cache()
        self._build_cpu_transposed()  # builds the plans

    # A small model on the CPU: every matmul of the forward as x @ W^T from a contiguous [in, out] copy. MKL's
    # x @ W.t() (what F.linear runs) takes ~2x as long for these shapes, and 2.4x for a multi-row lm_head
    # ([4, 192] x [192, 16384]: 1.33 vs 0.54 ms, one thread; BENCHMARKS.md "Demo target on CPU"). The copies cost
    # the weights' size once more, so only up to CPU_TRANSPOSED_MAX_BYTES of weights (a GPU never takes them).
    CPU_TRANSPOSED_MAX_BYTES = 256 << 20

    def _build_cpu_transposed(self) -> None:
        self._wt = self._lm_head_t = None
        if (
            self.device.type == "cpu"
            and self.weight_bytes() <= self.CPU_TRANSPOSED_MAX_BYTES
            and len(self.layers[0].qkv) == 1
            and len(self.layers[0].gate_up) == 1
        ):
            from draftsmith.decode.ops import TransposedLayer

            t = lambda w: w.t().contiguous()  # noqa: E731
            self._wt = [TransposedLayer(L, t(L.qkv[0]), t(L.o), t(L.gate_up[0]), t(L.down)) for L in self.layers]
            self._lm_head_t = t(self.lm_head)
        self.invalidate_plans()

    @property
    def cpu_transposed(self) -> bool:
        """Whether the forward's torch path runs from the CPU's transposed weight copies (`ops.CpuTransposedOps`)."""
        return self._wt is not None

    def set_cpu_transposed(self, on: bool) -> None:
        """Drop the transposed copies (the generic torch path, what a GPU runs) or rebuild them where they apply."""
        if on:
            self._build_cpu_transposed()
        else:
            self._wt = self._lm_head_t = None
            self.invalidate_plans()

    def _alloc_cache(self) -> None:
        self.k_cache = self.v_cache = self.k_layers = self.v_layers = None
        shape = (self.n_layers, 1, self.n_kv, self.max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # The forward writes through these per-layer views, never through `k_cache[i]`: torch.compile sees each
        # view as its own graph input and updates it in place, while a write into a view taken inside the graph
        # is functionalised into a copy of the whole cache on every step (found in inductor's output code: two
        # full-cache copies per step, +2 ms on the 8B shape at 2,128 slots). `compact` uses the 5-D tensors.
        self.k_layers = [self.k_cache[i] for i in range(self.n_layers)]
        self.v_layers = [self.v_cache[i] for i in range(self.n_layers)]

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf(cls, model, aux_layers: Sequence[int], max_len: int, fuse: bool = True) -> LlamaFamilyForward:
        cfg = _text_config(model.config)
        ok, why = supports(cfg, max_len)
        if not ok:
            raise ValueError(f"compact forward unavailable: {why}")
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        weights = {k: v.detach() for k, v in base.state_dict().items()}
        weights["lm_head.weight"] = model.get_output_embeddings().weight.detach()
        rot = getattr(base, "rotary_emb", None)
        cos, sin = rope_table(cfg, max_len, weights["embed_tokens.weight"].device, rot)
        return cls(cfg, weights, cos, sin, aux_layers, max_len, fuse=fuse)

    @classmethod
    def random(
        cls, cfg, aux_layers: Sequence[int], max_len: int, device="cuda", dtype=torch.bfloat16, seed: int = 0
    ) -> LlamaFamilyForward:
        """Random weights of a config's shape (benchmarks of large shapes without an HF model)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        H, I = int(cfg.hidden_size), int(cfg.intermediate_size)
        nh = int(cfg.num_attention_heads)
        nkv = int(getattr(cfg, "num_key_value_heads", None) or nh)
        d = int(getattr(cfg, "head_dim", None) or H // nh)
        V = int(cfg.vocab_size)

        def r(*shape):
            t = torch.empty(*shape, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        w = {"embed_tokens.weight": r(V, H), "norm.weight": torch.ones(H, device=device, dtype=dtype)}
        w["lm_head.weight"] = r(V, H)
        for i in range(int(cfg.num_hidden_layers)):
            p = f"layers.{i}."
            w[p + "input_layernorm.weight"] = torch.ones(H, device=device, dtype=dtype)
            w[p + "post_attention_layernorm.weight"] = torch.ones(H, device=device, dtype=dtype)
            w[p + "self_attn.q_proj.weight"] = r(nh * d, H)
            w[p + "self_attn.k_proj.weight"] = r(nkv * d, H)
            w[p + "self_attn.v_proj.weight"] = r(nkv * d, H)
            w[p + "self_attn.o_proj.weight"] = r(H, nh * d)
            w[p + "mlp.gate_proj.weight"] = r(I, H)
            w[p + "mlp.up_proj.weight"] = r(I, H)
            w[p + "mlp.down_proj.weight"] = r(H, I)
        cos, sin = rope_table(cfg, max_len, device, None)
        # fuse=False keeps a single copy of each matrix (the 8B shape fits twice, but why pay)
        obj = cls(cfg, w, cos, sin, aux_layers, max_len, fuse=False)
        obj.layers = [
            dataclasses.replace(
                L, qkv=[torch.cat(L.qkv, 0)], gate_up=[torch.cat(L.gate_up, 0)], qkv_bias=[None], gate_up_bias=[None]
            )
            for L in obj.layers
        ]
        for i in range(obj.n_layers):  # drop the unfused copies
            for n in ("q", "k", "v"):
                w.pop(f"layers.{i}.self_attn.{n}_proj.weight")
            w.pop(f"layers.{i}.mlp.gate_proj.weight")
            w.pop(f"layers.{i}.mlp.up_proj.weight")
        obj._build_cpu_transposed()  # now that qkv and gate/up are fused
        return obj

    def set_max_len(self, max_len: int) -> None:
        """Reallocate the KV cache for another capacity (RoPE tables are extended if needed)."""
        max_len = int(max_len)
        if max_len > self.cos.shape[0]:
            cos, sin = rope_table(self.cfg, max_len, self.device, None)
            self.cos = cos.to(self.device, self.dtype).contiguous()
            self.sin = sin.to(self.device, self.dtype).contiguous()
        self.max_len = max_len
        self._alloc_cache()

    # ---------------------------------------------------------------- accounting
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        tensors = [self.norm, self.lm_head]
        for L in self.layers:
            tensors += [L.input_norm, L.post_norm, L.o, L.down, *L.qkv, *L.gate_up]
            tensors += [
                t for t in (L.q_norm, L.k_norm, L.o_bias, L.down_bias, *L.qkv_bias, *L.gate_up_bias) if t is not None
            ]
        for t in tensors:
            if t is None or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv * self.head_dim * self.k_cache.element_size()

    # ---------------------------------------------------------------- plans
    # A forward of T rows runs one `ops.Ops` object, chosen once per width (not op by op inside the layer loop):
    # torch, the CPU's transposed copies, or Triton kernels for the ops `triton_ops` routes (`_route`). The settings
    # that decide it are properties whose setters rebuild the plans.
    kernels = _PlanSetting()
    triton_ops = _PlanSetting(frozenset, doc='The ops of TRITON_OPS that kernels="triton" routes to the kernels.')
    triton_max_rows = _PlanSetting(int)
    # by identity: the plans launch with this object, which `tune_kernels` fills in place
    kernel_config = _PlanSetting(same=lambda a, b: a is b)
    layers = _PlanSetting(same=lambda a, b: False)

    def invalidate_plans(self) -> None:
        """Rebuild every width's plan from the current settings (the setters call it).

        Built here, eagerly, for every width whose route can differ (1 .. the widest kernel width) plus one plan
        shared by all wider forwards, so `plan` is a dict lookup that never misses: a plan built lazily inside a
        `torch.compile` trace would leave a guard on the miss, and the next call at that width would recompile."""
        if not hasattr(self, "_wt"):  # still in __init__: `_build_cpu_transposed` builds them
            return
        n = 1
        if self._kernels == "triton":
            from draftsmith.decode import kernels as K

            n = max(self._kernel_rows(), K.ROWS_ATTN_MAX)
        shared: dict = {}
        self._plans = {T: self._plan_for(T, shared) for T in range(1, n + 1)}
        self._wide_plan = self._plan_for(n + 1, shared)

    def _plan_for(self, T: int, shared: dict):
        """The Ops of a T-row forward (one object per route, shared by the widths that take it)."""
        from draftsmith.decode import ops as O

        routed = self._route(T)
        if not routed:
            key = ("cpu",) if self._wt is not None else ("torch",)
        elif T > self._kernel_rows():
            key = ("attn", routed)  # `_route` leaves a wider forward the attention and RoPE alone
        else:
            key = ("step" if T == 1 else "rows", routed)
        if key not in shared:
            if key[0] == "cpu":
                shared[key] = O.CpuTransposedOps(self, self._wt, self._lm_head_t)
            elif key[0] == "torch":
                shared[key] = O.TorchOps(self)
            elif key[0] == "attn":
                shared[key] = O.TritonAttnOps(self, routed)
            else:
                cls = O.TritonStepOps if key[0] == "step" else O.TritonRowsOps
                shared[key] = cls(self, routed, self._kernel_rows())
        return shared[key]

    def plan(self, T: int):
        """The `ops.Ops` a forward of T rows runs (resolved when the settings change; a plain dict lookup, which
        torch.compile traces as a constant)."""
        return self._plans.get(T, self._wide_plan)

    def _route(self, T: int) -> frozenset:
        """The ops of a T-token forward that run through draftsmith.decode.kernels (empty: the torch path). A
        one-token step (and, with `triton_max_rows`, up to that many tokens) takes every op of `triton_ops` it can;
        a wider forward of up to `kernels.ROWS_ATTN_MAX` tokens (a verify, a hand-off) takes only the attention
        (`kernels.rows_attention`: one kernel pair over the tree mask where torch needs the mask expanded, two
        batched matmuls, a softmax and two copies) and RoPE with the cache writes (`kernels.rope_and_cache`), and
        keeps torch's matmuls and norms; longer ones (long prefills) none."""
        if self._kernels != "triton" or len(self.layers[0].qkv) != 1 or len(self.layers[0].gate_up) != 1:
            return frozenset()
        from draftsmith.decode import kernels as K

        if not K.available():
            return frozenset()
        d = self.head_dim
        attn_ok = d >= 16 and not d & (d - 1)
        if T > self._kernel_rows():
            if not (attn_ok and T <= K.ROWS_ATTN_MAX and "attn" in self.triton_ops):
                return frozenset()
            return frozenset({"attn", "rope"} & set(self.triton_ops))
        ops = set(self.triton_ops)
        if d & (d - 1):
            ops -= {"rope", "attn"}
        if not attn_ok:
            ops.discard("attn")
        return frozenset(ops)

    def triton_ops_for(self, T: int) -> frozenset:
        """The ops of a T-token forward that its plan routes to draftsmith.decode.kernels (`_route`; empty: torch)."""
        return self.plan(T).routed

    def triton_step(self, T: int) -> bool:
        """Whether a T-token forward is the all-kernel step (its matmuls are gemv/gemm_rows launches), which runs
        without torch.compile (the engine resolves the widths at build: `SpeculativeDecoder._eager_rows`)."""
        return bool(self.triton_ops_for(T)) and T <= self._kernel_rows()

    def _kernel_rows(self) -> int:
        """The most tokens a forward runs all through the kernels (1, or `triton_max_rows` up to the experimental
        `gemm_rows.ROWS_MAX`)."""
        if self.triton_max_rows <= 1:
            return 1
        from draftsmith.decode.experimental.gemm_rows import ROWS_MAX

        return min(self.triton_max_rows, ROWS_MAX)

    def gemv_kinds(self) -> dict:
        """Weight kind -> (every layer's matrix of that kind, what a one-token step folds into its gemv: the
        `kernels.tune_gemv` keyword arguments, with layer 0's norm weight and bias standing for all layers')."""
        from draftsmith.decode.ops import mlp_folds

        L0 = self.layers[0]
        glu, act_mul = mlp_folds(self._silu(), self.triton_ops_for(1) or frozenset(self.triton_ops))
        return {
            "qkv": ([L.qkv[0] for L in self.layers], dict(norm_weight=L0.input_norm, bias=L0.qkv_bias[0])),
            "o": ([L.o for L in self.layers], dict(bias=L0.o_bias, residual=True)),
            "gate_up": (
                [L.gate_up[0] for L in self.layers],
                dict(norm_weight=L0.post_norm, bias=L0.gate_up_bias[0], glu=glu),
            ),
            "down": ([L.down for L in self.layers], dict(bias=L0.down_bias, residual=True, act_mul=act_mul)),
            "lm_head": ([self.lm_head], dict(norm_weight=self.norm)),
        }

    def tune_kernels(self) -> list[dict]:
        """Pick the Triton gemv tile per weight kind by timing them on this GPU (`kernels.tune_gemv`, the tiles of
        `kernel_config.gemv_sweep`), kept in `kernel_config.gemv_tuned` — and with `triton_max_rows` > 1 the row
        kernels' tile too (`experimental.gemm_rows.tune_rows`, `rows_tuned`); call it before capturing graphs. One
        row per (kind, tile); [] on CPU. (The attention plan follows a rule: `kernels.tune_attention` says why.)"""
        from draftsmith.decode import kernels as K

        cfg = self.kernel_config
        out = [
            {"matrix": kind, **r}
            for kind, (mats, kw) in self.gemv_kinds().items()
            for r in K.tune_gemv(mats, **kw, config=cfg)
        ]
        # the row kernels' tile too, at the widest all-kernel width (a tree verify's 49 rows take the tile of 64)
        if self._kernel_rows() > 1:
            from draftsmith.decode.experimental.gemm_rows import tune_rows

            rows = self._kernel_rows()
            for kind, (mats, kw) in self.gemv_kinds().items():
                kw = dict(kw)
                kw.pop("act_mul", None)  # the row plan never folds silu*up into down: into gate/up's epilogue
                if kind == "gate_up":
                    kw["glu"] = self._silu() and "gate_up" in self.triton_ops
                kw["residual"] = bool(kw.get("residual"))
                out += [{"matrix": kind, **r} for r in tune_rows(mats, rows, **kw, config=cfg)]
        return out

    def tune_lt(self, widths) -> list[dict]:
        """Experimental (`KernelConfig.lt_matmuls`, CUDA): for each width whose forward takes the wide plan, time
        cuBLASLt's algorithms for every weight kind (`experimental.cublaslt.tune_lt`: only those equal to F.linear bit
        for bit) and keep the winners in `kernel_config.lt_tuned`; call it before that width's forward is traced or
        captured. One row per (width, kind); [] when off or nothing is left to tune."""
        cfg = self.kernel_config
        if not cfg.lt_matmuls or self.device.type != "cuda":
            return []
        done = cfg.lt_widths | {k[0] for k in cfg.lt_tuned}  # tuned with this config (a given table counts as tuned)
        # the widths whose plan takes the lt matmuls (TritonAttnOps built with lt_matmuls; `_plans` holds one entry
        # per width up to ROWS_ATTN_MAX, so identity with `_wide_plan` would miss them)
        widths = [int(T) for T in widths if hasattr(self.plan(int(T)), "_lt_linear") and int(T) not in done]
        if not widths:
            return []
        from draftsmith.decode.experimental.cublaslt import tune_lt

        L0 = self.layers[0]
        kinds = {
            "qkv": [L.qkv[0] for L in self.layers] if len(L0.qkv) == 1 and L0.qkv_bias[0] is None else None,
            "o": [L.o for L in self.layers] if L0.o_bias is None else None,
            "gate_up": [L.gate_up[0] for L in self.layers]
            if len(L0.gate_up) == 1 and L0.gate_up_bias[0] is None
            else None,
            "down": [L.down for L in self.layers] if L0.down_bias is None else None,
            "lm_head": [self.lm_head],
        }
        rows = tune_lt({k: v for k, v in kinds.items() if v}, widths, search=cfg.lt_search)
        for r in rows:
            if r["algo"] is not None:
                cfg.lt_tuned[(r["rows"], r["n"], r["k"], str(self.dtype))] = r["algo"]
        cfg.lt_widths.update(widths)
        return rows

    def _silu(self) -> bool:
        return str(getattr(self.cfg, "hidden_act", "silu")) == "silu"

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor,
        logits_rows: torch.Tensor | None = None,
        want_aux: bool = True,
        want_final: bool = False,
    ):
        """input_ids/positions/slots [T] long; mask [T, S] bool over cache slots 0..S-1 (S <= max_len).

        Writes the T tokens' K/V at `slots`, then attends with `mask`. Returns (logits [R, V] fp32 for
        `logits_rows` (all T when None), aux [T, k*H] in the model dtype or None). `want_final`: aux is [T, (k+1)*H],
        the last H columns the final pre-norm state (the last layer's output; capture while serving records it).
        With kernels="triton" the mask must show no slot past the highest of `slots` (as in any causal use:
        `kernels.rows_attention` reads none).
        """
        T, S = input_ids.shape[0], mask.shape[1]
        ops = self.plan(T)
        h = F.embedding(input_ids, self.embed)  # [T, H]
        attn_mask, rope, slots = ops.prepare(mask, positions, slots)
        aux = {}
        for i, L in enumerate(ops.layers):
            kc, vc = self.k_layers[i], self.v_layers[i]
            qkv = ops.qkv(h, L)
            q = ops.rope_cache(qkv, rope, slots, kc, vc, L)  # [1, T, nh, d]; the T rows' K/V written
            o = ops.attention(q, kc, vc, attn_mask, slots, S)  # [T, nh * d]
            h = ops.o_proj(o, h, L)
            h = ops.mlp(h, L)
            if (want_aux or want_final) and i in self.aux_layers:
                aux[i] = h
        aux_t = self._aux_out(aux, h, want_aux, want_final)
        hs = h if logits_rows is None else h.index_select(0, logits_rows)
        return ops.lm_head(hs), aux_t

    def _aux_out(self, aux: dict, h: torch.Tensor, want_aux: bool, want_final: bool):
        """The forward's second output: the aux layers' rows [T, k*H], + h (the last layer's output, before the final
        norm) with want_final; None when neither is asked for."""
        if not (want_aux or want_final):
            return None
        return torch.cat([aux[i] for i in self.aux_layers] + ([h] if want_final else []), -1)

    def compact(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move cache entries: slot dst[j] <- slot src[j] (gathered first, so overlaps are safe)."""
        if torch.compiler.is_compiling():
            # A round traced whole (`SpeculativeDecoder.compile_rounds`) reaches the cache through the per-layer views
            # the forward writes; touching the 5-D tensor too makes AOT autograd merge every view into one synthetic
            # base, and each layer's K/V write becomes a scatter of the whole cache (seen in the traced tree round's
            # graph: two as_strided_scatter of all layers per layer). Per layer, the same moves.
            for kc, vc in zip(self.k_layers, self.v_layers):
                k, v = kc.index_select(2, src), vc.index_select(2, src)
                kc.index_copy_(2, dst, k)
                vc.index_copy_(2, dst, v)
            return
        k = self.k_cache.index_select(3, src)
        v = self.v_cache.index_select(3, src)
        self.k_cache.index_copy_(3, dst, k)
        self.v_cache.index_copy_(3, dst, v)


def rope_table(cfg, max_len: int, device, rotary_module=None):
    """cos/sin [max_len, head_dim] in fp32, from HF's own rotary module when one is given."""
    pos = torch.arange(max_len, device=device)[None]
    if rotary_module is None:
        try:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            rotary_module = LlamaRotaryEmbedding(config=cfg, device=device)
        except Exception:  # pragma: no cover - very old/new transformers
            rotary_module = None
    if rotary_module is not None:
        x = torch.zeros(1, device=device, dtype=torch.float32)
        cos, sin = rotary_module(x, pos)
        return cos[0].float(), sin[0].float()
    H, nh = int(cfg.hidden_size), int(cfg.num_attention_heads)  # pragma: no cover
    d = int(getattr(cfg, "head_dim", None) or H // nh)
    theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4)))
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    f = pos[0].float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


__all__ = [
    "LayerWeights",
    "LlamaFamilyForward",
    "supports",
    "rope_table",
    "grouped_attention",
    "prepare_mask",
    "SUPPORTED_MODEL_TYPES",
    "ATTENTION_IMPLS",
    "TRITON_OPS",
]
