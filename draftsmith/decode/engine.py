"""The speculative decoding engine (batch size 1): plain, chain and EAGLE-2 dynamic-tree decoding.

State between rounds (all on the device): `L` = tokens whose K/V are committed in the target cache
(cache slot == position for committed tokens), `root` = the next token (already emitted, not yet in the
target cache), and the drafter's `h_last` = its pre-norm output at position L-1, from which the next
draft token is predicted. The drafter cache holds one entry per committed position i, built from
(token i+1, fused target aux state at i) — exactly what prefill builds.

One round (chain, K draft tokens):
  1. draft: d_1 from h_last; step i feeds (d_i, previous output) at position L+i-1 (drafter slot L+i-1)
  2. verify: ONE target forward over [root, d_1..d_K] at positions L..L+K, causal mask over the cache
  3. accept a tokens (greedy: match the target's argmax; T>0: speculative sampling), bonus token b
  4. hand-off: ONE drafter forward over [d_1..d_a, b] with the fused target aux states of
     [root, d_1..d_a] (taken from the verify forward) at positions L..L+a — the same inputs prefill uses;
     its output at row a is the next h_last. L += a+1; root = b.
The tree round replaces 1-3 with EAGLE-2 expansion (top_k frontier by cumulative log-prob for `depth`
levels, best `tree_tokens` nodes kept), a tree attention mask with per-node positions, a longest-path
walk, and KV compaction of the accepted path in the target cache (the drafter cache is rewritten by the
hand-off). At T>0 the tree uses recursive rejection sampling over siblings with the drafter's
deterministic (top-k) proposals; for a point-mass proposal each sibling test accepts with p(x)/Σp over
the residual, which is exactly "draw y ~ p at the node; go to the child whose token is y, if any".

Every step has static shapes and no host sync; a whole round is one CUDA graph on GPU (captured per
setting), followed by one host read of (accepted count, emitted tokens).
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from draftsmith.common.hf import text_config
from draftsmith.decode.sampling import SamplingParams, chain_accept, choose, sample, warp


class _HostStage:
    """Two host slots a unit of decoding's results (tokens; with margins, floats) are copied into without a sync:
    pinned memory and an event per slot on CUDA, so the copy is queued behind the unit and the host waits only when
    it reads the slot (`SpeculativeDecoder._decode_ahead`)."""

    def __init__(self, device: torch.device, n: int):
        pin = device.type == "cuda"
        self.device = device
        self.ints = [torch.empty(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.floats = [torch.empty(2 * n, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() if pin else None for _ in range(2)]

    def put(self, slot: int, ints: list[torch.Tensor], floats: list[torch.Tensor]) -> None:
        for dst, srcs in ((self.ints[slot], ints), (self.floats[slot], floats)):
            o = 0
            for t in srcs:
                dst[o : o + t.numel()].copy_(t.reshape(-1), non_blocking=True)
                o += t.numel()
        if self.events[slot] is not None:  # on the engine's device's stream, wherever the current device is
            self.events[slot].record(torch.cuda.current_stream(self.device))

    def get(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.ints[slot], self.floats[slot]


@dataclass(frozen=True)
class DecodeMode:
    kind: str = "chain"  # "plain" | "chain" | "tree"
    draft_tokens: int = 4  # chain K
    top_k: int = 8  # tree expansion width
    depth: int = 5  # tree depth (max draft tokens on one path)
    tree_tokens: int = 32  # draft nodes verified per round (root excluded)

    def key(self):
        return (self.kind, self.draft_tokens, self.top_k, self.depth, self.tree_tokens)

    @property
    def max_accept(self) -> int:
        return {"plain": 0, "chain": self.draft_tokens, "tree": self.depth}[self.kind]

    @property
    def verify_tokens(self) -> int:
        return {"plain": 1, "chain": self.draft_tokens + 1, "tree": self.tree_tokens + 1}[self.kind]

    def validate(self) -> None:
        if self.kind not in ("plain", "chain", "tree"):
            raise ValueError(f"unknown decode mode {self.kind!r}")
        if self.kind == "chain" and not 1 <= self.draft_tokens <= 250:
            raise ValueError("--draft-tokens must be in 1..250")
        if self.kind == "tree":
            if self.top_k < 1 or self.depth < 1 or self.tree_tokens < 1:
                raise ValueError("tree needs top_k, depth, tree_tokens >= 1")
            if self.depth > 250:
                raise ValueError("--depth must be <= 250")
            if self.tree_tokens > self.num_candidates:
                raise ValueError(
                    f"--tree-tokens {self.tree_tokens} > candidates top_k + (depth-1)*top_k^2 = {self.num_candidates}"
                )

    @property
    def cache_need(self) -> int:
        """Cache slots one round may write past the committed length (target and drafter)."""
        if self.kind == "plain":
            return 1
        if self.kind == "chain":
            return self.draft_tokens + 1
        return max(self.tree_tokens + 1, (self.depth - 1) * self.top_k, self.depth + 1)

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "eos" | "stop" | "length" | "cache"
    prompt_tokens: int
    rounds: int  # target forwards after prefill
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per round (pre-truncation)
    proposed_per_round: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    trace: list[dict] | None = None
    # with engine.record_margins: per new token, (top-1 minus top-2 logit, top-1 logit) of the row that chose it
    margins: list[tuple[float, float]] | None = None

    @property
    def tau(self) -> float:
        """Tokens per target forward (incl. the bonus token), over the decode rounds."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1) if self.accepted else 1.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / max(self.prefill_s + self.decode_s, 1e-9)

    def to_json(self) -> dict:
        n = len(self.token_ids)
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "tau": self.tau,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": n,
            "rounds": self.rounds,
            "accepted_per_round": self.accepted,
            "proposed_per_round": self.proposed_per_round,
            "acceptance_rate": (
                sum(self.accepted) / (self.proposed_per_round * len(self.accepted))
                if self.accepted and self.proposed_per_round
                else None
            ),
            "timing": {
                "prefill_s": self.prefill_s,
                "decode_s": self.decode_s,
                "total_s": self.prefill_s + self.decode_s,
                "tokens_per_s": n / max(self.prefill_s + self.decode_s, 1e-9),
                "decode_tokens_per_s": max(n - 1, 0) / max(self.decode_s, 1e-9),
            },
        }


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def causal_mask(S: int, limit: torch.Tensor, device) -> torch.Tensor:
    """mask [T, S] over S cache slots: slot s visible to row t iff s <= limit[t] (a causal forward: limit = the
    rows' own slots)."""
    return torch.arange(S, device=device)[None, :] <= limit[:, None]


def _top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of logits [R, V]: (top-1 minus top-2 logit, top-1 logit), fp32."""
    v = torch.topk(logits.float(), 2, dim=-1).values
    return v[..., 0] - v[..., 1], v[..., 0]


def _region_mask(S: int, L: torch.Tensor, region: torch.Tensor, device) -> torch.Tensor:
    """Committed slots (< L) plus a [T, R] bool region placed at slots L..L+R-1 -> [T, S]."""
    ar = torch.arange(S, device=device)
    R = region.shape[1]
    rel = ar - L
    inside = (rel >= 0) & (rel < R)
    tree = region.gather(1, rel.clamp(0, R - 1)[None].expand(region.shape[0], S)) & inside[None]
    return tree | (ar < L)[None]


class SpeculativeDecoder:
    """Speculative generator for one target (+ optional EAGLE-3 drafter) at batch size 1.

    target: a `draftsmith.target_model.Target` or an HF CausalLM. drafter: a `draftsmith.drafter.Drafter` (or
    any module with its interface) or None (plain decoding only). `max_len`: cache capacity in tokens
    (prompt + new tokens + one round's draft). `backend`: "auto" (compact Llama-family forward when
    supported, else HF generic), "llama", "hf". `cuda_graphs`: None = on when the device is CUDA and the
    compact forward is used. `compile`: torch.compile the round forwards (True), or "max-autotune" (inductor
    also tries its Triton GEMM templates). `attn_impl`: attention of the compact forward and the drafter, "auto" (below),
    "sdpa", "bmm" or "split" (`draftsmith.decode.llama.grouped_attention`). `kernels`: "torch", or "triton" (the
    compact forward's one-token steps through `draftsmith.decode.kernels`, tiles tuned on the GPU at construction;
    experimental). `kernel_config`: those kernels' launch settings (a `draftsmith.decode.kernel_config.KernelConfig`,
    given to the runner, whose tuned tables construction fills where empty); default: the runner's own.
    `kernel_rows` (kernels="triton"): target forwards of up to this many tokens (a chain verify) run all through the
    kernels, their matmuls as `experimental.gemm_rows` (weights read once for all rows, norms and residuals folded
    in: on a small, launch-bound target fewer and cheaper launches than cuBLAS + fused elementwise); 1 = the one-token
    step only.
    """

    # prompt lengths a graphed prefill pads to (`prefill_graphs`): fine steps above 64 so a prompt pays at most
    # 63 padding rows; longer prompts prefill eagerly (their forward is not launch-bound)
    PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512)

    # "auto" attention. On CUDA the masked SDPA kernel gives each KV head (per query block) one CTA that walks
    # all S cache slots, so its time grows with S x head_dim at one SM's pace (8B shape, bs=1, d=128: 0.29
    # ms/step over 208 slots, 1.54 ms over 2,128); two cuBLAS batched matmuls tile over the keys but cost ~4
    # more kernels per layer (+0.13 ms/step at 208 slots, flat after): bench/decode_kernels.py, 2026-11-29.
    # Measured: 8B d=128 at 880 and 2,128 slots bmm is faster (plain step 5.86 vs 5.99 ms; 5.86 vs 6.90 ms);
    # at 208 SDPA; pycode-small (d=64, launch-bound) at ~600 slots SDPA (chain rounds 2,668 vs 2,241 tok/s).
    # The threshold sits between: bmm once S x head_dim > 65,536 (8B: 512 slots; d=64: 1,024).
    SDPA_MAX_KEY_ELEMS = 65536

    def __init__(
        self,
        target,
        drafter=None,
        max_len: int = 2048,
        backend: str = "auto",
        cuda_graphs: bool | None = None,
        aux_layers: Sequence[int] | None = None,
        compile: bool | str = False,
        attn_impl: str = "auto",
        kernels: str = "torch",
        kernel_config=None,
        kernel_rows: int = 1,
    ):
        from draftsmith.decode.llama import ATTENTION_IMPLS, LlamaFamilyForward, supports

        if compile not in (False, True, "max-autotune"):
            raise ValueError(f"compile {compile!r} is not one of False, True, 'max-autotune'")
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels {kernels!r} is not one of 'torch', 'triton'")
        if int(kernel_rows) != 1 and kernels != "triton":
            raise ValueError(f"kernel_rows {kernel_rows} needs kernels='triton' (the T-row kernels are Triton's)")
        if not 1 <= int(kernel_rows) <= 64:
            raise ValueError(f"kernel_rows {kernel_rows} is not in [1, 64]")
        if attn_impl not in ("auto", *ATTENTION_IMPLS):
            raise ValueError(f"attn_impl {attn_impl!r} is not one of {('auto', *ATTENTION_IMPLS)}")
        self._attn_choice = attn_impl

        prebuilt = target if isinstance(target, LlamaFamilyForward) else None
        if prebuilt is not None:  # a ready runner (benchmarks: random weights of a large shape, no HF model)
            model, cfg = None, prebuilt.cfg
        else:
            model = target if isinstance(target, torch.nn.Module) else target.model
            cfg = text_config(model.config)
        self.model = model
        self.tokenizer = getattr(target, "tokenizer", None) if prebuilt is None else None
        self.drafter = drafter
        self.config = cfg
        if aux_layers is None:
            if drafter is not None and getattr(drafter.config, "aux_layer_ids", None) is not None:
                aux_layers = list(drafter.config.aux_layer_ids)
            else:
                from draftsmith.target_model.layers import default_aux_layers

                aux_layers = default_aux_layers(int(cfg.num_hidden_layers))
        self.aux_layers = [int(i) for i in aux_layers]
        self.max_len = _round_up(int(max_len), 16)  # aligned masks keep SDPA on its fused kernels
        ok, why = supports(cfg, self.max_len)
        if backend == "llama" and not ok:
            raise ValueError(f"compact forward unavailable: {why}")
        if prebuilt is not None:
            if prebuilt.max_len != self.max_len:
                prebuilt.set_max_len(self.max_len)
            self.runner = prebuilt
            self.backend = "llama"
        elif backend in ("auto", "llama") and ok:
            self.runner = LlamaFamilyForward.from_hf(model, self.aux_layers, self.max_len)
            self.backend = "llama"
        else:
            from draftsmith.decode.hf_generic import HFGenericForward

            layers = getattr(target, "layers", None)
            if layers is None:
                from draftsmith.target_model.load import _find_decoder_layers

                layers = _find_decoder_layers(model, int(cfg.num_hidden_layers))
            self.runner = HFGenericForward(model, layers, self.aux_layers, self.max_len)
            self.backend = "hf"
            if backend == "auto":
                warnings.warn(
                    f"using the generic HF path ({why}); it is slower and runs without CUDA graphs", stacklevel=2
                )
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        self.kernel_tuning: list[dict] = []  # the Triton gemv sweep of kernels="triton" on CUDA (tune_kernels)
        self.lt_tuning: list[dict] = []  # experimental KernelConfig.lt_matmuls: the cuBLASLt choices (tune_lt)
        if self.backend == "llama":
            self.runner.kernels = "torch"
            if kernel_config is not None:
                self.runner.kernel_config = kernel_config
        if kernels == "triton":
            from draftsmith.decode import kernels as K

            if self.backend != "llama":
                raise ValueError(
                    "kernels='triton' needs the compact Llama-family forward (this target runs the generic HF path)"
                )
            if not K.available():
                raise ValueError("kernels='triton' needs triton (pip install triton; CUDA builds of torch bring it)")
            if self.device.type != "cuda" and not K.interpreted():
                raise ValueError(
                    f"kernels='triton' needs a CUDA device (this target is on {self.device}; "
                    "TRITON_INTERPRET=1 runs them in triton's interpreter, slowly: for tests)"
                )
            self.runner.kernels = "triton"
            self.runner.triton_max_rows = int(kernel_rows)
            self.kernel_tuning = self.runner.tune_kernels()  # before any compile or graph capture
        self.vocab_size = int(cfg.vocab_size)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None) if model is not None else None
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.backend == "llama"
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda" and self.backend == "llama"
        self._graphs: dict = {}
        self._pf_graphs: dict = {}  # graphed prefills (`prefill_graphs`): (bucket, draft, sampling, margins) -> replay
        self._pf_pool = None  # their shared CUDA graph memory pool (`_prefill_runner`)
        # the sampling settings that have graphs, least recently used first, at most `max_graph_samplings`
        self._graph_samplings: dict = {}
        self.max_graph_samplings = 8
        self.share_prefill_pool = True  # (off: a pool per graph, for benchmarks to compare)
        # device state
        dev = self.device
        self.L = torch.zeros((), dtype=torch.long, device=dev)
        self.root = torch.zeros((), dtype=torch.long, device=dev)
        # a step's or round's result, one buffer: [tokens emitted, token 0, token 1, ...], so that the host reads it
        # with one copy a round (`generate`'s lookahead), not one per tensor
        self.emit = torch.zeros(257, dtype=torch.long, device=dev)
        # record_margins (greedy certificate, `draftsmith.decode.certificate`): per emitted token, the top-1 minus
        # top-2 logit of the row that chose it (a plain step's, or the verify row's) and the top-1 logit itself
        self.record_margins = False
        # the CPU's greedy chain round (`_chain_round_cpu`: host-side bookkeeping, syncs and all); off, the CPU runs
        # the device-agnostic round every GPU runs (tests check that one is sync-free)
        self.host_rounds = dev.type == "cpu"
        # torch threads for `generate` on the CPU (None: the process's). A small model's decode step is ~250 ops of a
        # few microseconds: on an idle pair of cores two threads measured even with one (BENCHMARKS.md "Demo target
        # on CPU", 19:42: eval speedup 1.20-1.24x either way), and on cores shared with other work they stall each
        # other (up to 3x slower steps, 16:44), so one; plain and speculative decoding run under the same setting.
        self.cpu_threads = (
            1
            if dev.type == "cpu"
            and hasattr(self.runner, "weight_bytes")
            and self.runner.weight_bytes() <= getattr(self.runner, "CPU_TRANSPOSED_MAX_BYTES", 0)
            else None
        )
        self.out_gap = torch.zeros(256, dtype=torch.float32, device=dev)
        self.out_top = torch.zeros(256, dtype=torch.float32, device=dev)
        # `generate(lookahead=)`'s default: the next round launched before the host reads the last one (a GPU's
        # gain; on the CPU every op is synchronous and a stopping generation would only pay one round more)
        self.lookahead = dev.type == "cuda"
        # with the lookahead, no round launched ahead while the rounds in flight are expected (at this generation's
        # mean tokens a round) to reach max_new_tokens: else a length-bound generation's last round is nearly always
        # run and dropped (one round in ~max_new/tau: 2.4 % of a 200-token generation at tau 4.8); when they fall
        # short the GPU idles one host turnaround instead. Off: always one round ahead (benchmarks compare both).
        self.lookahead_tail = True
        # greedy chain drafts with the kernel drafter: the lm_head gemv takes the argmax and the draft-to-target id
        # map itself (`KernelDraftStep.greedy_token`); off: logits, then torch's argmax (benchmarks compare both)
        self.fused_draft_argmax = True
        self._stage: _HostStage | None = None
        # `prefill_graphs` (on with CUDA graphs): prompts of up to the largest PREFILL_BUCKETS entry prefill padded
        # to a bucket, from one CUDA graph per bucket. Why: a small target's eager prefill is ~1,700 torch calls
        # (pycode-small, 77 tokens), ~8-9 ms of host time on the H200 against ~28 ms for 200 decoded tokens; from its
        # graph ~1 ms (BENCHMARKS.md, 2026-12-02 twelfth session). On the CPU (no graphs) the padded body would
        # only add rows: tests turn it on there to check that body against the unpadded prefill.
        self.prefill_graphs = self.cuda_graphs
        self._pf_ids = torch.zeros(self.PREFILL_BUCKETS[-1], dtype=torch.long, device=dev)
        self._pf_n = torch.ones((), dtype=torch.long, device=dev)
        self._pf_margin = torch.zeros(2, dtype=torch.float32, device=dev)
        self.prefill_margin: tuple[float, float] | None = None
        if drafter is not None:
            dc = drafter.config
            self.d_layers = int(getattr(dc, "num_hidden_layers", 1))
            nh = int(dc.num_attention_heads)
            self.d_nkv = int(getattr(dc, "num_key_value_heads", None) or nh)
            self.d_hd = int(getattr(dc, "head_dim", None) or int(dc.hidden_size) // nh)
            self.d_scale = self.d_hd**-0.5
            self._d_groups = nh // self.d_nkv
            p = next(drafter.parameters())
            self.d_dtype = p.dtype
            shape = (self.d_layers, 1, self.d_nkv, self.max_len, self.d_hd)
            self._alloc_drafter_cache(shape)
            self.h_last = torch.zeros(int(dc.hidden_size), dtype=self.d_dtype, device=dev)
            if hasattr(drafter, "draft_target_ids"):
                self.d_ids = drafter.draft_target_ids.to(dev)
            else:
                n = int(getattr(dc, "draft_vocab_size", None) or dc.vocab_size)
                self.d_ids = drafter.draft_to_target(torch.arange(n, device=dev))
            nfc = drafter.fc.in_features if hasattr(drafter, "fc") else None
            if nfc is not None and nfc != len(self.aux_layers) * int(cfg.hidden_size):
                raise ValueError(
                    f"drafter fc expects {nfc} inputs; {len(self.aux_layers)} aux layers x "
                    f"{cfg.hidden_size} = {len(self.aux_layers) * int(cfg.hidden_size)}"
                )
        self._d_slots = None
        self._d_mask = None
        # kernels="triton": the drafter's attention over up to this many tokens through kernels.rows_attention, and
        # a tree level's top-k up to this k through kernels.topk_logprobs (0: off)
        self._d_rows_attn = self._topk_max = 0
        if drafter is not None and getattr(self.runner, "kernels", "torch") == "triton":  # (the HF path has none)
            from draftsmith.decode import kernels as K

            self._topk_max = K.TOPK_MAX
            if self.d_hd >= 16 and not self.d_hd & (self.d_hd - 1):
                self._d_rows_attn = K.ROWS_ATTN_MAX
        self._tree_cache: dict = {}  # mode key -> constants of its tree rounds (`_tree_consts`)
        self.states = None  # `set_state_recording`: [max_len, (k+1)*H] aux + final pre-norm rows by cache slot
        self._ar = torch.arange(self.max_len, device=dev)  # slot indices for the masks (built once)
        self._causal = self._causal_add = None  # `_causal_rows`'s and `_causal_add_rows`'s tables
        self._resolve_attn_impl()
        self._d_rope = None  # (cos, sin) [max_len, head_dim] of a draftsmith Drafter: indexed, not recomputed
        self._set_drafter_rope()
        # opt-in: torch.compile the static-shape forwards used inside rounds (fuses the small elementwise
        # kernels; one compile per shape, done during graph warm-up). Prefill (variable length) stays eager.
        self._compiled = bool(compile)
        # "max-autotune": inductor also benchmarks its own Triton GEMM templates against cuBLAS for every matmul
        # shape and can fuse the neighbouring pointwise work into them (minutes of compile; our CUDA graphs
        # stay ours, hence the no-cudagraphs variant)
        self.compile_mode = "max-autotune-no-cudagraphs" if compile == "max-autotune" else None
        self._t_fwd = self.runner.forward
        # With kernels="triton" and compile: target forwards of up to this many tokens (the one-token step, or up to
        # `triton_max_rows`) are the all-kernel step, run from the plain runner — dynamo fails to capture the Triton
        # launches and there is nothing left for it to fuse — and every wider one (verify, prefill) runs compiled.
        # Resolved here, once: `runner.triton_step(T)` is the same for every T up to the runner's kernel rows.
        self._eager_rows = 0
        self._d_module = self._d_call = self._d_cpu = self._d_kern = None
        # kernels="triton": the drafter's forwards, fc and head through the same kernels (`KernelDraftStep`) where
        # its layers allow; False keeps the module (cuBLAS + elementwise kernels; benchmarks compare the two)
        self.kernel_drafter = True
        self._d_topk = self._draft_topk
        if compile and self.backend == "llama":
            from draftsmith.common.compiling import raise_recompile_limit

            # one graph per forward width (plain 1, chain K+1, tree k / N+1, hand-offs): several settings on one
            # engine pass dynamo's default limit of 8, after which it would silently run the rest eagerly
            raise_recompile_limit()
            self._t_fwd = torch.compile(self.runner.forward, dynamic=False, mode=self.compile_mode)
            if self.runner.kernels == "triton" and self.runner.triton_step(1):
                self._eager_rows = self.runner._kernel_rows()
            if drafter is not None and hasattr(drafter, "inv_freq"):  # per-device cache filled before tracing
                drafter.inv_freq(self.device)  # (else: a recompile)
        # compile: a greedy round is traced whole (draft steps, verify, acceptance, hand-off, state updates) so
        # inductor fuses its bookkeeping into its neighbours' kernels — on a launch-bound target a round's time is
        # its kernel count (BENCHMARKS.md "Decode: small-target round census"). The Triton kernels join the graph as
        # torch custom ops (`draftsmith.decode.kernels`), an all-kernel verify (`kernel_rows`) included.
        # (CUDA only: torch 2.13's CPU inductor emits C++ that does not compile for the traced round — a VecMask
        # type clash; tests trace it on the CPU with backend="aot_eager", `compile_rounds`.)
        self._c_round = None
        if compile and self.backend == "llama" and drafter is not None and self.device.type == "cuda":
            self.compile_rounds()
        self._build_drafter_view()

    def _build_drafter_view(self) -> None:
        """q/k/v and gate/up fused, q and k rotated together (`fused_drafter`): the same weights, 8 fewer kernels
        per drafter layer call. Rebuilt (and graphs dropped) when the drafter's weights change under the engine."""
        from draftsmith.decode.fused_drafter import KernelDraftStep, fused_for_decoding

        if self.drafter is None:
            return
        self._d_module = fused_for_decoding(self.drafter)
        self._d_call = self._d_module
        self._d_topk = self._draft_topk
        self._build_cpu_draft_step()
        self._d_kern = None
        if (
            getattr(self.runner, "kernels", "torch") == "triton"
            and self.kernel_drafter
            and self._d_rope is not None
            and KernelDraftStep.supports(self._d_module)
        ):
            # its multi-row matmuls through the row kernels up to kernel_rows, like the target's verify
            rows = self.runner._kernel_rows() if hasattr(self.runner, "_kernel_rows") else 1
            self._d_kern = KernelDraftStep(self._d_module, self.runner.kernel_config, rows=rows)
        if self._compiled and self.backend == "llama":
            self._d_call = torch.compile(self._d_module, dynamic=False, mode=self.compile_mode)
            # a tree level's norm, lm_head, fp32 cast and log-softmax fused around the matmul (eager: ~5 kernels;
            # with kernels="triton" the log-softmax and top-k are topk_logprobs's two)
            self._d_topk = torch.compile(self._draft_topk, dynamic=False, mode=self.compile_mode)
        self._graphs.clear()
        self._pf_graphs.clear()

    def _build_cpu_draft_step(self) -> None:
        """The CPU's draft step (`fused_drafter.CpuDraftStep`: no module calls, fewer ops) where it applies."""
        self._d_cpu = None
        if (
            self._d_module is not None
            and self.device.type == "cpu"
            and not self._compiled
            and not self._d_rows_attn  # kernels="triton" (interpreted on the CPU: tests) keeps the module path
            and self._d_rope is not None
            and getattr(self._d_module, "embed_tokens", None) is not None
        ):
            from draftsmith.decode.fused_drafter import CpuDraftStep

            self._d_cpu = CpuDraftStep(self._d_module)

    def _refresh_drafter_view(self) -> None:
        from draftsmith.decode.fused_drafter import is_stale

        if self._d_module is not None and is_stale(self._d_module):
            self._build_drafter_view()

    def _set_drafter_rope(self) -> None:
        from draftsmith.drafter import Drafter

        if isinstance(self.drafter, Drafter):
            self._d_rope = self.drafter.rope_table(self.max_len, self.device, self.d_dtype)

    def _alloc_drafter_cache(self, shape) -> None:
        self.dk = self.dv = self._dk_layers = self._dv_layers = None
        self.dk = torch.zeros(shape, dtype=self.d_dtype, device=self.device)
        self.dv = torch.zeros(shape, dtype=self.d_dtype, device=self.device)
        # per-layer views made outside any compiled graph (see LlamaFamilyForward._alloc_cache)
        self._dk_layers = [self.dk[i] for i in range(shape[0])]
        self._dv_layers = [self.dv[i] for i in range(shape[0])]

    def _resolve_attn_impl(self) -> None:
        impl = self._attn_choice
        if impl == "auto":
            hd = int(getattr(self.runner, "head_dim", 0) or 0)
            long = self.max_len * max(hd, getattr(self, "d_hd", 0) or 0) > self.SDPA_MAX_KEY_ELEMS
            impl = "bmm" if self.device.type == "cuda" and long else "sdpa"
        self.attn_impl = impl
        if hasattr(self.runner, "attn_impl"):
            self.runner.attn_impl = impl

    def _mask(self, limit: torch.Tensor) -> torch.Tensor:
        """`causal_mask` over the cached slot indices (`mask`, the public name)."""
        return self._ar[None, :] <= limit[:, None]

    def set_max_len(self, max_len: int) -> None:
        """Resize the caches (target and drafter); drops captured graphs."""
        self.max_len = _round_up(int(max_len), 16)
        self._ar = torch.arange(self.max_len, device=self.device)
        self._resolve_attn_impl()
        if hasattr(self.runner, "set_max_len"):
            self.runner.set_max_len(self.max_len)
        else:
            self.runner.max_len = self.max_len
        if self.drafter is not None:
            shape = (self.d_layers, 1, self.d_nkv, self.max_len, self.d_hd)
            self._alloc_drafter_cache(shape)
            self._set_drafter_rope()
        if self.states is not None:
            self.set_state_recording(True)
        self._graphs.clear()
        self._pf_graphs.clear()

    def set_state_recording(self, on: bool) -> None:
        """Capture while serving (`draftsmith.serve.recorder`): with `on`, every target forward also writes its rows'
        aux states and final pre-norm state into `states` [max_len, (k+1)*H] (target dtype; the 8B shape with 3 aux
        layers: 32 KB a slot) at their cache slots, tree rounds compacting them with the K/V; after `generate`,
        `states[:L]` holds the committed tokens' rows (prompt + response but the last token, never forwarded).
        Plain steps then return their aux rows too. Drops captured graphs. ValueError on the generic HF path."""
        if on and self.backend != "llama":
            raise ValueError("state recording needs the compact Llama-family forward (this target runs the HF path)")
        self.states = None
        if on:
            cols = (len(self.aux_layers) + 1) * int(self.config.hidden_size)
            self.states = torch.zeros(self.max_len, cols, dtype=self.dtype, device=self.device)
        self._graphs.clear()
        self._pf_graphs.clear()

    # ------------------------------------------------------------------ primitives
    def _target(self, ids, positions, slots, mask, logits_rows=None, want_aux=True, eager=False):
        fwd = self.runner.forward if eager or ids.shape[0] <= self._eager_rows else self._t_fwd
        if self.states is None:
            return fwd(ids, positions, slots, mask, logits_rows=logits_rows, want_aux=want_aux)
        # recording: every forwarded row's aux + final state lands at its slot, like its K/V (a rejected row's
        # slot is rewritten by the next round; index_copy_ is graph-safe and needs no sync)
        logits, rows = fwd(ids, positions, slots, mask, logits_rows=logits_rows, want_aux=True, want_final=True)
        self.states.index_copy_(0, slots, rows)
        return logits, (rows[:, : len(self.aux_layers) * int(self.config.hidden_size)] if want_aux else None)

    def _attn(self, q, k, v, layer_idx):
        from draftsmith.decode.llama import grouped_attention

        kc, vc = self._dk_layers[layer_idx], self._dv_layers[layer_idx]
        kc.index_copy_(2, self._d_slots, k if k.dtype == kc.dtype else k.to(kc.dtype))
        vc.index_copy_(2, self._d_slots, v if v.dtype == vc.dtype else v.to(vc.dtype))
        S = self._d_mask.shape[-1]  # a [T, S] bool mask, or prepare_mask's [1, 1, g*T, S] (the CPU draft step)
        T = q.shape[2]
        if self._d_rows_attn and T <= self._d_rows_attn:  # kernels="triton": the target verify's attention kernel
            from draftsmith.decode import kernels as K

            o = K.rows_attention(
                q[0].transpose(0, 1),
                kc,
                vc,
                self._d_mask,
                self.d_scale,
                self._d_slots,
                config=self.runner.kernel_config,
            )
            return o.view(T, q.shape[1], q.shape[3]).transpose(0, 1)[None]
        return grouped_attention(q, kc[:, :, :S], vc[:, :, :S], self._d_mask, self.d_scale, self.attn_impl)

    def _draft_fwd(self, ids, hidden, positions, slots, mask, eager=False):
        """Drafter forward over T tokens (cache write at slots, attention under mask) -> out [T, H]."""
        if self._d_cpu is not None:  # one additive mask for every layer; the rotary rows by index
            from draftsmith.decode.llama import prepare_mask

            g = self._d_groups
            if mask.dtype == torch.bool:
                amask = prepare_mask(mask, g, self.d_dtype)
            else:  # additive rows (`_chain_round_cpu`'s table): one per query head of a KV group
                amask = (mask if g == 1 else mask.expand(g, -1) if mask.shape[0] == 1 else mask.repeat(g, 1))[
                    None, None
                ]
            self._d_slots, self._d_mask = slots, amask
            cos, sin = self._d_rope[0].index_select(0, positions), self._d_rope[1].index_select(0, positions)
            hidden = hidden if hidden.dtype == self.d_dtype else hidden.to(self.d_dtype)
            return self._d_cpu(ids, hidden, cos, sin, self._attn)
        if self._d_kern is not None and ids.shape[0] <= self._d_kern.ROWS:
            cos, sin = self._d_rope
            hidden = hidden if hidden.dtype == self.d_dtype else hidden.to(self.d_dtype)
            return self._d_kern(ids, hidden, positions, slots, mask, self._dk_layers, self._dv_layers, cos, sin)
        self._d_slots, self._d_mask = slots, mask
        call = self._d_module if eager else self._d_call
        kw = {}
        if self._d_rope is not None:
            kw["rope"] = (self._d_rope[0][positions][None], self._d_rope[1][positions][None])
        out = call(ids[None], hidden[None].to(self.d_dtype), positions[None], attn_fn=self._attn, **kw)
        return out[0]

    def _fuse(self, aux):
        if self._d_cpu is not None:
            return self._d_cpu.fuse(aux.to(self.d_dtype))
        if self._d_kern is not None:
            return self._d_kern.fuse(aux.to(self.d_dtype))
        return self.drafter.fuse(aux.to(self.d_dtype))

    def _draft_logits(self, h):
        if self._d_cpu is not None:
            return self._d_cpu.logits(h)
        if self._d_kern is not None:
            return self._d_kern.logits(h)
        return self.drafter.compute_logits(h).float()

    def _draft_topk(self, h, k: int):
        """The k most likely draft tokens after h (drafter ids) and their log-probs: (values, indices) [..., k]
        (kernels="triton": the log-softmax and top-k as `kernels.topk_logprobs`'s two kernels)."""
        if k <= self._topk_max:
            from draftsmith.decode import kernels as K

            logits = self._d_kern.logits(h) if self._d_kern is not None else self.drafter.compute_logits(h)
            return K.topk_logprobs(logits, k, config=self.runner.kernel_config)
        return torch.topk(torch.log_softmax(self._draft_logits(h), -1), k, dim=-1)

    # ------------------------------------------------------------------ prefill
    @torch.no_grad()
    def prefill(self, prompt_ids: Sequence[int], sp: SamplingParams, draft: bool = True) -> int:
        """Target forward over the prompt (+ the drafter's prefill from its aux states unless draft=False,
        as for plain decoding). Returns the first new token."""
        n = len(prompt_ids)
        dev = self.device
        draft = draft and self.drafter is not None
        B = self._prefill_bucket(n)
        if B is not None:
            # the prompt first: a graph's first use runs the body to warm up and capture, and a longer prompt's
            # length left in `_pf_n` would index past this bucket (a device-side assert on the H200, docs/LOG.md)
            self._pf_ids[:n].copy_(torch.tensor(list(prompt_ids), dtype=torch.long))
            self._pf_n.fill_(n)
            self._prefill_runner(B, draft, sp)()
            if self.record_margins:
                gap, top = self._pf_margin.tolist()
                self.prefill_margin = (gap, top)
            return int(self.root)
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=dev)
        pos = torch.arange(n, device=dev)
        mask = self._mask(pos)
        logits, aux = self._target(ids, pos, pos, mask, logits_rows=pos[-1:], want_aux=draft, eager=True)
        root = choose(logits[0], sp)
        if self.record_margins:
            gap, top = _top2(logits[:1])
            self.prefill_margin = (float(gap[0]), float(top[0]))
        self.root.copy_(root)
        self.L.fill_(n)
        if draft:
            d_ids = torch.cat([ids[1:], root.view(1)])
            h = self._draft_fwd(d_ids, self._fuse(aux), pos, pos, mask, eager=True)
            self.h_last.copy_(h[-1])
        return int(root)

    def _prefill_bucket(self, n: int) -> int | None:
        if not self.prefill_graphs:
            return None
        return next((b for b in self.PREFILL_BUCKETS if n <= b <= self.max_len), None)

    def _prefill_runner(self, B: int, draft: bool, sp: SamplingParams):
        """The padded prefill of bucket B: a CUDA graph when graphs are on (captured on first use), else the eager
        body (the CPU runs it for the tests)."""
        sp = sp.canonical()
        fn = functools.partial(self._prefill_padded, B, draft, sp)
        if not self.cuda_graphs:
            return fn
        key = (B, draft, sp, self.record_margins)
        self._graphs_for(sp)
        if key not in self._pf_graphs:
            # one memory pool for every prefill graph: they never run concurrently and nothing a capture allocates
            # outlives it (the results go to the engine's own buffers), so a bucket's activations can take the
            # others' memory; a pool per graph would keep the largest bucket's activations once per bucket (with
            # bmm attention on an 8B target, [heads, 512, cache] fp32 scores: ~270 MB at a 4k cache). A new pool
            # with a new set of graphs: the old one goes with the graphs that used it.
            if not self._pf_graphs and self.share_prefill_pool:
                self._pf_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
            try:
                self._pf_graphs[key] = self._capture(fn, pool=self._pf_pool)
            except Exception as e:  # pragma: no cover - GPU only
                warnings.warn(
                    f"prefill graph capture failed ({type(e).__name__}: {e}); prefilling eagerly", stacklevel=2
                )
                self._pf_graphs[key] = fn
        return self._pf_graphs[key]

    def _prefill_padded(self, B: int, draft: bool, sp: SamplingParams) -> None:
        """`prefill` over `_pf_ids[:B]`, the prompt's `_pf_n` tokens first: static shapes, no host sync (graph-safe).
        Rows past the prompt are causal padding: no real row sees them (row t sees slots <= t), their K/V and
        drafter entries land at slots >= L, which every later forward rewrites before it reads them."""
        ids = self._pf_ids[:B]
        pos = self._ar[:B]
        mask = self._mask(pos)
        last = (self._pf_n - 1).view(1)
        logits, aux = self._target(ids, pos, pos, mask, logits_rows=last, want_aux=draft, eager=True)
        root = choose(logits[0], sp)
        if self.record_margins:
            gap, top = _top2(logits[:1])
            self._pf_margin.copy_(torch.cat([gap, top]))
        self.root.copy_(root)
        self.L.copy_(self._pf_n)
        if draft:
            d_ids = torch.cat([ids[1:], ids[:1]]).index_copy(0, last, root.view(1))
            h = self._draft_fwd(d_ids, self._fuse(aux), pos, pos, mask, eager=True)
            self.h_last.copy_(h.index_select(0, last)[0])

    # ------------------------------------------------------------------ rounds (static shapes, no syncs)
    def _plain_step(self, sp: SamplingParams, eager: bool = False):
        L = self.L.view(1)
        mask = self._mask(L)
        logits, _ = self._target(self.root.view(1), L, L, mask, want_aux=False, eager=eager)
        nxt = choose(logits[0], sp)
        if self.record_margins:
            self._record(logits)
        self.emit[1] = nxt
        self.emit[0].fill_(1)
        self.root.copy_(nxt)
        self.L.add_(1)

    def _record(self, rows: torch.Tensor) -> None:
        gap, top = _top2(rows)
        self.out_gap[: rows.shape[0]] = gap
        self.out_top[: rows.shape[0]] = top

    def _handoff(self, tokens, aux_rows, n_acc, eager: bool = False, pos=None, mask=None):
        """Drafter re-prefill of the accepted tokens: tokens [M] (accepted drafts + bonus, padded),
        aux_rows [M, kH] (target aux of root + accepted drafts, padded), rows >= n_acc+1 are padding. `pos` / `mask`:
        L + arange(M) and its causal mask when the round has them already (a chain round: its verify's)."""
        M = tokens.shape[0]
        if pos is None:
            pos = self.L + torch.arange(M, device=self.device)
            mask = self._mask(pos)
        h = self._draft_fwd(tokens, self._fuse(aux_rows), pos, pos, mask, eager=eager)
        self.h_last.copy_(h.index_select(0, n_acc.view(1))[0])

    def _chain_draft(self, K: int, sp: SamplingParams, eager: bool = False):
        """A chain round's K drafts from `h_last` -> (ids [K+1] = root + drafts, positions, mask of the verify, draft
        probs over the target vocab [K, V] (sampling) or None). `eager`: inside a traced round (no nested compile)."""
        dev = self.device
        L = self.L
        V = self.vocab_size
        drafts, qs = [], []
        h = self.h_last
        # the verify's positions and mask, made once: draft step i runs at L + i under the verify's row i. Under
        # torch.compile with the kernels (opaque operators), buffers of their own (`kernels.realize`): else inductor
        # re-computes a position and a mask row for every step's kernels (two small launches a step)
        pos = L + self._ar[: K + 1]
        vmask = self._mask(pos)
        if self._d_kern is not None:
            from draftsmith.decode.kernels import realize

            pos, vmask = realize(pos, vmask)
        for i in range(K):
            if sp.greedy and self._d_kern is not None and self.fused_draft_argmax:
                ti = self._draft_token(h)  # lm_head, argmax and id map: one kernel
            else:
                dl = self._draft_logits(h)
                if sp.greedy:
                    di = torch.argmax(dl, -1)
                else:
                    qd = warp(dl, sp)
                    di = sample(qd)
                    qs.append(torch.zeros(V, device=dev, dtype=qd.dtype).index_copy(0, self.d_ids, qd))
                ti = self.d_ids.gather(0, di.view(1))
            drafts.append(ti)
            if i < K - 1:
                p = pos[i : i + 1]
                h = self._draft_fwd(ti, h.view(1, -1), p, p, vmask[i : i + 1], eager=eager)[0]
        ids = torch.cat([self.root.view(1)] + drafts)
        return ids, pos, vmask, (torch.stack(qs) if qs else None)

    def _chain_finish(
        self, K: int, sp: SamplingParams, ids, logits, aux, qs, eager: bool = False, pos=None, mask=None
    ) -> None:
        """Accept the verified chain (logits [K+1, V] of `ids`), hand the accepted rows to the drafter, commit."""
        draft = ids[1:]
        if sp.greedy:
            a, bonus = chain_accept(draft, None, None, torch.argmax(logits, -1))
        else:
            a, bonus = chain_accept(draft, warp(logits, sp), qs, None)
        out = torch.cat([draft, draft[:1]]).index_copy(0, a.view(1), bonus.view(1))
        if self.record_margins:  # emitted token i was chosen by verify row i
            self._record(logits)
        self._handoff(out, aux, a, eager=eager, pos=pos, mask=mask)
        self.emit[1 : K + 2] = out
        self.emit[0].copy_(a + 1)
        self.root.copy_(bonus)
        self.L.add_(a + 1)

    def _chain_round(self, mode: DecodeMode, sp: SamplingParams, eager: bool = False):
        K = mode.draft_tokens
        ids, pos, mask, qs = self._chain_draft(K, sp, eager)
        logits, aux = self._target(ids, pos, pos, mask, eager=eager)
        self._chain_finish(K, sp, ids, logits, aux, qs, eager, pos, mask)
        self._last_draft = ids

    def compile_rounds(self, backend: str = "inductor", fullgraph: bool = False) -> None:
        """torch.compile greedy rounds (and plain steps) whole (`_traced_round`); compile=True does it on CUDA. `backend`/`fullgraph`: tests trace the rounds on the CPU ("aot_eager",
        fullgraph=True: no graph break). Drops captured graphs."""
        c = functools.partial(torch.compile, dynamic=False, backend=backend, fullgraph=fullgraph)
        if backend == "inductor":
            c = functools.partial(c, mode=self.compile_mode)
        self._c_round = c(self._traced_round)
        self._graphs.clear()
        self._pf_graphs.clear()

    def _traced_round(self, mode: DecodeMode, sp: SamplingParams):
        """A whole round (or plain step) for torch.compile (`_c_round`): every forward inside it traced inline, the
        Triton kernels as custom ops (`draftsmith.decode.kernels`)."""
        if mode.kind == "plain":
            self._plain_step(sp, eager=True)
        elif mode.kind == "chain":
            self._chain_round(mode, sp, eager=True)
        else:
            self._tree_round(mode, sp, eager=True)

    def _chain_round_cpu(self, mode: DecodeMode) -> None:
        """The greedy chain round on the CPU (`_step_fn` picks it): the same draft, verify, accept and hand-off as
        `_chain_round`, with the bookkeeping on the host, where a sync costs nothing. A round of the demo target is
        ~200 small ops at ~5 us each (BENCHMARKS.md "Demo target on CPU"), so: positions and masks are slices of
        tables built once (no arange / compare / index per forward), the acceptance is a Python loop over K+1
        ints, and the hand-off forwards the a+1 accepted rows only (the drafter slots past them hold draft-step
        entries that the next round overwrites before it attends to them, as after a padded hand-off)."""
        K = mode.draft_tokens
        L = int(self.L)
        ar, d_ids = self._ar, self.d_ids
        rows, add = self._causal_rows, self._causal_add_rows
        h = self.h_last
        drafts = []
        for i in range(K):
            ti = d_ids.index_select(0, torch.argmax(self._draft_logits(h), -1).view(1))
            drafts.append(ti)
            if i < K - 1:
                p = ar[L + i : L + i + 1]
                h = self._draft_fwd(ti, h.view(1, -1), p, p, add(L + i, 1))[0]
        ids = torch.cat([self.root.view(1), *drafts])
        pos = ar[L : L + K + 1]
        logits, aux = self._target(ids, pos, pos, rows(L, K + 1))
        choice = torch.argmax(logits, -1).tolist()
        draft = ids.tolist()[1:]
        a = 0
        while a < K and draft[a] == choice[a]:
            a += 1
        out = ids.new_tensor(draft[:a] + [choice[a]])
        p = pos[: a + 1]
        h = self._draft_fwd(out, self._fuse(aux[: a + 1]), p, p, add(L, a + 1))
        self.h_last.copy_(h[a])
        self.emit[1 : a + 2] = out
        self.emit[0].fill_(a + 1)
        self.root.fill_(choice[a])
        self.L.fill_(L + a + 1)
        self._last_draft = ids

    def _causal_rows(self, start: int, n: int) -> torch.Tensor:
        """`_mask` of rows at positions start..start+n-1: a slice of the [max_len, max_len] causal table (built on
        first use; past CAUSAL_TABLE_MAX slots it would not pay for its memory, and the masks are computed)."""
        if self.max_len > self.CAUSAL_TABLE_MAX:
            return self._mask(self._ar[start : start + n])
        if self._causal is None or self._causal.shape[0] != self.max_len:
            self._causal = self._ar[None, :] <= self._ar[:, None]
        return self._causal[start : start + n]

    def _causal_add_rows(self, start: int, n: int) -> torch.Tensor:
        """`_causal_rows` as an additive mask in the drafter's dtype (0 visible, dtype min hidden): what its
        attention adds, without the four ops of `prepare_mask` per draft forward."""
        if self.max_len > self.CAUSAL_TABLE_MAX:
            return self._causal_rows(start, n)
        t = self._causal_add
        if t is None or t.shape[0] != self.max_len:
            vis = self._causal_rows(0, self.max_len)
            t = self._causal_add = torch.zeros(vis.shape, dtype=self.d_dtype, device=self.device).masked_fill_(
                ~vis, torch.finfo(self.d_dtype).min
            )
        return t[start : start + n]

    CAUSAL_TABLE_MAX = 2048  # slots: tables of 4 MB (bool) and 16 MB (fp32)

    def _tree_consts(self, mode: DecodeMode) -> dict:
        """Index and mask constants of a tree round, built once per setting outside any graph: inside a captured
        round every `arange`/`eye`/`full` is a kernel on each replay, and the round is launch-bound (2026-11-29:
        282 of a 893-op round on pycode-small were bookkeeping)."""
        c = self._tree_cache.get(mode.key())
        if c is not None:
            return c
        k, D, N = mode.top_k, mode.depth, mode.tree_tokens
        C, kk, dev = mode.num_candidates, k * k, self.device
        R = max((D - 1) * k, 1)
        eye_k = torch.eye(k, dtype=torch.bool, device=dev)
        f_add, anc_add, new_idx = [], [], []
        for j in range(1, D):
            m = torch.zeros(k, R, dtype=torch.bool, device=dev)
            m[:, (j - 1) * k : j * k] = eye_k
            f_add.append(m)  # frontier row i attends to its own drafter slot at depth j
            n_c = k + (j - 1) * kk
            a = torch.zeros(kk, C, dtype=torch.bool, device=dev)
            a[:, n_c : n_c + kk] = torch.eye(kk, dtype=torch.bool, device=dev)
            anc_add.append(a)  # each new candidate is its own ancestor
            new_idx.append(n_c + torch.arange(kk, device=dev))
        depth_all = torch.cat(
            [torch.ones(k, dtype=torch.long, device=dev)]
            + [torch.full((kk,), j + 1, dtype=torch.long, device=dev) for j in range(1, D)]
        )
        anc0 = torch.zeros(C, C, dtype=torch.bool, device=dev)
        anc0[:k, :k] = eye_k
        # parent -1 (the root) indexes cmap's last entry: node 0
        cmap0 = torch.cat(
            [torch.full((C,), -1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev)]
        )
        tmask0 = torch.zeros(N + 1, N + 1, dtype=torch.bool, device=dev)
        tmask0[:, 0].fill_(True)
        c = {
            "f_add": f_add,
            "anc_add": anc_add,
            "new_idx": new_idx,
            "anc0": anc0,
            "cmap0": cmap0,
            "tmask0": tmask0,
            "depth_all": depth_all,
            "depth_pen": depth_all.to(torch.float32) * 1e-6,
            "parent0": torch.full((k,), -1, dtype=torch.long, device=dev),
            "pos_off": torch.arange(max(D - 1, 1), device=dev)[:, None].expand(max(D - 1, 1), k).contiguous(),
            "slot_off": torch.arange(max(D - 1, 1) * k, device=dev).view(max(D - 1, 1), k),
            "ar_k": torch.arange(k, device=dev),
            "ar_R": torch.arange(R, device=dev),
            "ar_N1": torch.arange(N + 1, device=dev),
            "ar_1N": torch.arange(1, N + 1, device=dev),
            "ar_D1": torch.arange(D + 1, device=dev),
            "zero1": torch.zeros(1, dtype=torch.long, device=dev),
            "minus2": torch.full((1,), -2, dtype=torch.long, device=dev),
            "far": torch.full((N + 1,), D + 1, dtype=torch.long, device=dev),
        }
        self._tree_cache[mode.key()] = c
        return c

    @staticmethod
    def _region(prefix: torch.Tensor, slots: torch.Tensor, region: torch.Tensor) -> torch.Tensor:
        """`_region_mask` in two kernels: prefix [S] (committed slots, s < L) for every row, then region [T, R]
        written at slots [R] (= L..L+R-1, inside the cache: the round's capacity check guarantees it)."""
        return prefix.expand(region.shape[0], -1).clone().index_copy_(1, slots, region)

    def _tree_round(self, mode: DecodeMode, sp: SamplingParams, eager: bool = False):
        k, D, N = mode.top_k, mode.depth, mode.tree_tokens
        c = self._tree_consts(mode)
        topk = self._draft_topk if eager else self._d_topk
        L = self.L
        prefix = self._ar < L  # committed slots, shared by every mask of the round
        # candidates: token (target id), score (cumulative log-prob), parent (candidate index, -1 = root)
        s1, i1 = topk(self.h_last, k)
        c_tok, c_score, c_parent = [self.d_ids.gather(0, i1)], [s1], [c["parent0"]]
        # (no python-scalar advanced-index writes below: those would copy host->device inside a graph)
        anc = c["anc0"].clone()  # candidate ancestor-or-self
        f_tok, f_score, f_cand = c_tok[0], s1, c["ar_k"]
        f_h = self.h_last[None].repeat(k, 1)  # a real [k, H] (an expand's 0-stride would be a second graph)
        f_mask = None  # drafter-slot ancestry of the frontier in the tree region [k, R]
        pos_all, slots_all, region_slots = L + c["pos_off"], L + c["slot_off"], L + c["ar_R"]
        for j in range(1, D):
            f_mask = c["f_add"][0] if f_mask is None else f_mask | c["f_add"][j - 1]
            mask = self._region(prefix, region_slots, f_mask)
            h = self._draft_fwd(f_tok, f_h, pos_all[j - 1], slots_all[j - 1], mask, eager=eager)  # [k, H]
            sj, ij = topk(h, k)  # [k, k]
            sc = (f_score[:, None] + sj).reshape(-1)
            tok = self.d_ids[ij.reshape(-1)]
            pc = f_cand.repeat_interleave(k)  # parent candidate of each child
            n_c = k + (j - 1) * k * k
            anc[n_c : n_c + k * k] = anc.index_select(0, pc) | c["anc_add"][j - 1]
            c_tok.append(tok)
            c_score.append(sc)
            c_parent.append(pc)
            # next frontier: best k of the k*k children
            fs, fi = torch.topk(sc, k)
            pf = fi // k  # frontier row of each chosen child
            f_tok, f_score, f_cand = tok[fi], fs, c["new_idx"][j - 1][fi]
            f_h = h[pf]
            f_mask = f_mask[pf]
        tok = torch.cat(c_tok)
        parent = torch.cat(c_parent)
        # best N nodes; ties broken toward shallower nodes so the set stays ancestor-closed
        _, sel = torch.topk(torch.cat(c_score) - c["depth_pen"], N)
        sel, _ = torch.sort(sel)  # parents (earlier levels) come first
        node_tok = torch.cat([self.root.view(1), tok[sel]])
        node_depth = torch.cat([c["zero1"], c["depth_all"][sel]])
        cmap = c["cmap0"].clone()
        cmap[sel] = c["ar_1N"]
        node_parent = torch.cat([c["minus2"], cmap[parent[sel]]])
        tmask = c["tmask0"].clone()
        tmask[1:, 1:] = anc.index_select(0, sel).index_select(1, sel)
        # verify
        slots = L + c["ar_N1"]
        logits, aux = self._target(node_tok, L + node_depth, slots, self._region(prefix, slots, tmask), eager=eager)
        choice = choose(logits, sp)  # [N+1]: argmax, or one draw per node from p (recursive rejection)
        # accept: node i is on the accepted path iff it and all its ancestors match their parent's choice (a
        # node's children are distinct tokens, so the accepted nodes form one path); the deepest is where it ends
        ok = node_tok[1:] == choice.index_select(0, node_parent[1:])
        acc_depth = (~(tmask[1:, 1:] & ~ok[None, :]).any(-1)) * node_depth[1:]
        a = acc_depth.max()  # accepted draft tokens
        cur = torch.where(a > 0, torch.argmax(acc_depth) + 1, c["zero1"][0])
        # the path root..cur by depth; entries past a repeat cur (the hand-off pads with them)
        order = torch.argsort(torch.where(tmask.index_select(0, cur.view(1))[0], node_depth, c["far"]))
        path_t = order.gather(0, torch.minimum(c["ar_D1"], a))  # [D+1]
        bonus = choice.index_select(0, cur.view(1))[0]
        out = torch.cat([node_tok[path_t[1:]], node_tok[:1]]).index_copy(0, a.view(1), bonus.view(1))
        if self.record_margins:  # the token at depth i+1 (and the bonus after depth a) was chosen by path row i
            self._record(logits.index_select(0, path_t))
        # compact the target cache to root + accepted path (entries past a are junk, never attended)
        self.runner.compact(L + path_t, L + c["ar_D1"])
        if self.states is not None:  # the recorded states follow their K/V
            self.states.index_copy_(0, L + c["ar_D1"], self.states.index_select(0, L + path_t))
        self._handoff(out, aux.index_select(0, path_t), a, eager=eager)
        self.emit[1 : D + 2] = out
        a1 = a + 1
        self.emit[0].copy_(a1)
        self.root.copy_(bonus)
        self.L.add_(a1)
        self._last_tree = (node_tok, node_parent, node_depth, tmask)

    # ------------------------------------------------------------------ graphs
    def _step_fn(self, mode: DecodeMode, sp: SamplingParams):
        if mode.kind == "plain":
            if self._c_round is not None and sp.greedy:  # the embedding, argmax and state updates fused too
                return lambda: self._c_round(mode, sp)
            return lambda: self._plain_step(sp)
        if mode.kind == "chain":
            if self.host_rounds and self._d_cpu is not None and sp.greedy and not self.record_margins:
                return lambda: self._chain_round_cpu(mode)
        else:
            self._tree_consts(mode)  # built here, outside the round (and outside any graph capture)
        if self._c_round is not None and sp.greedy:  # compile=True on CUDA: the round traced whole
            return lambda: self._c_round(mode, sp)
        if mode.kind == "chain":
            return lambda: self._chain_round(mode, sp)
        return lambda: self._tree_round(mode, sp)

    def _runner_for(self, mode: DecodeMode, sp: SamplingParams):
        self._refresh_drafter_view()
        if mode.kind != "plain" and getattr(getattr(self.runner, "kernel_config", None), "lt_matmuls", False):
            # experimental: the verify's matmuls through tuned cuBLASLt algorithms, chosen before it is traced
            self.lt_tuning += self.runner.tune_lt([mode.verify_tokens])
        sp = sp.canonical()
        fn = self._step_fn(mode, sp)
        if not self.cuda_graphs:
            return fn
        key = (mode.key(), sp, self.record_margins)
        self._graphs_for(sp)
        if key in self._graphs:
            return self._graphs[key]
        try:
            g = self._capture(fn)
            self._graphs[key] = g
            return g
        except Exception as e:  # pragma: no cover - GPU only
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly", stacklevel=2)
            self._graphs[key] = fn
            return fn

    def _graphs_for(self, sp: SamplingParams) -> None:
        """Mark `sp` (canonical) as the latest sampling setting with graphs; past `max_graph_samplings` settings,
        drop the least recently used one's graphs (rounds and prefills). A graph bakes its sampling setting in, and a
        server's clients send any temperature: without a bound every new one would keep its graphs (and their
        memory) for good."""
        lru = self._graph_samplings
        lru.pop(sp, None)
        lru[sp] = None
        while len(lru) > max(1, self.max_graph_samplings):
            old = next(iter(lru))
            del lru[old]
            for graphs, at in ((self._graphs, 1), (self._pf_graphs, 2)):  # where the keys hold the setting
                for key in [k for k in graphs if k[at] == old]:
                    del graphs[key]

    def _capture(self, fn, pool=None):  # pragma: no cover - GPU only
        # the eager warm-up rounds draw from the default CUDA generator (sampling); restore its state so
        # capturing is invisible to the RNG stream (else `generate(seed=s)` differs between its first call,
        # which captures, and later ones). Inside the graph the default generator is graph-safe: capture
        # registers it and each replay reads its seed and advances its Philox offset.
        dev = self.device.index if self.device.index is not None else torch.cuda.current_device()
        rng = torch.cuda.get_rng_state(dev)
        try:
            return self._capture_graph(fn, pool)
        finally:
            torch.cuda.set_rng_state(rng, dev)

    def _capture_graph(self, fn, pool=None):  # pragma: no cover - GPU only
        saved = [t.clone() for t in self._state()]
        safe = [t.clone() for t in saved]
        safe[0].fill_(0)  # warm up / capture at L = 0: every slot a round touches is in range
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._set_state(safe)
                fn()
        torch.cuda.current_stream().wait_stream(s)
        self._set_state(safe)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # pool: a handle shared with other graphs, or None (its own)
            fn()
        self._set_state(saved)
        torch.cuda.synchronize()
        return graph.replay

    def _state(self):
        st = [self.L, self.root]
        if self.drafter is not None:
            st.append(self.h_last)
        return st

    def _set_state(self, values):
        for t, v in zip(self._state(), values):
            t.copy_(v)

    def warmup(self, mode: DecodeMode, sp: SamplingParams | None = None, prefill: bool = False) -> None:
        """Capture the graph for (mode, sp) now (the first generate() would otherwise pay for it); with `prefill`
        also the prefill graph of every length bucket for this mode (`prefill_graphs`: ~50 ms each on first use,
        which a server's first requests would otherwise pay). Call it between generations: capturing runs one round
        at L=0 (a prefill over a whole bucket), overwriting cache slots."""
        sp = sp or SamplingParams()
        with torch.no_grad():
            if self.cuda_graphs:
                self._runner_for(mode, sp)
            if prefill and self.prefill_graphs:
                draft = mode.kind != "plain" and self.drafter is not None
                for B in self.PREFILL_BUCKETS:
                    if B > self.max_len:
                        break
                    self._pf_n.fill_(B)  # a prompt filling the bucket: every row the body indexes lies inside it
                    self._prefill_runner(B, draft, sp)

    # ------------------------------------------------------------------ public step API
    # gpt-fast's prefill / decode_one_token / speculative_decode, for benchmarks, tests and servers that drive the
    # engine one step at a time. State (committed length `L`, pending token `root`, the drafter's `h_last`) lives on
    # the device; call `prefill` first. "Graph-safe": the call issues no host sync and keeps static shapes, so it can
    # run inside a CUDA graph capture (the rounds are captured from exactly these calls).
    def mask(self, limit: torch.Tensor) -> torch.Tensor:
        """`causal_mask` over this engine's cache: [T, max_len] bool, slot s visible to row t iff s <= limit[t].
        No sync; graph-safe."""
        return self._mask(limit)

    def step_fn(self, mode: DecodeMode, sp: SamplingParams | None = None):
        """A callable that runs one round of `mode` (a plain step for "plain") in place on the device state, without
        a host sync: the CUDA-graph replay when graphs are on (captured here on first use, which runs a round at
        L = 0 and overwrites cache slots: call it between generations), else the eager round. Read the round's
        tokens from `emit` ([n, token 0, ..., token n-1]: one copy, one sync)."""
        with torch.no_grad():
            return self._runner_for(mode, sp or SamplingParams())

    def eager_step_fn(self, mode: DecodeMode, sp: SamplingParams | None = None):
        """The same round as `step_fn`, never from a CUDA graph (profilers, op censuses, timing the eager path). The
        greedy chain round of the CPU path (`host_rounds`) syncs; every other round is sync-free and graph-safe."""
        self._refresh_drafter_view()
        return self._step_fn(mode, sp or SamplingParams())

    @torch.no_grad()
    def plain_step(self, sp: SamplingParams | None = None) -> int:
        """One plain decoding step after `prefill` (through `step_fn`: graphed when graphs are on): commits the
        pending token and returns the next one. Syncs once (the returned int)."""
        self._runner_for(DecodeMode("plain"), sp or SamplingParams())()
        return int(self.emit[1])

    @torch.no_grad()
    def speculative_round(self, mode: DecodeMode, sp: SamplingParams | None = None) -> list[int]:
        """One speculative round after `prefill` (draft, verify, accept, hand-off; through `step_fn`): the tokens it
        emits (accepted drafts + the bonus token). Syncs once (the returned list). The caller checks the cache has
        room (`mode.cache_need` slots past the committed length)."""
        self._runner_for(mode, sp or SamplingParams())()
        vals = self.emit[: mode.max_accept + 2].tolist()
        return vals[1 : 1 + vals[0]]

    def target_forward(self, ids, positions, slots, mask, logits_rows=None, want_aux: bool = True):
        """The target forward a round uses (compiled / kernel-routed as configured): writes K/V at `slots`, attends
        under `mask` [T, S]; returns (logits [R, V] fp32, aux [T, k*H] or None). No sync; graph-safe (with state
        recording on it also writes `states` rows)."""
        return self._target(ids, positions, slots, mask, logits_rows=logits_rows, want_aux=want_aux)

    def draft_forward(self, ids, hidden, positions, slots, mask) -> torch.Tensor:
        """The drafter forward a round uses over T tokens with their (fused) hidden inputs -> [T, H]; writes the
        drafter cache at `slots`. No sync; graph-safe. `mask`: bool [T, S] (e.g. `mask(positions)`). Like the rounds,
        the public drafter calls first rebuild the decoding view if the drafter's weights changed under the engine."""
        self._refresh_drafter_view()
        return self._draft_fwd(ids, hidden, positions, slots, mask)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Drafter logits (over the draft vocab, fp32) after hidden state(s) h. No sync; graph-safe."""
        self._refresh_drafter_view()
        return self._draft_logits(h)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The drafter's fc over target aux states [T, k*H] -> its hidden input [T, H]. No sync; graph-safe."""
        self._refresh_drafter_view()
        return self._fuse(aux)

    def draft_token(self, h: torch.Tensor) -> torch.Tensor:
        """The greedy draft token after one drafter state h [H] as a chain round picks it: the target vocabulary's
        id (long [1]) of the drafter's argmax — with the kernels and `fused_draft_argmax` the lm_head, argmax and
        draft-to-target map in one launch (`KernelDraftStep.greedy_token`), else logits, argmax, map. No sync;
        graph-safe."""
        self._refresh_drafter_view()
        return self._draft_token(h)

    def _draft_token(self, h: torch.Tensor) -> torch.Tensor:
        if self._d_kern is not None and self.fused_draft_argmax:
            return self._d_kern.greedy_token(h, self.d_ids)
        return self.d_ids.gather(0, torch.argmax(self._draft_logits(h.reshape(1, -1)), -1).view(1))

    @property
    def cpu_paths(self) -> dict:
        """Which CPU-specific paths are on: "target", the runner's forward from transposed weight copies; "drafter",
        the flat drafter step (`fused_drafter.CpuDraftStep`), and with it the host-side greedy chain round
        (`host_rounds`)."""
        return {"target": bool(getattr(self.runner, "cpu_transposed", False)), "drafter": self._d_cpu is not None}

    def set_cpu_paths(self, on: bool) -> None:
        """Turn the CPU-specific paths off (the device-agnostic ops a GPU runs: benchmarks and tests compare the two)
        or back on where they apply (a CPU engine, not compiled, a small model). Drops captured graphs."""
        if hasattr(self.runner, "set_cpu_transposed"):
            self.runner.set_cpu_transposed(on)
        if on:
            self._build_cpu_draft_step()
        else:
            self._d_cpu = None
        self._graphs.clear()
        self._pf_graphs.clear()

    @property
    def drafter_kernel_limits(self) -> dict:
        """With kernels="triton": the most tokens of a drafter forward whose attention runs `kernels.rows_attention`
        ("rows_attention") and the largest k a tree level's top-k runs through `kernels.topk_logprobs`
        ("topk_logprobs"); 0 = torch's op."""
        return {"rows_attention": self._d_rows_attn, "topk_logprobs": self._topk_max}

    @property
    def graphs(self):
        """The rounds captured so far, read-only: (mode key, sampling, record_margins) -> replay callable (or the
        eager round where capture failed)."""
        return MappingProxyType(self._graphs)

    def drop_graphs(self) -> None:
        """Forget every captured round (after changing kernel settings under the engine: the next `step_fn`
        captures anew)."""
        self._graphs.clear()
        self._pf_graphs.clear()

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        mode: DecodeMode | None = None,
        seed: int | None = None,
        stop_strings: Sequence[str] = (),
        eos_ids: Sequence[int] | None = None,
        trace: bool = False,
        sync_every: int = 8,
        on_tokens=None,
        lookahead: bool | None = None,
    ) -> GenerationResult:
        """Decode up to max_new_tokens new tokens after prompt_ids. Returns new tokens only.

        `on_tokens(new_ids)`: called on this thread with each batch of emitted tokens (once per round, after the stop
        checks), for streaming; returning False ends the generation there with finish_reason "cancelled" (a
        disconnected client frees the engine within one round; with `lookahead` the round in flight still finishes on
        the GPU). On the CPU it runs under `cpu_threads` torch threads (the process's setting is restored after).

        `lookahead` (default: on for a CUDA engine, `self.lookahead`): launch the next round (or batch of plain steps)
        before reading the one in flight, so the GPU never waits for the host's read, stop checks and relaunch
        (~75 us a round on pycode-small, docs/LOG.md 2026-12-02 eleventh session). The tokens are the same; a
        generation that stops has run at most one round more than it keeps (its writes lie past the committed
        length)."""
        threads = self.cpu_threads if self.device.type == "cpu" else None
        if threads and threads != torch.get_num_threads():
            prev = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return self.generate(
                    prompt_ids,
                    max_new_tokens,
                    sampling,
                    mode,
                    seed,
                    stop_strings,
                    eos_ids,
                    trace,
                    sync_every,
                    on_tokens,
                    lookahead,
                )
            finally:
                torch.set_num_threads(prev)
        sp = sampling or SamplingParams()
        mode = mode or (DecodeMode("chain") if self.drafter is not None else DecodeMode("plain"))
        mode.validate()
        if mode.kind != "plain" and self.drafter is None:
            raise ValueError(f"{mode.kind} decoding needs a drafter")
        eos = set(self.eos_ids if eos_ids is None else eos_ids)
        n = len(prompt_ids)
        if max_new_tokens <= 0:
            return GenerationResult([], "" if self.tokenizer is not None else None, "length", n, 0)
        if n < 1:
            raise ValueError("empty prompt")
        if n + 1 > self.max_len:
            raise ValueError(f"prompt of {n} tokens does not fit the cache ({self.max_len})")
        # capture before prefill (capturing runs the step at L=0 and would clobber committed KV) and timing;
        # the plain step is the fallback when a round no longer fits the cache
        step = self._runner_for(mode, sp)
        plain = step if mode.kind == "plain" else self._runner_for(DecodeMode("plain"), sp)
        if seed is not None:  # after any capture: the same seed gives the same tokens on every call
            torch.manual_seed(seed)
        sync = self.device.type == "cuda"
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = self.prefill(prompt_ids, sp, draft=mode.kind != "plain")
        if sync:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        res = GenerationResult([], None, "length", n, 0, proposed_per_round=mode.max_accept)
        res.trace = [] if trace else None
        L_host = n
        rec = self.record_margins
        if rec:
            res.margins = [self.prefill_margin]

        def emit(toks) -> bool:
            before = len(res.token_ids)
            done = self._emit(res, toks, eos, stop_strings, max_new_tokens)
            if on_tokens is not None and on_tokens(res.token_ids[before:]) is False and not done:
                res.finish_reason = "cancelled"
                return True
            return done

        finished = emit([first])
        budget = mode.cache_need + 1
        if (self.lookahead if lookahead is None else lookahead) and not trace and not finished:
            finished, L_host = self._decode_ahead(
                res, mode, step, plain, emit, L_host, budget, max_new_tokens, sync_every
            )
        while not finished:
            if mode.kind != "plain" and L_host + budget <= self.max_len:
                step()
                vals = self.emit[: mode.max_accept + 2].tolist()
                k = vals[0]
                toks = vals[1 : 1 + k]
                if rec:
                    res.margins += list(zip(self.out_gap[:k].tolist(), self.out_top[:k].tolist()))
                res.accepted.append(k - 1)
                res.rounds += 1
                if trace:
                    res.trace.append(
                        {
                            "L": L_host,
                            "tokens": toks,
                            "draft": self._last_draft.tolist()
                            if mode.kind == "chain" and not self.cuda_graphs
                            else None,
                        }
                    )
                L_host += k
                finished = emit(toks)
            elif L_host + 1 < self.max_len:
                # plain steps: several per host sync (over-generation past a stop is discarded)
                m = max(
                    1,
                    min(
                        sync_every if mode.kind == "plain" else 1,
                        max_new_tokens - len(res.token_ids),
                        self.max_len - 1 - L_host,
                    ),
                )
                toks, gaps = self._plain_batch(plain, m, rec)
                toks = toks.tolist()
                if rec:
                    res.margins += [tuple(g) for g in gaps.tolist()]
                res.rounds += m
                L_host += m
                finished = emit(toks)
            else:
                res.finish_reason = "cache"
                finished = True
        if sync:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        res.prefill_s, res.decode_s = t1 - t0, t2 - t1
        if self.tokenizer is not None:
            res.text = self.tokenizer.decode(res.token_ids, skip_special_tokens=False)
        return res

    def _decode_ahead(self, res, mode, step, plain, emit, L_host, budget, max_new, sync_every):
        """`generate`'s loop one unit ahead: a unit (a round, or up to `sync_every` plain steps) is launched, its
        results copied to a pinned host slot (no sync), and the next unit launched before the host waits for the
        first. The host's turnaround (the copy's wait, the stop checks, the next launch) then overlaps a unit on the
        GPU instead of leaving the GPU idle between units. Bounds: a unit is launched only when, with every unit in
        flight at its largest advance (a round: max_accept + 1 slots), it still fits the cache and tokens are still
        wanted; and (`lookahead_tail`) a round is not launched ahead when the ones in flight are expected, at the
        generation's mean tokens a round so far, to bring it to max_new. Returns (finished, L_host); (False, L_host)
        hands the rest (the plain steps that end a nearly full cache) to the synchronous loop."""
        spec = mode.kind != "plain"
        A = mode.max_accept
        rec = self.record_margins
        stage = self._host_stage()
        pending: list = []  # (slot, tokens in the unit: None for a round)
        launched = 0
        tail = self.lookahead_tail
        kept_rounds = kept_tokens = 0  # this generation's rounds read so far, and their tokens
        while True:
            while len(pending) < 2:
                L_max = L_host + sum(A + 1 if m is None else m for _, m in pending)
                n_min = len(res.token_ids) + sum(1 if m is None else m for _, m in pending)
                if n_min >= max_new:
                    break
                if tail and pending and kept_rounds and spec:
                    tau = kept_tokens / kept_rounds
                    if len(res.token_ids) + sum(tau if m is None else m for _, m in pending) >= max_new:
                        break  # the round in flight likely ends it: read it before launching another
                slot = launched % 2
                if spec:
                    if L_max + budget > self.max_len:
                        break
                    step()
                    ints = [self.emit[: A + 2]]
                    floats = [self.out_gap[: A + 1], self.out_top[: A + 1]] if rec else []
                    m = None
                else:
                    m = min(sync_every, self.emit.numel() - 1, max_new - n_min, self.max_len - 1 - L_max)
                    if m < 1:
                        break
                    toks, gaps = self._plain_batch(plain, m, rec)
                    ints = [toks]
                    floats = [gaps.t().reshape(-1)] if rec else []  # the m gaps, then the m top logits
                stage.put(slot, ints, floats)
                pending.append((slot, m))
                launched += 1
            if not pending:
                return False, L_host
            slot, m = pending.pop(0)
            ints, floats = stage.get(slot)
            if m is None:
                k = int(ints[0])
                toks = ints[1 : 1 + k].tolist()
                if rec:
                    res.margins += list(zip(floats[:k].tolist(), floats[A + 1 : A + 1 + k].tolist()))
                res.accepted.append(k - 1)
                res.rounds += 1
                kept_rounds += 1
                kept_tokens += k
            else:
                k = m
                toks = ints[:m].tolist()
                if rec:
                    res.margins += list(zip(floats[:m].tolist(), floats[m : 2 * m].tolist()))
                res.rounds += m
            L_host += k
            if emit(toks):
                return True, L_host

    def _plain_batch(self, plain, m: int, rec: bool):
        """m plain steps without a sync -> (their tokens [m], with margins their (gap, top) rows [m, 2], else None)."""
        buf, gaps = [], []
        for _ in range(m):
            plain()
            buf.append(self.emit[1:2].clone())
            if rec:
                gaps.append(torch.stack([self.out_gap[0], self.out_top[0]]))
        return torch.cat(buf), (torch.stack(gaps) if rec else None)

    def _host_stage(self) -> _HostStage:
        if self._stage is None:
            self._stage = _HostStage(self.device, self.emit.numel())
        return self._stage

    def _emit(self, res: GenerationResult, toks, eos, stop_strings, max_new) -> bool:
        for t in toks:
            res.token_ids.append(int(t))
            if t in eos:
                res.finish_reason = "eos"
                return True
            if stop_strings and self.tokenizer is not None:
                tail = self.tokenizer.decode(res.token_ids[-32:], skip_special_tokens=False)
                if any(s in tail for s in stop_strings):
                    full = self.tokenizer.decode(res.token_ids, skip_special_tokens=False)
                    prev = self.tokenizer.decode(res.token_ids[:-1], skip_special_tokens=False)
                    if any(s in full and s not in prev for s in stop_strings):
                        res.finish_reason = "stop"
                        return True
            if len(res.token_ids) >= max_new:
                res.finish_reason = "length"
                return True
        return False
