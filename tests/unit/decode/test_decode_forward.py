"""Compact Llama-family forward vs HF; tree mask / positions / KV compaction vs a sequential reference."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from decode_helpers import tiny_llama, tiny_qwen3

from draftsmith.decode.engine import _region_mask, causal_mask
from draftsmith.decode.hf_generic import HFGenericForward
from draftsmith.decode.llama import LlamaFamilyForward, supports

ROOT = str(Path(__file__).resolve().parents[3])
PYCODE_TINY = next(
    (p for p in (os.path.join(ROOT, "assets", "pycode-tiny"), "/work/shared/targets/pycode-tiny") if os.path.isdir(p)),
    None,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _models():
    out = [
        ("qwen3", tiny_qwen3()),
        ("qwen2-bias", tiny_llama(vocab_size=50, model_type="qwen2")),
        ("llama-bias", tiny_llama(vocab_size=50, attention_bias=True)),
        ("mistral", tiny_llama(vocab_size=50, model_type="mistral")),
    ]
    if PYCODE_TINY:
        from transformers import AutoModelForCausalLM

        out.append(("pycode-tiny", AutoModelForCausalLM.from_pretrained(PYCODE_TINY, dtype=torch.float32).eval()))
    return out


MODELS = _models()


def _aux_ids(model):
    n = model.config.num_hidden_layers
    return [0, n // 2, n - 1]


@pytest.mark.parametrize("name,model", MODELS, ids=[m[0] for m in MODELS])
def test_own_forward_matches_hf(name, model):
    fwd = LlamaFamilyForward.from_hf(model, _aux_ids(model), 64)
    torch.manual_seed(1)
    T = 24
    ids = torch.randint(0, model.config.vocab_size, (T,))
    pos = torch.arange(T)
    with torch.no_grad():
        logits, aux = fwd(ids, pos, pos, causal_mask(64, pos, "cpu"))
        ref = model(ids[None], output_hidden_states=True)
    H = model.config.hidden_size
    torch.testing.assert_close(logits, ref.logits[0].float(), atol=1e-4, rtol=1e-4)
    for j, lid in enumerate(_aux_ids(model)):
        if lid == model.config.num_hidden_layers - 1:  # HF's last hidden state is post-norm
            continue
        torch.testing.assert_close(aux[:, j * H : (j + 1) * H], ref.hidden_states[lid + 1][0], atol=1e-4, rtol=1e-4)
    # incremental decode with the cache == full forward
    with torch.no_grad():
        fwd(ids[:10], pos[:10], pos[:10], causal_mask(64, pos[:10], "cpu"))
        for t in range(10, T):
            p = pos[t : t + 1]
            lg, _ = fwd(ids[t : t + 1], p, p, causal_mask(64, p, "cpu"))
            torch.testing.assert_close(lg[0], ref.logits[0, t].float(), atol=1e-4, rtol=1e-4)


def test_supports():
    assert supports(tiny_qwen3().config, 128)[0]
    from transformers import GPT2Config

    assert not supports(GPT2Config(), 128)[0]


def _runner(kind, model, max_len=64):
    if kind == "llama":
        return LlamaFamilyForward.from_hf(model, _aux_ids(model), max_len)
    from draftsmith.target_model.load import _find_decoder_layers

    return HFGenericForward(
        model, _find_decoder_layers(model, model.config.num_hidden_layers), _aux_ids(model), max_len
    )


def _seq_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("kind", ["llama", "hf"])
@pytest.mark.parametrize("name,model", MODELS[:2], ids=[m[0] for m in MODELS[:2]])
def test_tree_mask_positions_and_compaction(kind, name, model):
    """Each tree node's logits == sequential forward of its root-to-node path; after compacting an
    accepted path, decoding continues exactly as if that path had been decoded sequentially."""
    S = 64
    run = _runner(kind, model, S)
    V = model.config.vocab_size
    torch.manual_seed(3)
    prompt = torch.randint(0, V, (9,)).tolist()
    # tree: node 0 root; parents, with depth up to 3
    parent = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 3]
    tok = torch.randint(0, V, (len(parent),)).tolist()
    depth = [0] * len(parent)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    N = len(parent)
    anc = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    L = len(prompt)
    with torch.no_grad():
        p = torch.arange(L)
        run.forward(torch.tensor(prompt), p, p, causal_mask(S, p, "cpu"))
        Lt = torch.tensor(L)
        pos = Lt + torch.tensor(depth)
        slots = Lt + torch.arange(N)
        logits, aux = run.forward(torch.tensor(tok), pos, slots, _region_mask(S, Lt, anc, "cpu"))

    def path(i):
        out = []
        while i >= 0:
            out.append(i)
            i = parent[i]
        return out[::-1]

    for i in range(N):
        ref = _seq_logits(model, prompt + [tok[j] for j in path(i)])
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    # accept path 0 -> 1 -> 4 -> 8, compact, continue with one token
    acc = [0, 1, 4, 8]
    run.compact(Lt + torch.tensor(acc), Lt + torch.arange(len(acc)))
    nxt = 5 % V
    L2 = L + len(acc)
    with torch.no_grad():
        p2 = torch.tensor([L2])
        lg, _ = run.forward(torch.tensor([nxt]), p2, p2, causal_mask(S, p2, "cpu"))
    ref = _seq_logits(model, prompt + [tok[j] for j in acc] + [nxt])
    torch.testing.assert_close(lg[0], ref, atol=1e-4, rtol=1e-4)


def test_region_mask_layout():
    reg = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    m = _region_mask(8, torch.tensor(3), reg, "cpu")
    assert m.tolist() == [
        [True, True, True, True, False, False, False, False],
        [True, True, True, True, True, False, False, False],
    ]


def test_engine_region_builder_equals_region_mask():
    """The tree round's two-kernel mask builder == `_region_mask` (the reference) for random regions and offsets."""
    from draftsmith.decode.engine import SpeculativeDecoder

    g = torch.Generator().manual_seed(0)
    S = 40
    ar = torch.arange(S)
    for L in (0, 1, 7, 20):
        for T, R in ((1, 1), (3, 5), (9, 12)):
            reg = torch.rand(T, R, generator=g) < 0.5
            Lt = torch.tensor(L)
            got = SpeculativeDecoder._region(ar < Lt, Lt + torch.arange(R), reg)
            assert torch.equal(got, _region_mask(S, Lt, reg, "cpu")), (L, T, R)


@pytest.mark.parametrize("impl", ["bmm", "split"])
@pytest.mark.parametrize("S,T", [(208, 1), (256, 9), (1024, 33), (100, 5)])
def test_attention_impls_equal_sdpa(impl, S, T):
    """grouped_attention's batched-matmul and split-KV paths equal SDPA (fp32) under causal-prefix and tree-like
    masks, including key chunks that are masked out entirely (split: weight 0, not a uniform average)."""
    from draftsmith.decode.llama import grouped_attention

    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(1, 8, T, 32, generator=g)
    k, v = torch.randn(2, 1, 2, S, 32, generator=g)
    limit = torch.randint(S // 3, S, (T,), generator=g)
    mask = torch.arange(S)[None] <= limit[:, None]
    mask[:, : S // 4] = False  # whole leading chunks masked
    mask[:, 0] = True
    mask &= torch.rand(T, S, generator=g) > 0.2  # holes, as a tree mask has
    mask[:, 0] = True
    ref = grouped_attention(q, k, v, mask, 0.17, "sdpa")
    out = grouped_attention(q, k, v, mask, 0.17, impl)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention impl"):
        grouped_attention(q, k, v, mask, 0.17, "nope")


def test_compiled_step_updates_the_cache_in_place():
    """torch.compile of the compact forward writes the new K/V rows in place: no buffer of a whole layer's cache
    in inductor's code (writing through `k_cache[i]` taken inside the graph made it copy every layer's cache,
    then the whole 5-D cache back, on every step: +2 ms/step on the 8B shape at 2,128 slots)."""
    from torch._inductor.utils import run_and_get_code
    from transformers import LlamaConfig

    from draftsmith.decode.llama import LlamaFamilyForward

    torch._dynamo.reset()
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    r = LlamaFamilyForward.random(cfg, [0], max_len=4096, device="cpu", dtype=torch.float32)
    ids, pos = torch.zeros(1, dtype=torch.long), torch.tensor([5])
    mask = torch.arange(4096)[None] <= 5
    with torch.no_grad():
        want, _ = r.forward(ids, pos, pos, mask)
        k_before = r.k_cache.clone()
        r.k_cache.zero_(), r.v_cache.zero_()
        (got, _), codes = run_and_get_code(torch.compile(r.forward, dynamic=False), ids, pos, pos, mask)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(r.k_cache, k_before)  # the writes landed in the engine's cache
    alloc = re.compile(r"empty_strided\w*\(\(1, 2, 4096, 16\)")  # a new [1, n_kv, max_len, head_dim] buffer
    assert codes and not any(alloc.search(c) for c in codes), "compiled step allocates a whole layer's KV cache"
    torch._dynamo.reset()
