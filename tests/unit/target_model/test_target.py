"""Hook capture equals HF `output_hidden_states` at the right indices, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.capture import AuxCapture
from draftsmith.target_model import load_target, target_from_model
from draftsmith.target_model.layers import (
    default_aux_hidden_states_ids,
    default_aux_layers,
    from_hidden_states_ids,
    parse_layer_list,
    to_hidden_states_ids,
    validate_aux_layers,
)
from tests.tiny_models import ARCHS


def test_default_layers_match_peers():
    # GUIDE §2: SGLang's inputs of [2, 30, 58] == SpecForge's outputs [1, 29, 57] for a 61-layer model... and
    # for a 32-layer Llama the EAGLE-3 defaults are [1, 15, 28] (layer-output) == [2, 16, 29] (hidden_states).
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_hidden_states_ids(32) == [2, 16, 29]
    assert default_aux_layers(61) == [1, 29, 57]
    assert from_hidden_states_ids(to_hidden_states_ids([1, 15, 28])) == [1, 15, 28]
    assert default_aux_layers(6) == [1, 2, 2]  # pycode-tiny: the defaults collide (documented)
    assert default_aux_layers(2) == [1, 0, 0]


def test_layer_validation_errors():
    with pytest.raises(DraftsmithError, match="out of range"):
        validate_aux_layers([1, 10], 6)
    with pytest.raises(DraftsmithError, match="embedding"):
        from_hidden_states_ids([0, 3])
    with pytest.raises(DraftsmithError, match="integers"):
        parse_layer_list("1,a")
    assert parse_layer_list("[1, 4,7]") == [1, 4, 7]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_capture_matches_output_hidden_states(arch):
    model = ARCHS[arch]()
    target = target_from_model(model)
    n = target.num_layers
    aux = [0, 2, n - 2, 2]  # any count, duplicates allowed
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        cap = AuxCapture(target, aux)
        with cap:
            out = target.decoder(input_ids=ids, use_cache=False)
    hs = ref.hidden_states
    assert len(hs) == n + 1
    H = target.hidden_size
    for slot, lid in enumerate(aux):
        # layer-output id k == hidden_states index k+1 (bitwise: same tensor, copied)
        torch.testing.assert_close(cap.aux[..., slot * H : (slot + 1) * H], hs[lid + 1], rtol=0, atol=0)
    # final: the last layer's output BEFORE the final norm; the norm of it is the model's last hidden state
    torch.testing.assert_close(target.final_norm(cap.final), out.last_hidden_state, rtol=1e-6, atol=1e-6)
    if arch != "gpt_oss":  # (HF's last hidden_states entry is post-norm in transformers 5)
        torch.testing.assert_close(hs[-1], out.last_hidden_state)
    # logits from the captured final state equal the model's
    torch.testing.assert_close(target.lm_head(target.final_norm(cap.final)), ref.logits, rtol=1e-5, atol=1e-5)


def test_hooks_are_removed_after_the_block():
    model = ARCHS["llama"]()
    target = target_from_model(model)
    cap = AuxCapture(target, [1])
    with cap:
        pass
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in target.layers)


def test_static_buffers_are_refilled_in_place():
    model = ARCHS["llama"]()
    target = target_from_model(model)
    cap = AuxCapture(target, [1, 3])
    cap.allocate(1, 7, torch.float32, "cpu")
    buf = cap.aux
    ids1, ids2 = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 7))
    with torch.no_grad(), cap:
        target.decoder(input_ids=ids1, use_cache=False)
        first = buf.clone()
        target.decoder(input_ids=ids2, use_cache=False)
    assert cap.aux is buf  # same storage: what a replayed CUDA graph relies on
    ref = model(ids2, output_hidden_states=True).hidden_states
    torch.testing.assert_close(buf[..., :32], ref[2])
    assert not torch.equal(first, buf)
    with pytest.raises(DraftsmithError, match="static buffers"):
        with torch.no_grad(), cap:
            target.decoder(input_ids=torch.randint(0, 128, (1, 5)), use_cache=False)


def test_right_padding_without_mask_is_exact(tiny_path):
    # capture batches are right-padded with no attention mask: real positions must equal unpadded runs
    target = load_target(tiny_path, dtype="fp32")
    a, b = torch.randint(2, 16384, (1, 9)), torch.randint(2, 16384, (1, 5))
    batch = torch.cat([a, torch.cat([b, torch.full((1, 4), 1)], 1)], 0)
    cap = AuxCapture(target, [1, 3])
    with torch.no_grad(), cap:
        target.decoder(input_ids=batch, use_cache=False)
        batched = cap.aux.clone()
        target.decoder(input_ids=b, use_cache=False)
    torch.testing.assert_close(batched[1, :5], cap.aux[0], rtol=1e-5, atol=1e-5)


def test_load_target_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="not found"):
        load_target(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DraftsmithError, match="config.json"):
        load_target(tmp_path)


def test_inspect_target_both_conventions(tiny_path):
    from draftsmith.target_model.inspect import format_target_info, inspect_target

    info = inspect_target(tiny_path)
    assert info["num_layers"] == 6 and info["hidden_size"] == 192 and info["vocab_size"] == 16384
    assert info["default_aux_layers"] == {"layer-output ids": [1, 2, 2], "hidden_states ids": [2, 3, 3]}
    text = format_target_info(info)
    assert "layer-output ids" in text and "hidden_states ids" in text
