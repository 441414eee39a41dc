"""The compact forward's ops plans (`LlamaFamilyForward.plan`, `draftsmith.decode.ops`): which plan each forward
width gets for each setting, that plans are cached and rebuilt when a setting changes, that the forward is
straight-line code over one plan, and that the torch plans' forward equals HF's model (a one-token step and a tree
verify against the HF forward of each tree path)."""

from __future__ import annotations

import os

import pytest
import torch
from decode_helpers import tiny_llama, tiny_qwen3, tree_mask

if not torch.cuda.is_available():  # plans only: nothing here launches a kernel, but `kernels` reads this on import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from draftsmith.decode import ops as O  # noqa: E402
from draftsmith.decode.engine import causal_mask  # noqa: E402
from draftsmith.decode.kernel_config import KernelConfig  # noqa: E402
from draftsmith.decode.llama import TRITON_OPS, LlamaFamilyForward  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3()


def _fwd(model, max_len=48):
    n = model.config.num_hidden_layers
    return LlamaFamilyForward.from_hf(model, [0, n // 2, n - 1], max_len)


WIDTHS = (1, 2, 5, 64, 65, 256, 257, 300)


def _kinds(f):
    return [type(f.plan(T)) for T in WIDTHS]


def test_torch_plans_per_width(qwen3):
    f = _fwd(qwen3)
    assert f.cpu_transposed  # a small model on the CPU
    assert _kinds(f) == [O.CpuTransposedOps] * len(WIDTHS)
    assert all(f.triton_ops_for(T) == frozenset() and not f.triton_step(T) for T in WIDTHS)
    f.set_cpu_transposed(False)
    assert _kinds(f) == [O.TorchOps] * len(WIDTHS)
    f.set_cpu_transposed(True)
    assert _kinds(f) == [O.CpuTransposedOps] * len(WIDTHS)
    f.triton_max_rows = 64  # nothing without kernels="triton"
    assert _kinds(f) == [O.CpuTransposedOps] * len(WIDTHS)


@pytest.mark.parametrize("cpu_t", [True, False], ids=["cpu-transposed", "generic"])
def test_triton_plans_per_width(qwen3, cpu_t):
    pytest.importorskip("triton")
    from draftsmith.decode import kernels as K

    assert K.ROWS_ATTN_MAX == 256  # WIDTHS straddle it
    f = _fwd(qwen3)
    f.set_cpu_transposed(cpu_t)
    f.kernels = "triton"
    wide = O.CpuTransposedOps if cpu_t else O.TorchOps
    # one-token step; verify / hand-off widths: torch's matmuls and norms, rows_attention and rope_and_cache;
    # prefill widths: torch
    assert _kinds(f) == [O.TritonStepOps] + [O.TritonAttnOps] * 5 + [wide] * 2
    assert f.plan(1).routed == frozenset(TRITON_OPS) and f.plan(1).lin.func is K.gemv
    assert f.plan(5).routed == frozenset({"attn", "rope"}) and f.plan(257).routed == frozenset()
    assert f.plan(5).rope_cache == f.plan(5)._rope_cache_kernel
    assert [f.triton_step(T) for T in (1, 2, 65)] == [True, False, False]
    f.triton_max_rows = 64  # the experimental rows plan up to 64 rows
    from draftsmith.decode.experimental.gemm_rows import gemm_rows

    assert _kinds(f)[:4] == [O.TritonStepOps, O.TritonRowsOps, O.TritonRowsOps, O.TritonRowsOps]
    assert _kinds(f)[4:] == [O.TritonAttnOps, O.TritonAttnOps, wide, wide]
    assert f.plan(5).lin.func is gemm_rows and f.plan(1).lin.func is K.gemv
    assert not f.plan(5).fold_act and f.plan(5).glu
    assert [f.triton_step(T) for T in (1, 64, 65)] == [True, True, False]
    # an op left to torch: bound to TorchOps' implementation in the plan, nothing else changes
    f.triton_ops = set(TRITON_OPS) - {"gate_up"}
    p = f.plan(1)
    assert p.routed == frozenset(TRITON_OPS) - {"gate_up"} and not p.glu and p.fold_act  # silu*up moves into down
    assert p._gate_up == p._gate_up_torch and p.qkv == p._qkv_kernel
    f.triton_ops = set(TRITON_OPS) - {"attn"}
    assert type(f.plan(5)) is O.TritonRowsOps and type(f.plan(65)) is wide  # no attention kernel to take
    f.triton_ops = set(TRITON_OPS) - {"rope"}  # a wide forward's RoPE left to torch
    assert f.plan(65).routed == frozenset({"attn"}) and f.plan(65).rope_cache.__func__ is O.TorchOps.rope_cache


def test_head_dim_not_a_power_of_two_keeps_rope_and_attention_in_torch():
    pytest.importorskip("triton")
    f = _fwd(tiny_llama(vocab_size=50, hidden=48))  # head_dim 12
    f.kernels = "triton"
    assert f.plan(1).routed == frozenset(TRITON_OPS) - {"rope", "attn"}
    assert f.plan(1).rope_cache.__func__ is O.TorchOps.rope_cache
    assert type(f.plan(5)) is O.CpuTransposedOps


def test_plans_are_cached_and_rebuilt_when_a_setting_changes(qwen3):
    pytest.importorskip("triton")
    f = _fwd(qwen3)
    p1, p5, wide = f.plan(1), f.plan(5), f.plan(10_000)
    assert f.plan(1) is p1 and f.plan(5) is p5 and f.plan(300) is wide and p1 is p5  # one object per route
    f.kernels = "triton"
    s1, a5 = f.plan(1), f.plan(5)
    assert s1 is not p1 and f.plan(1) is s1 and f.plan(7) is a5 and type(a5) is O.TritonAttnOps
    f.triton_ops = set(TRITON_OPS)  # the same setting: the plans stay
    assert f.plan(1) is s1
    f.triton_ops = set(TRITON_OPS) - {"o"}
    assert f.plan(1) is not s1 and f.triton_ops_for(1) == frozenset(TRITON_OPS) - {"o"}
    assert f.plan(1).o_proj.__func__ is O.TorchOps.o_proj
    s1 = f.plan(1)
    cfg = KernelConfig(block_n=8)
    f.kernel_config = cfg
    assert f.plan(1) is not s1 and f.plan(1).config is cfg and f.plan(5).config is cfg
    s1 = f.plan(1)
    f.set_cpu_transposed(False)
    assert f.plan(1) is not s1 and type(f.plan(300)) is O.TorchOps
    s1 = f.plan(1)
    f.layers = list(f.layers)
    assert f.plan(1) is not s1 and f.plan(1).layers is f.layers
    f.kernels = "torch"
    assert type(f.plan(1)) is O.TorchOps and f.triton_ops_for(1) == frozenset()


class _Recorder:
    """Wraps a plan, recording which op the forward calls (and nothing else: the forward must not look past it)."""

    def __init__(self, inner, log):
        self.inner, self.log, self.layers = inner, log, inner.layers

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **k):
            self.log.append(name)
            return fn(*a, **k)

        return call


def test_forward_is_straight_line_over_its_plan(qwen3):
    f = _fwd(qwen3)
    ids = torch.arange(5)
    with torch.no_grad():
        want = f(ids, ids, ids, causal_mask(48, ids, "cpu"))
        log = []
        rec = _Recorder(f.plan(5), log)
        f._plans[5] = rec
        got = f(ids, ids, ids, causal_mask(48, ids, "cpu"))
    layer = ["qkv", "rope_cache", "attention", "o_proj", "mlp"]
    assert log == ["prepare", *layer * f.n_layers, "lm_head"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _hf_last(model, seq):
    """HF's logits and hidden states at the last token of `seq` (its own causal forward)."""
    out = model(torch.tensor(seq)[None], output_hidden_states=True)
    return out.logits[0, -1].float(), [h[0, -1] for h in out.hidden_states]


@pytest.mark.parametrize("cpu_t", [True, False], ids=["cpu-transposed", "torch"])
@pytest.mark.parametrize(
    "name,model", [("qwen3", tiny_qwen3()), ("llama-bias", tiny_llama(vocab_size=50, attention_bias=True))]
)
def test_torch_plans_equal_hf(name, model, cpu_t):
    """fp32: a one-token step (T=1) after a prefill, then a tree verify (T=5, nodes at depths 1,2,2,3,2) whose row
    t equals HF's forward of the context plus t's ancestor path; aux rows equal HF's hidden states and the final
    pre-norm state, normed, HF's last hidden state."""
    f = _fwd(model, 48)
    f.set_cpu_transposed(cpu_t)
    assert type(f.plan(1)) is type(f.plan(5)) is (O.CpuTransposedOps if cpu_t else O.TorchOps)
    H, n = model.config.hidden_size, model.config.num_hidden_layers
    aux_ids = f.aux_layers
    g = torch.Generator().manual_seed(4)
    ctx = torch.randint(0, model.config.vocab_size, (9,), generator=g).tolist()
    nodes = torch.randint(0, model.config.vocab_size, (5,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 2]
    tol = dict(atol=1e-4, rtol=1e-4)

    def check(logits, aux, seq):
        ref_logits, hs = _hf_last(model, seq)
        torch.testing.assert_close(logits, ref_logits, **tol)
        for j, lid in enumerate(aux_ids):
            if lid < n - 1:  # HF's last hidden state is post-norm
                torch.testing.assert_close(aux[j * H : (j + 1) * H], hs[lid + 1], **tol)
        final = aux[len(aux_ids) * H :]
        torch.testing.assert_close(model.model.norm(final[None])[0], hs[-1], **tol)

    with torch.no_grad():
        pos = torch.arange(8)
        f(torch.tensor(ctx[:8]), pos, pos, causal_mask(48, pos, "cpu"))
        p = torch.tensor([8])
        logits, aux = f(torch.tensor(ctx[8:]), p, p, causal_mask(48, p, "cpu"), want_final=True)  # T=1
        check(logits[0], aux[0], ctx)
        mask = tree_mask(parents, 48, 9)
        depth = mask[:, 9:14].sum(-1) - 1
        slots = torch.arange(9, 14)
        logits, aux = f(torch.tensor(nodes), 9 + depth, slots, mask, want_final=True)  # T=5
    assert logits.shape == (5, model.config.vocab_size) and logits.dtype == torch.float32
    for t in range(5):
        path, a = [], t
        while a >= 0:
            path.append(nodes[a])
            a = parents[a]
        with torch.no_grad():
            check(logits[t], aux[t], ctx + path[::-1])


def test_linear_add_keeps_the_residual_add_out_of_addmm():
    """`llama.linear_add` equals h + F.linear(x, w, b) bit for bit, and a compiled one leaves the matmul and the add
    apart, where inductor rewrites the plain expression into addmm (on CUDA a memcpy of h before a beta=1 GEMM, two
    a layer of a wide forward: BENCHMARKS.md "residual adds kept out of addmm"). If the control stops holding,
    inductor no longer fuses and the workaround can go."""
    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code

    from draftsmith.decode.llama import linear_add

    g = torch.Generator().manual_seed(0)
    h, x, w, b = (torch.randn(*s, generator=g) for s in ((7, 32), (7, 48), (32, 48), (32,)))
    for bias in (None, b):
        torch.testing.assert_close(linear_add(h, x, w, bias), h + F.linear(x, w, bias), rtol=0, atol=0)
    torch._dynamo.reset()
    _, (plain,) = run_and_get_code(torch.compile(lambda h, x, w: h + F.linear(x, w)), h, x, w)
    torch._dynamo.reset()
    _, (apart,) = run_and_get_code(torch.compile(linear_add), h, x, w)
    torch._dynamo.reset()
    assert "addmm" in plain  # the control: inductor's rewrite
    assert "addmm" not in apart and "extern_kernels.mm" in apart
