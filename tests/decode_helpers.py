"""Helpers for decode tests and demos: tiny random targets, a quick overfit drafter, sequential references.

Not used by the engine itself. `overfit_drafter` trains only the drafter's step 0 (target aux at i +
token i+1 -> token i+2) on the target's own greedy outputs: a few seconds on CPU and enough to make
acceptance measurable (τ on those prompts well above a random drafter's 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def tiny_qwen3(
    vocab_size: int = 96, seed: int = 0, init: float = 0.3, layers: int = 4, hidden: int = 64, dtype=torch.float32
):
    """A small random Qwen3 (q/k norm) with peaky logits (large init) so greedy has no near-ties."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model


def tiny_llama(
    vocab_size: int = 8,
    seed: int = 0,
    init: float = 0.5,
    layers: int = 2,
    hidden: int = 32,
    attention_bias: bool = False,
    model_type: str = "llama",
    dtype=torch.float32,
):
    """A small random Llama (or Qwen2 with qkv bias, or Mistral) for forward and sampling tests."""
    torch.manual_seed(seed)
    if model_type == "qwen2":
        from transformers import Qwen2Config as Cfg
        from transformers import Qwen2ForCausalLM as M

        extra = {}
    elif model_type == "mistral":
        from transformers import MistralConfig as Cfg
        from transformers import MistralForCausalLM as M

        extra = {"sliding_window": None}
    else:
        from transformers import LlamaConfig as Cfg
        from transformers import LlamaForCausalLM as M

        extra = {"attention_bias": attention_bias}
    cfg = Cfg(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=init,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    model = M(cfg).to(dtype).eval()
    model.requires_grad_(False)
    return model


def tree_mask(parents: Sequence[int], S: int, ctx: int) -> torch.Tensor:
    """A tree verify's mask [T, S] for T = len(parents) nodes at slots ctx..ctx+T-1: every row sees the context
    (slots < ctx), itself and its ancestors (parents[i] < i, -1 = a child of the committed context); the slots past
    ctx + T are the cache's unused tail."""
    T = len(parents)
    m = torch.zeros(T, S, dtype=torch.bool)
    m[:, :ctx] = True
    for t in range(T):
        a = t
        while a >= 0:
            m[t, ctx + a] = True
            a = parents[a]
    return m


def random_drafter(model, seed: int = 0, **overrides):
    """An untrained draftsmith Drafter for an in-memory HF model (target embedding attached)."""
    from draftsmith.drafter import Drafter, DrafterConfig
    from draftsmith.target_model.layers import default_aux_layers

    cfg = model.config
    torch.manual_seed(seed)
    H = int(cfg.hidden_size)
    nh = int(cfg.num_attention_heads)
    fields = dict(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=int(getattr(cfg, "intermediate_size", None) or 4 * H),
        num_attention_heads=nh,
        num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or nh),
        head_dim=int(getattr(cfg, "head_dim", None) or H // nh),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
        vocab_size=int(cfg.vocab_size),
        draft_vocab_size=int(cfg.vocab_size),
        num_hidden_layers=1,
        aux_layer_ids=default_aux_layers(int(cfg.num_hidden_layers)),
        target_num_layers=int(cfg.num_hidden_layers),
    )
    fields.update(overrides)
    d = Drafter(DrafterConfig(**fields))
    d.set_embedding(model.get_input_embeddings().weight)
    d.eval()
    return d


@torch.no_grad()
def target_aux(engine, seq: Sequence[int]):
    """Target aux states [T, k*H] and logits [T, V] over a full sequence (prefill-style, fresh cache)."""
    from draftsmith.decode.engine import causal_mask

    dev = engine.device
    ids = torch.tensor(list(seq), dtype=torch.long, device=dev)
    pos = torch.arange(len(seq), device=dev)
    logits, aux = engine.runner.forward(ids, pos, pos, causal_mask(engine.max_len, pos, dev))
    return aux, logits


def overfit_drafter(
    engine, drafter, sequences: Sequence[Sequence[int]], steps: int = 100, lr: float = 3e-3, seed: int = 0
) -> float:
    """Train the drafter's step 0 on target aux states of `sequences` (the target's own outputs), as one
    right-padded batch (causal attention keeps padding out of real positions). Returns the last loss."""
    torch.manual_seed(seed)
    rows = []
    for seq in sequences:
        aux, _ = target_aux(engine, seq)
        rows.append((aux.detach().float().cpu(), torch.tensor(list(seq), dtype=torch.long)))
    T = max(len(ids) for _, ids in rows) - 2
    B = len(rows)
    kH = rows[0][0].shape[-1]
    inp = torch.zeros(B, T, dtype=torch.long)
    hid = torch.zeros(B, T, kH)
    lab = torch.full((B, T), -100, dtype=torch.long)
    n_d = drafter.lm_head.out_features
    t2d = torch.full((int(drafter.config.vocab_size),), -100, dtype=torch.long)
    t2d[drafter.draft_target_ids.cpu()] = torch.arange(n_d)
    for b, (aux, ids) in enumerate(rows):
        n = len(ids) - 2
        if n <= 0:
            continue
        inp[b, :n], hid[b, :n], lab[b, :n] = ids[1:-1], aux[:-2], t2d[ids[2:]]
    dev = next(drafter.parameters()).device
    inp, hid, lab = inp.to(dev), hid.to(dev), lab.to(dev)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    drafter.train()
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        logits = drafter.compute_logits(drafter(inp, drafter.fuse(hid)))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), lab.reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
    drafter.eval()
    return float(loss.detach())


@torch.no_grad()
def reference_chain_drafts(engine, drafter, seq: Sequence[int], K: int) -> list[int]:
    """Chain draft tokens after committed `seq` (whose last token is the pending root), recomputed from
    scratch without any cache: target aux over seq[:-1], drafter prefill, then K-1 steps each re-running
    the drafter causally over the whole extended input (its default attention)."""
    aux, _ = target_aux(engine, seq[:-1])
    ids = torch.tensor(list(seq[1:]), dtype=torch.long, device=engine.device)
    hidden = drafter.fuse(aux.to(next(drafter.parameters()).dtype))
    out = drafter(ids[None], hidden[None])[0]
    drafts = []
    for _ in range(K):
        d = int(torch.argmax(drafter.compute_logits(out[-1]).float()))
        t = int(drafter.draft_to_target(torch.tensor(d, device=engine.device)))
        drafts.append(t)
        ids = torch.cat([ids, torch.tensor([t], device=engine.device)])
        hidden = torch.cat([hidden, out[-1:]])
        out = drafter(ids[None], hidden[None])[0]
    return drafts


def overfit_drafter_ttt(
    engine,
    drafter,
    sequences: Sequence[Sequence[int]],
    steps: int = 60,
    lr: float = 3e-3,
    ttt_steps: int = 3,
    seed: int = 0,
) -> float:
    """Like `overfit_drafter`, but through the trainer's TTT unroll (draftsmith.train.ttt), so draft steps
    after the first are trained too (deeper chain/tree acceptance). One packed row of all sequences."""
    from draftsmith.train.ttt import Teacher, document_ids_from_lengths, ttt_unroll

    torch.manual_seed(seed)
    auxs, ids, logits = [], [], []
    for seq in sequences:
        aux, lg = target_aux(engine, seq)
        auxs.append(aux.detach().float().cpu())
        logits.append(lg.detach().float().cpu())
        ids.append(torch.tensor(list(seq), dtype=torch.long))
    dev = next(drafter.parameters()).device
    input_ids = torch.cat(ids)[None].to(dev)
    aux = torch.cat(auxs)[None].to(dev)
    lg = torch.cat(logits)
    d2t = drafter.draft_target_ids.cpu()
    t2d = drafter.t2d.cpu().bool()
    ld = lg[:, d2t]
    teacher = Teacher(
        probs=torch.softmax(ld, -1)[None].to(dev),
        argmax=ld.argmax(-1)[None].to(dev),
        in_vocab=t2d[lg.argmax(-1)][None].to(dev),
    )
    doc_ids = document_ids_from_lengths([len(s) for s in sequences])[None].to(dev)
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    drafter.train()
    loss = torch.zeros(())
    for _ in range(steps):
        opt.zero_grad()
        loss, _stats = ttt_unroll(drafter, input_ids, aux, doc_ids, loss_mask, teacher, ttt_steps=ttt_steps)
        loss.backward()
        opt.step()
    drafter.eval()
    return float(loss.detach())


def assert_tree_verify_matches_torch(configure, device) -> None:
    """A tree-verify-shaped forward (T=7 tokens after a 9-token prefill, a non-causal mask, three logits rows) of a
    compact forward that `configure(f)` sets up (its kernels, its row settings) equals the torch path's: logits, aux
    and both caches."""
    from draftsmith.decode.engine import causal_mask
    from draftsmith.decode.llama import LlamaFamilyForward

    model = tiny_qwen3().to(device)
    n = model.config.num_hidden_layers
    ref, kf = (LlamaFamilyForward.from_hf(model, [0, n - 1], 48) for _ in range(2))
    configure(kf)
    ids = torch.randint(0, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(6)).to(device)
    pos = torch.arange(16, device=device)
    ar = torch.arange(48, device=device)
    node = torch.arange(7, device=device)
    # tree: every node sees the context (0..8) and the even-offset nodes before it
    tree = (ar[None, :] < 9) | (
        (ar[None, :] >= 9) & (ar[None, :] - 9 <= node[:, None]) & ((node[:, None] - (ar[None, :] - 9)) % 2 == 0)
    )
    with torch.no_grad():
        for f in (ref, kf):
            f(ids[:9], pos[:9], pos[:9], causal_mask(48, pos[:9], device))
        rows = torch.tensor([0, 3, 6], device=device)
        (lr, ar_), (lk, ak) = (f(ids[9:], pos[9:], pos[9:], tree, logits_rows=rows) for f in (ref, kf))
    torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ak, ar_, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kf.k_cache, ref.k_cache, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kf.v_cache, ref.v_cache, atol=1e-5, rtol=1e-5)
