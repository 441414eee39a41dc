"""The compile-cache warmer's child process (`draftsmith.train.warmup`): it rebuilds the trainer's model and first
inputs from a spec (same names, shapes, strides, dtypes and flags: the same graphs, so the same cache keys), runs
them, and reports ready or one failure line; the trainer's side of the switch is tested in test_train_loop.py."""

from __future__ import annotations

import pytest
import torch
from test_train_ttt import _random_row, _tiny_drafter

from draftsmith.train.ttt import positions_from_doc_ids
from draftsmith.train.warmup import CacheWarmer, build_from_spec, tensor_meta, warm_spec


def _model_and_inputs(freeze_head=False):
    from types import SimpleNamespace

    from draftsmith.train.trainer import TTTModel

    torch.manual_seed(0)
    drafter = _tiny_drafter(2).float()
    drafter.set_embedding(torch.randn(50, 32, dtype=torch.bfloat16))  # the target's dtype, not the drafter's
    if freeze_head:
        drafter.lm_head.weight.requires_grad_(False)
    cfg = SimpleNamespace(ttt_steps=3, step_weight=0.8, attn_backend="chunked", attn_chunk=0, loss_chunk=64)
    ids, aux, doc, lmask, teacher = _random_row(drafter, [40, 60, 28], 128, mask_p=0.2)
    aux = aux.transpose(1, 2).contiguous().transpose(1, 2)  # not contiguous: its strides must travel too
    inputs = (ids, aux, doc, positions_from_doc_ids(doc), lmask, teacher.probs, teacher.argmax, teacher.in_vocab)
    return TTTModel(drafter, cfg), inputs


@pytest.mark.parametrize("freeze_head", [False, True])
def test_spec_rebuilds_the_same_model_and_inputs(freeze_head):
    model, inputs = _model_and_inputs(freeze_head)
    spec = warm_spec(model, inputs, None, torch.device("cpu"), "eager", "unroll", False, None)
    got, got_inputs = build_from_spec(spec, torch.device("cpu"))
    want_d, got_d = model.drafter, got.drafter

    def meta(named):
        return {n: tensor_meta(t) for n, t in named}

    assert meta(got_d.named_parameters()) == meta(want_d.named_parameters())
    assert meta(got_d.named_buffers()) == meta(want_d.named_buffers())  # embed_tokens.weight included
    assert got_d.config == want_d.config
    assert [tensor_meta(t) for t in got_inputs] == [tensor_meta(t) for t in inputs]
    assert (got.ttt_steps, got.step_weight, got.loss_chunk) == (3, 0.8, 64)
    loss, stats = got(*got_inputs)  # the placeholders are valid inputs: a finite loss and a backward
    loss.backward()
    assert torch.isfinite(loss) and got_d.fc.weight.grad is not None


@pytest.mark.slow
def test_child_process_reports_ready_or_one_failure_line(tmp_path):
    model, inputs = _model_and_inputs()
    spec = warm_spec(model, inputs, None, torch.device("cpu"), "eager", "unroll", True, None)
    ok = CacheWarmer(spec, tmp_path / "ok.log")
    assert ok.wait(180) == "ready", (tmp_path / "ok.log").read_text()
    assert ok.error is None and ok.seconds > 0
    spec["inputs"][1]["shape"][-1] = 95  # aux of the wrong width: the child's forward fails
    bad = CacheWarmer(spec, tmp_path / "bad.log")
    assert bad.wait(180) == "failed"
    assert bad.error.startswith("exit code 1: RuntimeError") and "\n" not in bad.error, bad.error
    assert str(tmp_path / "bad.log") in bad.error
    bad.close()
    ok.close()
