"""Hook capture equals HF `output_hidden_states` at the right indices, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from draftsmith.capture import AuxCapture
from draftsmith.common.errors import DraftsmithError
from draftsmith.target_model import load_target, target_from_model
from draftsmith.target_model.layers import (
    default_aux_hidden_states_ids,
    default_aux_layers,
    engine_default_aux_layers,
    from_hidden_states_ids,
    parse_layer_list,
    repeated_aux_problem,
    to_hidden_states_ids,
    to_layer_output_ids,
    validate_aux_layers,
)
from tests.tiny_models import ARCHS


def test_default_layers_match_peers():
    # docs/eagle3.md#layer-ids: SGLang's inputs of [2, 30, 58] == SpecForge's outputs [1, 29, 57] for a 61-layer model... and
    # for a 32-layer Llama the EAGLE-3 defaults are [1, 15, 28] (layer-output) == [2, 16, 29] (hidden_states).
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_hidden_states_ids(32) == [2, 16, 29]
    assert default_aux_layers(61) == [1, 29, 57]
    assert from_hidden_states_ids(to_hidden_states_ids([1, 15, 28])) == [1, 15, 28]
    assert default_aux_layers(6) == [1, 2, 3]  # pycode-tiny: EAGLE-3's [1, 2, 2] collides; distinct instead
    assert engine_default_aux_layers(6) == [1, 2, 2]  # what engines assume for a checkpoint naming none


def test_default_aux_layers_distinct_wherever_possible():
    """Issue #14 item 12: repeated ids cannot be served (SGLang captures by membership, vLLM de-duplicates), and
    SGLang cannot capture the last layer's output; the defaults avoid both wherever the target has the layers."""
    assert {n: default_aux_layers(n) for n in range(1, 8)} == {
        1: [0, 0, 0],
        2: [0, 1, 1],
        3: [0, 1, 2],
        4: [0, 1, 2],
        5: [1, 2, 3],
        6: [1, 2, 3],
        7: [1, 2, 3],
    }
    for n in range(3, 200):
        ids = default_aux_layers(n)
        assert len(set(ids)) == 3 and ids == sorted(ids) and 0 <= ids[0] and ids[-1] <= n - 1, n
        if n >= 4:
            assert ids[-1] <= n - 2, n  # never the last layer when there is a choice
        if n >= 7:
            assert ids == engine_default_aux_layers(n), n  # = the engines' own default: nothing to configure
    assert repeated_aux_problem([1, 2, 3]) is None and repeated_aux_problem(None) is None
    why = repeated_aux_problem([1, 2, 2])
    assert "membership" in why and "de-duplicates" in why and "\n" not in why


def test_layer_validation_errors():
    with pytest.raises(DraftsmithError, match="out of range"):
        validate_aux_layers([1, 10], 6)
    with pytest.raises(DraftsmithError, match="embedding"):
        from_hidden_states_ids([0, 3])
    # the unchecked inverse reports what a file names, the embedding output included (doctor shows it as -1)
    assert to_layer_output_ids([0, 3, "17"]) == [-1, 2, 16]
    assert to_hidden_states_ids(to_layer_output_ids([2, 16, 29])) == [2, 16, 29]
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
    from draftsmith.target_model.facts import target_facts

    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(DraftsmithError, match="JSON object"):
        target_facts(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": "wide", "num_attention_heads": 2}')
    with pytest.raises(DraftsmithError, match="not a positive number"):
        target_facts(tmp_path)


def test_inspect_target_both_conventions(tiny_path):
    from draftsmith.target_model.inspect import format_target_info, inspect_target

    info = inspect_target(tiny_path)
    assert info["num_layers"] == 6 and info["hidden_size"] == 192 and info["vocab_size"] == 16384
    assert info["default_aux_layers"] == {"layer-output ids": [1, 2, 3], "hidden_states ids": [2, 3, 4]}
    assert info["distinct_aux_layers"] and info["weights_problems"] == []
    text = format_target_info(info)
    assert "layer-output ids" in text and "hidden_states ids" in text


# ------------------------------------------------------------------------------------- remote code, damaged weights
def _target_copy(tmp_path, name, weights=True):
    import shutil

    from tests.conftest import TINY

    d = tmp_path / name
    d.mkdir()
    for f in TINY.iterdir():
        if f.name != "model.safetensors" or weights:
            shutil.copy(f, d / f.name)
    return d


def _remote_code_target(tmp_path):
    """A model dir whose config maps AutoConfig/AutoModel to a .py file that writes a marker when imported."""
    import json

    d = _target_copy(tmp_path, "remote")
    marker = tmp_path / "REMOTE_CODE_RAN"
    c = json.loads((d / "config.json").read_text())
    c.update(
        model_type="remote_llama",
        auto_map={"AutoConfig": "remote_llama.RemoteConfig", "AutoModelForCausalLM": "remote_llama.RemoteModel"},
    )
    (d / "config.json").write_text(json.dumps(c))
    (d / "remote_llama.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class RemoteConfig(LlamaConfig):\n    model_type = 'remote_llama'\n"
        "class RemoteModel(LlamaForCausalLM):\n    config_class = RemoteConfig\n"
    )
    return d, marker


def test_remote_code_never_runs_without_opt_in(tmp_path, monkeypatch):
    """Issue #14 item 9: `echo y | draftsmith inspect DIR` used to run the directory's code."""
    import subprocess
    import sys

    from draftsmith.target_model.inspect import inspect_target

    monkeypatch.delenv("DRAFTSMITH_TRUST_REMOTE_CODE", raising=False)
    d, marker = _remote_code_target(tmp_path)
    for load in (lambda: load_target(d), lambda: inspect_target(d)):
        with pytest.raises(DraftsmithError, match="trust-remote-code"):
            load()
    assert not marker.exists()
    env = {**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    env.pop("DRAFTSMITH_TRUST_REMOTE_CODE", None)
    cmd = [sys.executable, "-m", "draftsmith", "inspect", str(d)]
    r = subprocess.run(cmd, input="y\ny\n", capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 2 and not marker.exists(), r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--trust-remote-code" in r.stderr  # one line, no prompt


def test_trust_remote_code_opt_in_reaches_transformers(tmp_path, monkeypatch):
    """--trust-remote-code (a scope) and DRAFTSMITH_TRUST_REMOTE_CODE=1 pass trust_remote_code=True; default False."""
    import transformers

    from draftsmith.target_model.inspect import inspect_target
    from draftsmith.target_model.load import trust_remote_code_scope

    seen = []

    class Stop(Exception):
        pass

    def fake_from_pretrained(*args, **kwargs):
        seen.append(kwargs.get("trust_remote_code"))
        raise Stop

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake_from_pretrained)
    monkeypatch.delenv("DRAFTSMITH_TRUST_REMOTE_CODE", raising=False)
    d = _target_copy(tmp_path, "t", weights=False)
    for load in (lambda: load_target(d), lambda: inspect_target(d)):
        with pytest.raises(Stop):
            load()
        with trust_remote_code_scope(True), pytest.raises(Stop):
            load()
        monkeypatch.setenv("DRAFTSMITH_TRUST_REMOTE_CODE", "1")
        with pytest.raises(Stop):
            load()
        monkeypatch.delenv("DRAFTSMITH_TRUST_REMOTE_CODE")
    assert seen == [False, True, True] * 2


def test_damaged_target_weights_are_one_line_errors(tmp_path):
    import os

    import torch
    from safetensors.torch import load_file

    from draftsmith.target_model.facts import target_tensors, target_weight_problems
    from tests.conftest import TINY

    data = (TINY / "model.safetensors").read_bytes()
    trunc = _target_copy(tmp_path, "trunc", weights=False)
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    missing = _target_copy(tmp_path, "missing", weights=False)
    pickled = _target_copy(tmp_path, "pickled", weights=False)
    marker = tmp_path / "PICKLE_RAN"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    sd = load_file(str(TINY / "model.safetensors"))
    sd["payload"] = Payload()
    torch.save(sd, pickled / "pytorch_model.bin")
    cases = [(trunc, "truncated or corrupted"), (missing, "no weights found"), (pickled, "pickle")]
    for path, why in cases:
        for load in (load_target, target_tensors):
            with pytest.raises(DraftsmithError, match=why) as e:
                load(path)
            assert "\n" not in str(e.value) and str(path) in str(e.value)
    assert not marker.exists()
    assert "truncated or corrupted" in " ".join(target_weight_problems(trunc))
