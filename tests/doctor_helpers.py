"""Helpers for the doctor tests: a fixture drafter that accepts well on the demo target, and the planted faults.

`train_fixture_drafter` overfits a drafter with the trainer's own TTT unroll (draftsmith.train.ttt) on the doctor's
traces of a few prompts (the target's greedy continuations), so its acceptance there is high and measurable on CPU
in seconds. `plant(kind, clean_dir, out_dir, ...)` writes a copy with one fault, edited the way a wrong export or a
wrong convention would write it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def train_fixture_drafter(
    target,
    traces,
    aux_layers,
    normed_layers=(),
    steps=60,
    lr=3e-3,
    ttt_steps=4,
    draft_vocab_size=2048,
    seed=0,
    token_blind=True,
):
    from draftsmith.drafter import Drafter
    from draftsmith.train.ttt import Teacher, document_ids_from_lengths, ttt_unroll

    torch.manual_seed(seed)
    V = target.vocab_size
    seqs = [tr.input_ids for tr in traces]
    counts = torch.bincount(torch.cat(seqs), minlength=V)
    d = Drafter.from_target(
        target, token_counts=counts, aux_layer_ids=list(aux_layers), draft_vocab_size=draft_vocab_size
    )
    if token_blind:
        # the attention's embedding half zeroed (and kept zero): the drafter can only learn from the aux states,
        # so every mis-wiring of them shows in its acceptance (a few memorized sequences otherwise identify
        # themselves by their tokens alone)
        H = d.config.hidden_size
        attn = d.layers[0].self_attn
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            with torch.no_grad():
                lin.weight[:, :H] = 0
            lin.weight.register_hook(lambda g, H=H: torch.cat([torch.zeros_like(g[:, :H]), g[:, H:]], 1))
    auxs, logits = [], []
    for tr in traces:
        st = tr.layer_states[:, list(aux_layers)].clone()
        for s, lid in enumerate(aux_layers):
            if lid in normed_layers:
                st[:, s] = target.final_norm(st[:, s])
        auxs.append(st.reshape(st.shape[0], -1))
        with torch.no_grad():
            logits.append(target.model(input_ids=tr.input_ids[None]).logits[0].float())
    input_ids = torch.cat(seqs)[None]
    aux = torch.cat(auxs)[None]
    lg = torch.cat(logits)
    cols = d.draft_target_ids
    ld = lg[:, cols]
    teacher = Teacher(
        probs=torch.softmax(ld, -1)[None], argmax=ld.argmax(-1)[None], in_vocab=d.t2d[lg.argmax(-1)][None]
    )
    doc_ids = document_ids_from_lengths([len(s) for s in seqs])[None]
    loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    d.train()
    for _ in range(steps):
        opt.zero_grad()
        loss, _ = ttt_unroll(d, input_ids, aux, doc_ids, loss_mask, teacher, ttt_steps=ttt_steps)
        loss.backward()
        opt.step()
    d.eval()
    return d, float(loss.detach())


PLANTS = (
    "aux_layer_shift",
    "aux_layer_order",
    "final_norm",
    "norm_before_residual",
    "d2t_absolute",
    "draft_vocab",
    "rope",
)


def _edit_native(src: Path, dst: Path, config=None, tensors=None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    if tensors is not None:
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(dst / "model.safetensors"))
    return dst


def plant(kind: str, clean: Path, out: Path, target=None, traces=None) -> Path:
    """A copy of the draftsmith-format drafter `clean` with one fault planted."""
    from draftsmith.drafter import Drafter

    cfg = json.loads((clean / "config.json").read_text())
    ids = list(cfg["aux_layer_ids"])
    H = int(cfg["target_hidden_size"])
    if kind == "aux_layer_shift":
        # a vLLM config written by hand with layer-output ids in its hidden_states-id field (and no nested ids):
        # vLLM reads outputs of layers [i - 1 for i in ids]
        from draftsmith.export.formats import export_drafter

        d = Drafter.from_pretrained(clean, target=target)
        export_drafter(d, out, "vllm")
        c = json.loads((out / "config.json").read_text())
        c["eagle_aux_hidden_state_layer_ids"] = ids
        c.get("eagle_config", {}).pop("eagle_aux_hidden_state_layer_ids", None)
        (out / "config.json").write_text(json.dumps(c, indent=1))
        return out
    if kind == "aux_layer_order":
        # fc's input blocks written in reverse layer order (an export that concatenated aux states the other way)
        def t(sd):
            w = sd["fc.weight"]
            sd["fc.weight"] = torch.cat([w[:, i * H : (i + 1) * H] for i in reversed(range(len(ids)))], 1)

        return _edit_native(clean, out, tensors=t)
    if kind == "final_norm":
        # the drafter as it would be had it been trained on the highest aux layer's state AFTER the target's final
        # norm (as HF output_hidden_states gives the last layer): that block of fc expects norm(h) = h * w / rms(h),
        # so it is rescaled by rms / w (rms: the layer's mean RMS on the traces) -- the same linear map on norm(h)
        slot = len(ids) - 1
        lid = ids[slot]
        states = torch.cat([tr.layer_states[:, lid] for tr in traces])
        rms = float(states.pow(2).mean(-1).sqrt().mean())
        w = target.final_norm.weight.detach().float().cpu()

        def t(sd):
            blk = sd["fc.weight"][:, slot * H : (slot + 1) * H]
            sd["fc.weight"][:, slot * H : (slot + 1) * H] = blk * (rms / w)[None, :]

        return _edit_native(clean, out, tensors=t)
    if kind == "norm_before_residual":
        return _edit_native(clean, out, config=lambda c: c.update(norm_before_residual=not c["norm_before_residual"]))
    if kind == "d2t_absolute":
        # d2t written as absolute target ids (SGLang's hot_token_id) instead of offsets
        def t(sd):
            sd["d2t"] = sd["d2t"] + torch.arange(sd["d2t"].numel())

        return _edit_native(clean, out, tensors=t)
    if kind == "draft_vocab":
        # d2t/t2d of a draft vocab built from another tokenizer's token counts: other ids, same size
        from draftsmith.drafter.vocab import ids_to_mappings

        def t(sd):
            V, n = sd["t2d"].numel(), sd["d2t"].numel()
            g = torch.Generator().manual_seed(1)
            other = torch.sort(torch.randperm(V, generator=g)[:n]).values
            sd["d2t"], sd["t2d"] = ids_to_mappings(other, V)

        return _edit_native(clean, out, tensors=t)
    if kind == "rope":
        # a config that wrote another RoPE base than the target's (and the drafter's training)
        return _edit_native(clean, out, config=lambda c: c.update(rope_theta=100.0))
    raise ValueError(kind)
