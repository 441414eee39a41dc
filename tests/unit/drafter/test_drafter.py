"""The EAGLE-3 drafter: shapes, attention hook, RoPE, save/load, from_target, draft vocab (CPU, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from draftsmith.common.errors import DraftsmithError
from draftsmith.drafter import Drafter, DrafterConfig, build_draft_vocab
from draftsmith.drafter.model import rope_inv_freq

REPO = Path(__file__).resolve().parents[3]
TINY = next(
    (
        p
        for p in (
            REPO / "assets" / "pycode-tiny",
            REPO.parent / "shared" / "targets" / "pycode-tiny",
            Path("/work/shared/targets/pycode-tiny"),
        )
        if (p / "config.json").is_file()
    ),
    None,
)
needs_tiny = pytest.mark.skipif(TINY is None, reason="pycode-tiny target not found")


def small_config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        target_hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        vocab_size=100,
        draft_vocab_size=40,
        aux_layer_ids=[0, 2, 3],
        target_num_layers=5,
        target_model_type="llama",
        target_name_or_path="toy",
    )
    base.update(kw)
    return DrafterConfig(**base)


def small_drafter(seed: int = 0, **kw) -> Drafter:
    torch.manual_seed(seed)
    d = Drafter(small_config(**kw))
    d.set_embedding(torch.randn(d.config.vocab_size, d.config.hidden_size))
    with torch.no_grad():  # non-trivial norm weights so norm placement matters
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(torch.rand_like(p))
    return d


def inputs(d: Drafter, b: int = 2, t: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, d.config.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, d.config.fc_in_features, generator=g)
    return ids, aux


def naive_attention(q, k, v, layer_idx):
    """Explicit softmax(QK^T/sqrt(d) + causal) V with grouped-query heads, no SDPA."""
    rep = q.shape[1] // k.shape[1]
    k = torch.cat([k[:, i : i + 1].expand(-1, rep, -1, -1) for i in range(k.shape[1])], dim=1)
    v = torch.cat([v[:, i : i + 1].expand(-1, rep, -1, -1) for i in range(v.shape[1])], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    tq, tk = q.shape[2], k.shape[2]
    allowed = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


# ------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("layers", [1, 2])
def test_shapes_and_modules(layers):
    d = small_drafter(num_hidden_layers=layers)
    c = d.config
    assert d.fc.weight.shape == (c.hidden_size, 3 * c.target_hidden_size) and d.fc.bias is None
    mid = d.layers[0]
    assert mid.self_attn.q_proj.weight.shape == (4 * 8, 2 * 32)
    assert mid.self_attn.k_proj.weight.shape == (2 * 8, 2 * 32)
    assert mid.hidden_norm.weight.shape == mid.input_layernorm.weight.shape == (32,)
    assert len(d.layers) == layers
    if layers > 1:
        assert d.layers[1].self_attn.q_proj.weight.shape == (32, 32)
    assert d.lm_head.weight.shape == (40, 32)
    assert d.d2t.dtype == torch.int64 and d.d2t.shape == (40,)
    assert d.t2d.dtype == torch.bool and d.t2d.shape == (100,)
    ids, aux = inputs(d)
    h = d(ids, d.fuse(aux))
    assert h.shape == (2, 9, 32)
    assert d.compute_logits(h).shape == (2, 9, 40)
    # the embedding is frozen and in neither parameters() nor state_dict()
    assert d.embed_tokens is not None and not d.embed_tokens.weight.requires_grad
    assert all(p is not d.embed_tokens.weight for p in d.parameters())
    assert "embed_tokens.weight" not in d.state_dict()
    # gradients reach every parameter
    d.compute_logits(h).sum().backward()
    assert all(p.grad is not None for p in d.parameters())


def test_target_hidden_size_differs():
    d = small_drafter(target_hidden_size=48)
    ids, aux = inputs(d)
    assert aux.shape[-1] == 3 * 48
    assert d(ids, d.fuse(aux)).shape == (2, 9, 32)


def test_default_attention_equals_naive_reference():
    d = small_drafter(num_hidden_layers=2)
    ids, aux = inputs(d)
    pos = torch.arange(3, 12).expand(2, -1)
    with torch.no_grad():
        a = d(ids, d.fuse(aux), pos)
        b = d(ids, d.fuse(aux), pos, attn_fn=naive_attention)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attn_fn_receives_layer_index_and_shapes():
    d = small_drafter(num_hidden_layers=2)
    ids, aux = inputs(d, t=5)
    seen = []

    def spy(q, k, v, layer_idx):
        seen.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return naive_attention(q, k, v, layer_idx)

    d(ids, d.fuse(aux), attn_fn=spy)
    assert seen == [(0, (2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), (1, (2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8))]


def test_kv_cache_attn_fn_matches_full_forward():
    """How decoding reuses the layer: an attn_fn that appends to a per-layer cache gives, step by step,
    the same output as one forward over the whole sequence."""
    d = small_drafter(num_hidden_layers=2)
    ids, aux = inputs(d, b=1, t=6)
    with torch.no_grad():
        hid = d.fuse(aux)
        full = d(ids, hid)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def cached(q, k, v, layer_idx):
            if layer_idx in cache:
                k = torch.cat([cache[layer_idx][0], k], dim=2)
                v = torch.cat([cache[layer_idx][1], v], dim=2)
            cache[layer_idx] = (k, v)
            return F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(2, 1),
                v.repeat_interleave(2, 1),
                attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]),
            )

        first = d(ids[:, :4], hid[:, :4], torch.arange(4)[None], attn_fn=cached)
        rest = [d(ids[:, i : i + 1], hid[:, i : i + 1], torch.tensor([[i]]), attn_fn=cached) for i in (4, 5)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, rtol=1e-5, atol=1e-5)


def test_positions_matter_and_1d_positions_accepted():
    d = small_drafter()
    ids, aux = inputs(d, b=1)
    with torch.no_grad():
        a = d(ids, d.fuse(aux))
        b = d(ids, d.fuse(aux), torch.arange(9))
        c = d(ids, d.fuse(aux), torch.arange(9)[None] + 5)  # RoPE is relative: a uniform shift is invisible
        e = d(ids, d.fuse(aux), torch.arange(9)[None] * 2)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_computed_rope(dtype):
    """The decoder indexes `rope_table` rows instead of recomputing RoPE per step: bit-identical outputs."""
    d = small_drafter().to(dtype)
    ids, aux = inputs(d, b=1)
    pos = torch.tensor([[3, 4, 5, 9, 17, 18, 19, 20, 40]])
    cos, sin = d.rope_table(64, torch.device("cpu"), dtype)
    with torch.no_grad():
        h = d.fuse(aux.to(dtype))
        a = d(ids, h, pos)
        b = d(ids, h, pos, rope=(cos[pos[0]][None], sin[pos[0]][None]))
    assert torch.equal(a, b)


def _reference_forward(d: Drafter, ids, hidden, pos):
    """Independent re-statement of docs/eagle3.md#the-drafter with transformers' own Llama RoPE / RMSNorm."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    c = d.config
    hf = LlamaConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        head_dim=c.head_dim,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )
    cos, sin = LlamaRotaryEmbedding(hf)(hidden, pos)

    def norm(mod, x):
        n = LlamaRMSNorm(x.shape[-1], eps=c.rms_norm_eps)
        n.weight.data.copy_(mod.weight)
        return n(x)

    m = d.layers[0]
    e = d.embed_tokens.weight[ids]
    x = torch.cat([norm(m.input_layernorm, e), norm(m.hidden_norm, hidden)], -1)
    a = m.self_attn
    b, t, _ = x.shape
    q = a.q_proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)
    k = a.k_proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(b, t, -1, c.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = naive_attention(q, k, v, 0).transpose(1, 2).reshape(b, t, -1)
    r = hidden + a.o_proj(o)
    out = r + m.mlp.down_proj(
        F.silu(m.mlp.gate_proj(norm(m.post_attention_layernorm, r)))
        * m.mlp.up_proj(norm(m.post_attention_layernorm, r))
    )
    return out, d.lm_head(norm(d.norm, out))


def test_matches_independent_reference_with_hf_rope():
    d = small_drafter()
    ids, aux = inputs(d)
    pos = torch.arange(7, 16).expand(2, -1)
    with torch.no_grad():
        hid = d.fuse(aux)
        out = d(ids, hid, pos)
        ref_out, ref_logits = _reference_forward(d, ids, hid, pos)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.compute_logits(out), ref_logits, rtol=1e-5, atol=1e-5)


def test_norm_before_residual_changes_residual_only():
    d = small_drafter()
    d2 = small_drafter(norm_before_residual=True)
    d2.load_state_dict(d.state_dict())
    ids, aux = inputs(d)
    with torch.no_grad():
        hid = d.fuse(aux)
        a, b = d(ids, hid), d2(ids, hid)
        assert not torch.allclose(a, b)
        # the difference is exactly the residual branch: hidden vs hidden_norm(hidden)
        m = d.layers[0]
        e = m.input_layernorm(d.embed_tokens(ids))
        attn = m.self_attn(
            torch.cat([e, m.hidden_norm(hid)], -1), *_cos_sin(d, torch.arange(9).expand(2, -1)), naive_attention
        )
        r = m.hidden_norm(hid) + attn
        torch.testing.assert_close(b, r + m.mlp(m.post_attention_layernorm(r)), rtol=1e-5, atol=1e-5)


def _cos_sin(d, pos):
    from draftsmith.drafter.model import rope_cos_sin

    return rope_cos_sin(d._inv_freq, pos, torch.float32)


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = small_config(
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=500000.0,
        max_position_embeddings=512,
        rope_scaling=scaling,
    )
    hf = LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    torch.testing.assert_close(rope_inv_freq(cfg), ref.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_refused():
    with pytest.raises(DraftsmithError, match="rope_scaling"):
        small_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_bf16_cast_keeps_buffers():
    d = small_drafter().to(torch.bfloat16)
    assert d.d2t.dtype == torch.int64 and d.t2d.dtype == torch.bool
    assert d._inv_freq.dtype == torch.float32
    ids, aux = inputs(d)
    assert d.compute_logits(d(ids, d.fuse(aux.bfloat16()))).dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------- vocab
def test_build_draft_vocab_invariants():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 3, 5, 2])
    d2t, t2d = build_draft_vocab(counts, 5)
    target_ids = d2t + torch.arange(5)
    # the 5 most frequent: 9 (ids 2, 5), then 5 (ids 0, 3, 8): ties by lower id
    assert target_ids.tolist() == [0, 2, 3, 5, 8]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.sum() == 5 and t2d.nonzero().flatten().tolist() == target_ids.tolist()
    assert (d2t[1:] >= d2t[:-1]).all() and d2t[0] >= 0
    # ties beyond the cut: lower id wins
    d2t, _ = build_draft_vocab(counts, 4)
    assert (d2t + torch.arange(4)).tolist() == [0, 2, 3, 5]
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        build_draft_vocab(counts, 11)


def test_draft_to_target_and_set_vocab():
    d = small_drafter()
    counts = torch.arange(100).flip(0)  # id 0 most frequent
    counts[97] = 1000
    d2t, t2d = build_draft_vocab(counts, 40)
    d.set_draft_vocab(d2t)
    assert torch.equal(d.t2d, t2d)
    tids = d.draft_to_target(torch.arange(40))
    assert tids.tolist() == list(range(39)) + [97]
    assert d.t2d[tids].all() and int(d.t2d.sum()) == 40
    with pytest.raises(DraftsmithError, match="d2t"):
        d.set_draft_vocab(torch.full((40,), 99))


# ------------------------------------------------------------------------------------------- io
def test_save_load_round_trip(tmp_path):
    d = small_drafter(num_hidden_layers=2, norm_before_residual=True)
    d.set_draft_vocab(*build_draft_vocab(torch.randint(0, 50, (100,)), 40))
    out = d.save_pretrained(tmp_path / "dr")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any("embed" in k for k in keys)
    assert {"fc.weight", "d2t", "t2d", "lm_head.weight", "norm.weight", "layers.1.input_layernorm.weight"} <= keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["aux_layer_ids"] == [0, 2, 3] and cfg["aux_layer_ids_convention"] == "layer-output"
    d2 = Drafter.from_pretrained(out)
    assert d2.embed_tokens is None
    d2.set_embedding(d.embed_tokens.weight)
    assert d2.config == d.config
    ids, aux = inputs(d)
    with torch.no_grad():
        assert torch.equal(d.compute_logits(d(ids, d.fuse(aux))), d2.compute_logits(d2(ids, d2.fuse(aux))))
    assert torch.equal(d2.d2t, d.d2t) and torch.equal(d2.t2d, d.t2d)
    with pytest.raises(DraftsmithError, match="embedding"):
        Drafter.from_pretrained(out)(ids, aux[..., :32])


def test_save_bf16_and_no_tmp_files_left(tmp_path):
    d = small_drafter()
    d.save_pretrained(tmp_path, dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    d2 = Drafter.from_pretrained(tmp_path)
    assert d2.fc.weight.dtype == torch.bfloat16 and d2.d2t.dtype == torch.int64


def test_bad_checkpoints_are_clear_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="not a directory"):
        Drafter.from_pretrained(tmp_path / "nope")
    d = small_drafter()
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="shape"):
        Drafter.from_pretrained(tmp_path)
    cfg["hidden_size"] = 32
    cfg["bogus"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftsmithError, match="bogus"):
        Drafter.from_pretrained(tmp_path)


def test_config_validation():
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):
        small_config(draft_vocab_size=101)
    with pytest.raises(DraftsmithError, match="aux_layer_ids"):
        small_config(aux_layer_ids=[0, 2, 5])  # target has 5 layers: 0..4
    with pytest.raises(DraftsmithError, match="num_key_value_heads"):
        small_config(num_key_value_heads=3)
    c = small_config()
    assert c.aux_hidden_states_ids == [1, 3, 4]


# ------------------------------------------------------------------------------------------- target
@needs_tiny
def test_from_target_pycode_tiny(tmp_path):
    from safetensors.torch import load_file

    counts = torch.zeros(16384, dtype=torch.long)
    counts[torch.arange(100, 16384, 7)] = 3
    counts[5000] = 10
    d = Drafter.from_target(TINY, token_counts=counts, draft_vocab_size=500)
    c = d.config
    assert (c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        192,
        192,
        3,
        1,
        64,
    )
    assert (c.intermediate_size, c.vocab_size, c.draft_vocab_size, c.target_num_layers) == (512, 16384, 500, 6)
    assert c.aux_layer_ids == [1, 2, 3]  # distinct: EAGLE-3 [1, N//2-1, N-4] collides for N=6 (layer-output ids)
    assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-5 and c.target_model_type == "llama"
    w = load_file(str(TINY / "model.safetensors"))
    emb = w["model.embed_tokens.weight"].float()
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()  # tied on this target
    assert torch.equal(d.embed_tokens.weight.float(), emb)
    tids = d.draft_target_ids
    assert 5000 in tids.tolist() and int(d.t2d.sum()) == 500
    assert torch.equal(d.lm_head.weight, head[tids])
    # random aux: shape check + loads back with the target attached
    ids = torch.randint(0, 16384, (1, 6))
    aux = torch.randn(1, 6, 3 * 192)
    with torch.no_grad():
        logits = d.compute_logits(d(ids, d.fuse(aux)))
    d.save_pretrained(tmp_path)
    d2 = Drafter.from_pretrained(tmp_path, target=TINY)
    with torch.no_grad():
        assert torch.equal(logits, d2.compute_logits(d2(ids, d2.fuse(aux))))


@needs_tiny
def test_from_target_overrides_and_fit_refusal(tmp_path):
    d = Drafter.from_target(TINY, draft_vocab_size=64, aux_layer_ids=[0, 3], num_hidden_layers=2)
    assert d.config.num_aux == 2 and d.fc.in_features == 2 * 192 and len(d.layers) == 2
    assert d.draft_target_ids.tolist() == list(range(64))  # identity vocab without counts
    with pytest.raises(DraftsmithError, match="aux_layer_ids"):
        Drafter.from_target(TINY, aux_layer_ids=[1, 2, 6])
    # a drafter for another vocab does not fit
    other = small_drafter()
    other.save_pretrained(tmp_path)
    with pytest.raises(DraftsmithError, match="vocab_size"):
        Drafter.from_pretrained(tmp_path, target=TINY)
    assert any("target_hidden_size" in p for p in other.fit_problems(TINY))


@needs_tiny
def test_from_target_accepts_a_loaded_target():
    load_target = pytest.importorskip("draftsmith.target_model").load_target
    t = load_target(str(TINY))
    d = Drafter.from_target(t, draft_vocab_size=300)
    assert d.config.target_num_layers == t.num_layers and d.config.vocab_size == 16384
    head = t.lm_head.weight.detach().float()
    assert torch.equal(d.lm_head.weight, head[:300])
    assert d.embed_tokens.weight.data_ptr() == t.embed_tokens.weight.data_ptr()  # shared, not copied
    assert d.fit_problems(t) == []


@pytest.mark.parametrize("layers,bias", [(1, False), (2, True)])
def test_fused_decoding_view_matches_the_drafter(layers, bias):
    """decode's fused view (q/k/v and gate/up concatenated, q and k rotated together) computes the same draft
    step as the training module, and leaves that module untouched."""
    from draftsmith.decode.fused_drafter import fused_for_decoding
    from draftsmith.drafter import Drafter, DrafterConfig

    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        draft_vocab_size=100,
        target_hidden_size=48,
        num_hidden_layers=layers,
        attention_bias=bias,
        mlp_bias=bias,
    )
    d = Drafter(cfg)
    d.set_embedding(torch.randn(300, 64))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.1)
    d.eval()
    before = {k: v.clone() for k, v in d.state_dict().items()}
    f = fused_for_decoding(d)
    ids = torch.randint(0, 300, (1, 9))
    hidden = torch.randn(1, 9, 64)
    with torch.no_grad():
        want = d(ids, hidden)
        got = f(ids, hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in d.state_dict().items())
    assert type(d.layers[0].self_attn).__name__ == "Attention" and type(f.layers[0].self_attn).__name__ != "Attention"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hf_rms_norm_is_the_spelled_out_norm(dtype):
    """`hf_rms_norm` (F.rms_norm: one fused kernel on CUDA) == HF LlamaRMSNorm's spelled-out arithmetic, bit for
    bit on CPU: fp32 normalisation, cast back, then the weight."""
    from draftsmith.drafter.model import hf_rms_norm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 384, generator=g) * 3).to(dtype)
    w = torch.randn(384, generator=g).to(dtype)
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(hf_rms_norm(x, w, 1e-5), want)
