"""Capture while serving from the served forwards (`SpeculativeDecoder.set_state_recording`, `ServeRecorder` with an
engine): after a plain, chain or tree generation the engine's state buffer holds, row by row, the target's aux and
final pre-norm states of prompt + response but the last token, equal to a prefill capture (`AuxCapture` on the HF
decoder: what `draftsmith capture` runs) of the same tokens; the store the recorder writes from it equals that
capture within bf16 (fp8) rounding.

Tolerances. fp32 buffer vs capture: atol 2e-4. The recorded rows come from 1-row steps, 4-row chain verifies and
9-row tree verifies through the compact forward; the reference from one prefill through HF's modules: the same ops
with other matmul blockings, so not bitwise equal. Measured on pycode-tiny (states up to ~16 in magnitude, 6 layers):
at most 3.1e-5; a token's row against its neighbour's differs by more than 10. bf16 store vs capture: rtol 2^-7,
atol 1e-4 (both sides round to bf16; a 3e-5 difference can cross a rounding boundary: one bf16 ulp, at most 2^-7 of
the value). fp8: the scale is per (token, layer) row, so one e4m3 step (2^-3 of the row's power-of-two scale).

A random drafter accepts nothing; the drafter here is overfitted (3 TTT steps) on the target's own greedy
continuations, so chain (K=5) and tree (depth 4) rounds accept 3-4 tokens and reject the rest: rejected rows are
rewritten by the next round, accepted tree paths are compacted (asserted below, and a negative control shows a
missing compaction is caught)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from decode_helpers import overfit_drafter_ttt
from train_helpers import QUIET_RUN, no_log

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder

TINY = Path(__file__).resolve().parents[3] / "assets" / "pycode-tiny"
pytestmark = pytest.mark.skipif(not TINY.is_dir(), reason="assets/pycode-tiny not available")

NEW = 24
ATOL = 2e-4
MODES = {
    "plain": DecodeMode("plain"),
    "chain": DecodeMode("chain", draft_tokens=5),
    "tree": DecodeMode("tree", top_k=3, depth=4, tree_tokens=10),
}
PROMPTS = ["def fib(n):\n", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def served():
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    torch.set_num_threads(1)
    t = load_target(str(TINY), dtype="fp32")
    prompts = [t.tokenizer(p)["input_ids"] for p in PROMPTS]
    refs = [SpeculativeDecoder(t, None, max_len=128).generate(p, NEW, eos_ids=[]).token_ids for p in prompts]
    seqs = [p + r for p, r in zip(prompts, refs)]
    torch.manual_seed(0)
    counts = torch.bincount(torch.tensor([x for s in seqs for x in s]), minlength=t.vocab_size)
    d = Drafter.from_target(t, token_counts=counts, draft_vocab_size=512)
    eng = SpeculativeDecoder(t, d, max_len=128)
    overfit_drafter_ttt(eng, d, seqs, steps=40, lr=3e-3, ttt_steps=3)
    eng.set_state_recording(True)
    return t, eng, prompts, refs


@torch.no_grad()
def _capture(t, aux_layers, seq) -> torch.Tensor:
    """[len(seq), (k+1)*H] fp32: aux layers then the final pre-norm state, from one HF prefill with capture's hooks."""
    from draftsmith.capture import AuxCapture

    cap = AuxCapture(t, aux_layers, capture_final=True)
    with cap:
        t.decoder(input_ids=torch.tensor([seq], device=t.device), use_cache=False)
    return torch.cat([cap.aux[0], cap.final[0]], -1).float()


@pytest.mark.parametrize("kind", list(MODES))
def test_buffer_rows_equal_a_prefill_capture(served, kind):
    t, eng, prompts, refs = served
    for p, ref in zip(prompts, refs):
        r = eng.generate(p, NEW, mode=MODES[kind], eos_ids=[])
        assert r.token_ids == ref  # recording leaves the output alone
        if kind != "plain":  # deep paths (tree: compacted), and rounds with rejected rows
            assert max(r.accepted) >= 3 and min(r.accepted) < MODES[kind].max_accept, r.accepted
        seq = p + r.token_ids
        n = len(seq) - 1  # the last emitted token is never forwarded
        assert int(eng.L) >= n  # (a last round may commit past max_new_tokens: those rows are not taken)
        got = eng.states[:n].float()
        want = _capture(t, eng.aux_layers, seq)[:n]
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        # row by row: each recorded row is nearest to its own token's capture row, and a one-slot shift is far off
        assert torch.equal(torch.cdist(got, want).argmin(1), torch.arange(n))
        assert (got[1:] - want[:-1]).abs().amax() > 1000 * ATOL


@pytest.mark.parametrize("kind", ["plain", "chain"])
def test_buffer_rows_with_the_padded_prefill(served, kind):
    """The graphed prefill (`prefill_graphs`, on by default with CUDA graphs; its padded body eagerly here) records the
    same rows: the padding rows' states land past the prompt, where the decode rewrites them before any is kept."""
    t, eng, prompts, refs = served
    eng.prefill_graphs = True
    try:
        for p, ref in zip(prompts, refs):
            assert eng._prefill_bucket(len(p)) is not None
            r = eng.generate(p, NEW, mode=MODES[kind], eos_ids=[])
            assert r.token_ids == ref
            seq = p + r.token_ids
            n = len(seq) - 1
            torch.testing.assert_close(eng.states[:n].float(), _capture(t, eng.aux_layers, seq)[:n], rtol=0, atol=ATOL)
    finally:
        eng.prefill_graphs = False


def test_tree_without_compaction_would_be_caught(served):
    """Negative control: the same tree generation with the accepted path's rows left where their nodes were
    verified (no compaction) differs from the capture (so the test above can fail)."""
    t, eng, prompts, _ = served
    p = prompts[0]
    r = eng.generate(p, NEW, mode=MODES["tree"], eos_ids=[])
    n = len(p) + len(r.token_ids) - 1
    good = eng.states[:n].float().clone()
    orig_copy, orig_compact = eng.states.index_copy_, eng.runner.compact
    compacting = []

    def compact(src, dst):  # the K/V compaction; the states' follows it
        compacting.append(1)
        return orig_compact(src, dst)

    def index_copy_(dim, index, source):
        if compacting:  # skip the states' compaction
            compacting.clear()
            return eng.states
        return orig_copy(dim, index, source)

    eng.states.index_copy_, eng.runner.compact = index_copy_, compact
    try:
        eng.generate(p, NEW, mode=MODES["tree"], eos_ids=[])
    finally:
        del eng.states.index_copy_, eng.runner.compact
    bad = eng.states[:n].float()
    want = _capture(t, eng.aux_layers, p + r.token_ids)[:n]
    assert (good - want).abs().amax() <= ATOL < (bad - want).abs().amax()


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_recorder_store_from_served_forwards_equals_capture(served, tmp_path, dtype):
    """ServeRecorder(engine=...) after chain, tree and plain generations: a verified store of prompt + response but
    the last token, its states the capture's within bf16 / fp8 rounding; no extra target forward runs."""
    from draftsmith.serve.recorder import ServeRecorder
    from draftsmith.store import HiddenStateStore
    from draftsmith.store.verify import verify_store

    t, eng, prompts, _ = served
    rec = ServeRecorder(tmp_path / "store", t, eng.aux_layers, dtype=dtype, flush_s=60, engine=eng)
    assert rec.served_states and rec._cap is None
    calls = []
    hook = t.decoder.register_forward_hook(lambda *a: calls.append(1))  # the HF model must not run
    seqs = []
    try:
        for kind, p in zip(("chain", "tree", "plain"), prompts):
            r = eng.generate(p, NEW, mode=MODES[kind], eos_ids=[])
            assert rec.record(p, r.token_ids)
            seqs.append((p, r.token_ids))
    finally:
        hook.remove()
    rec.close()
    assert calls == []
    assert verify_store(tmp_path / "store", progress=False) == []
    s = HiddenStateStore.open(tmp_path / "store")
    assert len(s) == 3 and s.manifest["dtype"] == dtype
    kH = len(eng.aux_layers) * t.hidden_size
    for i, (p, resp) in enumerate(seqs):
        seq = p + resp
        got = s[i]
        assert got["input_ids"].tolist() == seq[:-1]
        assert got["loss_mask"].tolist() == [False] * len(p) + [True] * (len(resp) - 1)
        want = _capture(t, eng.aux_layers, seq)[:-1]
        for key, ref in (("aux_hidden_states", want[:, :kH]), ("final_hidden_states", want[:, kH:])):
            x = got[key].float()
            assert x.shape == ref.shape
            if dtype == "bf16":
                torch.testing.assert_close(x, ref.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-4)
            else:  # one e4m3 step of the row's scale: 2^-3 of the row's largest power of two
                H = t.hidden_size
                scale = ref.view(len(ref), -1, H).abs().amax(-1, keepdim=True)
                err = (x - ref).view(len(ref), -1, H).abs()
                assert (err <= scale * 2**-3 + 1e-6).all()
            assert (x[1:] - ref[:-1]).abs().amax() > 1.0  # a shifted row is far off


def test_served_store_fine_tunes_the_serving_drafter(served, tmp_path):
    """The loop capture-while-serving exists for: the store a server records with its drafter trains that drafter
    further (`train --store STORE --init-from DRAFTER`). The run starts from the serving drafter — on its own served
    traffic its first step already predicts most tokens (a fresh drafter predicts none) — and a near-zero lr keeps
    its weights."""
    from safetensors.torch import load_file

    from draftsmith.serve.recorder import ServeRecorder
    from draftsmith.train import TrainConfig, train

    t, eng, prompts, _ = served
    rec = ServeRecorder(tmp_path / "store", t, eng.aux_layers, dtype="bf16", flush_s=60, engine=eng)
    for kind, p in zip(("chain", "tree", "plain"), prompts):
        assert rec.record(p, eng.generate(p, NEW, mode=MODES[kind], eos_ids=[]).token_ids)
    rec.close()
    eng.drafter.save_pretrained(tmp_path / "serving")
    common = dict(target=str(TINY), store=str(tmp_path / "store"), steps=1, ttt_steps=2, batch_tokens=256, **QUIET_RUN)
    first = {}
    for name, extra in (("tuned", dict(init_from=str(tmp_path / "serving"), lr=1e-12)), ("fresh", {})):
        out = tmp_path / name
        train(target=t, cfg=TrainConfig(out=str(out), **common, **extra), log=no_log)
        first[name] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["acc"][0]
    assert first["tuned"] > 0.5 > first["fresh"] + 0.3, first
    a, b = (
        load_file(tmp_path / "serving" / "model.safetensors"),
        load_file(tmp_path / "tuned" / "final" / "model.safetensors"),
    )
    for k in a:
        torch.testing.assert_close(b[k].float(), a[k].float(), atol=1e-5, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no triton")
def test_triton_step_records_the_final_state(served):
    """kernels="triton" (one-token steps through draftsmith.decode.kernels, the final norm fused into the lm_head
    gemv): the pre-norm state is still the residual stream's, recorded like the torch path's."""
    pytest.importorskip("triton")
    t, _, prompts, refs = served
    from draftsmith.decode.llama import TRITON_OPS

    eng = SpeculativeDecoder(t, None, max_len=64, kernels="triton")
    # the matmuls with their folds (down's residual add, lm_head's final norm) are what matters here; the
    # interpreted attention and RoPE kernels would only triple the time
    eng.runner.triton_ops = set(TRITON_OPS) - {"attn", "rope"}
    eng.set_state_recording(True)
    p = prompts[0]
    r = eng.generate(p, 2, eos_ids=[])  # a torch prefill + one Triton step
    assert r.token_ids == refs[0][:2]
    seq = p + r.token_ids
    n = len(seq) - 1
    torch.testing.assert_close(eng.states[:n].float(), _capture(t, eng.aux_layers, seq)[:n], rtol=0, atol=ATOL)


def test_recording_rounds_stay_sync_free(served):
    """The recording (the states scatter, the tree compaction of the states) keeps every round free of host syncs
        and host->device copies, so rounds still replay from CUDA graphs: tests/unit/decode/test_decode_syncfree.py's
        guard around rounds of an engine that records. Sampled rounds (T=0.8): the CPU engine runs greedy chain rounds
    with host bookkeeping (`_chain_round_cpu`, never on a GPU); the recording is the same in every round."""
    import importlib.util

    from draftsmith.decode.sampling import SamplingParams

    path = Path(__file__).resolve().parents[1] / "decode" / "test_decode_syncfree.py"
    spec = importlib.util.spec_from_file_location("_syncfree_guard", path)
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    _, eng, prompts, _ = served
    sp = SamplingParams(0.8)
    with torch.no_grad():
        for kind, mode in MODES.items():
            eng.prefill(prompts[0], sp, draft=kind != "plain")
            fn = eng.eager_step_fn(mode, sp)
            with guard.no_host_sync():
                for _ in range(2):
                    fn()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_rounds_record_and_the_async_copy_keeps_them(tmp_path):
    """On the GPU (bf16, CUDA graphs, a random drafter: every draft rejected): the buffer rows recorded by graph
    replays match a prefill capture row by row (bf16: per-row cosine > 0.999, each row nearest its own token's),
    and the store holds exactly those rows although the next request's prefill overwrites the buffer right after
    `record` (its device-to-host copy is stream-ordered before it; the writer waits for the copy's event)."""
    from draftsmith.drafter import Drafter
    from draftsmith.serve.recorder import ServeRecorder
    from draftsmith.store import HiddenStateStore
    from draftsmith.target_model import load_target

    t = load_target(str(TINY), dtype="bf16", device="cuda")
    prompts = [t.tokenizer(p)["input_ids"] for p in PROMPTS]
    torch.manual_seed(0)
    d = Drafter.from_target(t, draft_vocab_size=2048).to(device="cuda", dtype=torch.bfloat16).eval()
    eng = SpeculativeDecoder(t, d, max_len=256)
    assert eng.cuda_graphs
    eng.set_state_recording(True)
    rec = ServeRecorder(tmp_path / "store", t, eng.aux_layers, flush_s=60, engine=eng)
    kept = []
    for kind in MODES:
        for p in prompts:
            r = eng.generate(p, NEW, mode=MODES[kind], eos_ids=[])
            n = len(p) + len(r.token_ids) - 1
            kept.append(eng.states[:n].clone())
            assert rec.record(p, r.token_ids)
            got, want = kept[-1].float(), _capture(t, eng.aux_layers, p + r.token_ids)[:n]
            assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999, kind
            assert torch.equal(torch.cdist(got, want).argmin(1).cpu(), torch.arange(n)), kind
    rec.close()
    s = HiddenStateStore.open(tmp_path / "store")
    kH = len(eng.aux_layers) * t.hidden_size
    assert len(s) == len(kept)
    for i, x in enumerate(kept):
        x = x.float().cpu()
        assert torch.equal(s[i]["aux_hidden_states"].float(), x[:, :kH])
        assert torch.equal(s[i]["final_hidden_states"].float(), x[:, kH:])
