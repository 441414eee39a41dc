"""Greedy speculative decoding == plain greedy decoding, token for token (chain and tree), plus the
drafter hand-off: per-round drafts equal a cache-free sequential recomputation, and a trained drafter
reaches the acceptance its teacher-forced predictions promise."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from decode_helpers import (
    overfit_drafter,
    overfit_drafter_ttt,
    random_drafter,
    reference_chain_drafts,
    target_aux,
    tiny_qwen3,
)

from draftsmith.decode.engine import DecodeMode, SpeculativeDecoder

ROOT = str(Path(__file__).resolve().parents[3])
PYCODE_TINY = next(
    (p for p in (os.path.join(ROOT, "assets", "pycode-tiny"), "/work/shared/targets/pycode-tiny") if os.path.isdir(p)),
    None,
)
HUMANEVAL = "/work/shared/data/eval/humaneval.jsonl"
NEW = 12
CHAIN = DecodeMode("chain", draft_tokens=3)
TREE = DecodeMode("tree", top_k=3, depth=3, tree_tokens=8)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _code_prompts(tok, n=50, max_tokens=24):
    out = []
    if os.path.exists(HUMANEVAL):
        for line in open(HUMANEVAL):
            text = json.loads(line)["turns"][0].split("\n", 1)[1]
            out.append(tok.encode(text)[:max_tokens])
    seeds = ["def ", "import numpy as np\n", "class Foo:\n    def ", "for i in range(", "# utils\n", "x = [", "\n"]
    out += [tok.encode(s) for s in seeds]
    return [p for p in out if p][: max(n, 50)]


def _hf_greedy(model, ids, n, eos=None):
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def pycode():
    if PYCODE_TINY is None:
        pytest.skip("pycode-tiny not available")
    from draftsmith.target_model import load_target

    t = load_target(PYCODE_TINY, dtype="fp32")
    prompts = _code_prompts(t.tokenizer)
    torch.set_num_threads(1)
    refs = [_hf_greedy(t.model, p, NEW, eos=0) for p in prompts]
    return t, prompts, refs


@pytest.fixture(scope="module")
def qwen3():
    m = tiny_qwen3()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, m.config.vocab_size, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(50)
    ]
    torch.set_num_threads(1)
    refs = [_hf_greedy(m, p, NEW) for p in prompts]
    return m, prompts, refs


def _check_equal(engine, prompts, refs, mode):
    for p, ref in zip(prompts, refs):
        r = engine.generate(p, NEW, mode=mode)
        assert r.token_ids == ref, f"mismatch for prompt {p}: {r.token_ids} != {ref}"
    return r


@pytest.mark.parametrize("mode", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_equal_random_drafter_pycode(pycode, mode):
    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=4096), max_len=64)
    assert eng.backend == "llama"
    _check_equal(eng, prompts, refs, mode)


@pytest.mark.parametrize("impl", ["bmm", "split"])
@pytest.mark.parametrize("mode", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_equal_other_attention_impls_pycode(pycode, mode, impl):
    """The batched-matmul and split-KV attentions (chosen on CUDA for long caches) keep greedy equality, target
    and drafter; a 256-slot cache makes `split` really split (4 chunks, most of them masked out entirely)."""
    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=4096), max_len=256, attn_impl=impl)
    assert eng.attn_impl == impl and eng.runner.attn_impl == impl
    _check_equal(eng, prompts[:20], refs[:20], mode)


def test_attn_impl_auto_and_validation(pycode):
    t, _, _ = pycode
    eng = SpeculativeDecoder(t, None, max_len=4096)
    assert eng.attn_impl == "sdpa"  # CPU: SDPA whatever the length (the slot threshold is a CUDA measurement)
    with pytest.raises(ValueError, match="attn_impl"):
        SpeculativeDecoder(t, None, max_len=64, attn_impl="flash")


def test_greedy_equal_compiled_rounds_pycode(pycode):
    """`compile=True` (torch.compile of the round forwards: bench/decode.py --compile, P1c) keeps greedy
    equality, chain and tree, on a few prompts (compiling takes most of the time)."""
    import torch._dynamo

    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch._dynamo.reset()
    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=4096), max_len=64, compile=True)
    for mode in (CHAIN, TREE, DecodeMode("plain")):
        _check_equal(eng, prompts[:4], refs[:4], mode)
    torch._dynamo.reset()


def test_traced_rounds_fullgraph_equal_pycode(pycode):
    """compile=True on CUDA traces each greedy round whole (`compile_rounds`): the draft steps, the verify, the
    acceptance, the hand-off and the state updates in one graph. Traced here with fullgraph=True (no graph break
    anywhere in a round) and the aot_eager backend (dynamo + functionalisation, no codegen), chain and tree: output
    equals plain decoding."""
    import torch._dynamo

    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch._dynamo.reset()
    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=4096), max_len=64)
    eng.set_cpu_paths(False)  # the device-agnostic round, as on a GPU
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    from torch._dynamo.backends.common import aot_autograd

    eng.compile_rounds(backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    calls, real = [], eng._c_round
    eng._c_round = lambda *a: (calls.append(a), real(*a))[1]
    for mode in (CHAIN, TREE, DecodeMode("plain")):
        _check_equal(eng, prompts[:3], refs[:3], mode)
    assert {a[0].kind for a in calls} == {"chain", "tree", "plain"}  # the traced rounds ran
    # the cache is reached through its per-layer views only: a write through the 5-D tensor (the tree's compaction
    # did) merges them into one synthetic base, and every layer's K/V write becomes a scatter of the whole cache
    ops = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert graphs and not any("as_strided_scatter" in o for o in ops), sorted(o for o in ops if "scatter" in o)
    torch._dynamo.reset()


def test_greedy_equal_max_autotune_rounds_pycode(pycode):
    """compile="max-autotune" (inductor may swap cuBLAS for its own Triton GEMMs with fused neighbours) keeps
    greedy equality; a bad compile value is refused."""
    import torch._dynamo

    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch._dynamo.reset()
    torch.manual_seed(0)
    eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=4096), max_len=64, compile="max-autotune")
    assert eng.compile_mode == "max-autotune-no-cudagraphs"
    for mode in (CHAIN, DecodeMode("plain")):
        _check_equal(eng, prompts[:2], refs[:2], mode)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="compile"):
        SpeculativeDecoder(t, None, max_len=64, compile="fast")


QWEN_MODES = [
    CHAIN,
    TREE,
    DecodeMode("plain"),
    DecodeMode("chain", draft_tokens=1),
    DecodeMode("tree", top_k=1, depth=4, tree_tokens=4),
    DecodeMode("tree", top_k=5, depth=1, tree_tokens=5),
    DecodeMode("tree", top_k=4, depth=4, tree_tokens=40),
]


@pytest.mark.parametrize(
    "mode", QWEN_MODES, ids=["chain", "tree", "plain", "chain-k1", "tree-k1", "tree-d1", "tree-wide"]
)
def test_greedy_equal_random_drafter_qwen3(qwen3, mode):
    m, prompts, refs = qwen3
    eng = SpeculativeDecoder(m, random_drafter(m), max_len=96)
    _check_equal(eng, prompts, refs, mode)


def test_greedy_equal_generic_hf_path(qwen3):
    m, prompts, refs = qwen3
    eng = SpeculativeDecoder(m, random_drafter(m), max_len=96, backend="hf")
    assert eng.backend == "hf"
    _check_equal(eng, prompts[:8], refs[:8], CHAIN)
    _check_equal(eng, prompts[:8], refs[:8], TREE)


def _other_arch(name):
    import transformers as T

    torch.manual_seed(0)
    if name == "gemma":
        return T.GemmaForCausalLM(
            T.GemmaConfig(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                initializer_range=0.3,
            )
        ).eval()
    return T.GPT2LMHeadModel(
        T.GPT2Config(
            vocab_size=64, n_embd=64, n_layer=4, n_head=4, initializer_range=0.3, bos_token_id=None, eos_token_id=None
        )
    ).eval()


@pytest.mark.parametrize("arch", ["gemma", "gpt2"])
def test_generic_path_other_architectures(arch):
    """Architectures outside the compact forward (Gemma: scaled embeddings; GPT-2: learned positions) run
    through the HF module with a 4D tree mask and explicit positions — still exact."""
    import warnings

    m = _other_arch(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = SpeculativeDecoder(m, random_drafter(m), max_len=64)
    assert eng.backend == "hf"
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        p = torch.randint(1, 64, (8,), generator=g).tolist()
        ref = _hf_greedy(m, p, NEW)
        for mode in (CHAIN, TREE):
            assert eng.generate(p, NEW, mode=mode, eos_ids=[]).token_ids == ref


@pytest.fixture(scope="module")
def trained(pycode):
    t, prompts, refs = pycode
    from draftsmith.drafter import Drafter

    torch.manual_seed(0)
    seqs = [p + r for p, r in zip(prompts, refs)]
    counts = torch.bincount(torch.tensor([x for s in seqs for x in s]), minlength=t.vocab_size)
    d = Drafter.from_target(t, token_counts=counts, draft_vocab_size=1024)
    eng = SpeculativeDecoder(t, d, max_len=64)
    # trained through the trainer's TTT unroll (3 steps), so later draft positions are trained too
    overfit_drafter_ttt(eng, d, seqs, steps=40, lr=3e-3, ttt_steps=3)
    return eng, d, prompts, refs


def test_handoff_matches_sequential_reference(trained):
    """Every round's draft tokens == drafts recomputed from scratch (prefill-style, no cache)."""
    eng, d, prompts, _ = trained
    for p in prompts[:6]:
        r = eng.generate(p, NEW, mode=DecodeMode("chain", draft_tokens=2), trace=True)
        committed = list(p) + [r.token_ids[0]]
        for rnd in r.trace:
            assert rnd["L"] == len(committed) - 1
            ref = reference_chain_drafts(eng, d, committed, 2)
            assert rnd["draft"][0] == committed[-1]
            assert rnd["draft"][1:] == ref, f"round at L={rnd['L']}"
            committed += rnd["tokens"]


def test_tree_width_one_equals_chain(trained):
    """A tree with top_k=1 is a chain: same drafts, same acceptance per round (tree mask, positions and
    compaction of a straight path reproduce the chain exactly)."""
    eng, _, prompts, _ = trained
    for p in prompts[:12]:
        a = eng.generate(p, NEW, mode=DecodeMode("chain", draft_tokens=3))
        b = eng.generate(p, NEW, mode=DecodeMode("tree", top_k=1, depth=3, tree_tokens=3))
        assert a.token_ids == b.token_ids and a.accepted == b.accepted


def _teacher_forced_tau(eng, d, prompt, out):
    """τ a K=1 chain must reach: the drafter's prefill-style prediction for each committed prefix."""
    seq = list(prompt) + list(out)
    aux, _ = target_aux(eng, seq[:-1])
    ids = torch.tensor(seq[1:])
    with torch.no_grad():
        pred = d.compute_logits(d(ids[None], d.fuse(aux)[None])[0]).argmax(-1)
    pred = d.draft_to_target(pred).tolist()  # pred[i] predicts seq[i+2]
    L, acc = len(prompt), []
    while L - len(prompt) + 1 < len(out):
        ok = L + 1 < len(seq) and pred[L - 1] == seq[L + 1]
        acc.append(int(ok))
        L += 1 + int(ok)
    return acc


def test_trained_drafter_equal_and_tau(trained):
    eng, d, prompts, refs = trained
    taus = []
    for p, ref in zip(prompts, refs):
        r = eng.generate(p, NEW, mode=DecodeMode("chain", draft_tokens=1))
        assert r.token_ids == ref
        expect = _teacher_forced_tau(eng, d, p, ref)
        assert r.accepted[: len(expect)] == expect[: len(r.accepted)]
        taus.append(r.tau)
    mean_tau = sum(taus) / len(taus)
    assert mean_tau > 1.4, mean_tau  # random drafter: ~1.0
    got = {}
    for name, mode in (("chain", CHAIN), ("tree", TREE)):
        ts = []
        for p, ref in zip(prompts, refs):
            r = eng.generate(p, NEW, mode=mode)
            assert r.token_ids == ref
            ts.append(r.tau)
        got[name] = sum(ts) / len(ts)
    # deeper drafts pay off only if every draft step and the hand-off are right
    assert got["chain"] > mean_tau + 0.3, (got, mean_tau)
    assert got["tree"] > got["chain"], got


def test_trained_drafter_qwen3(qwen3):
    """Tiny Qwen3 + a drafter overfit on its greedy outputs: equality over 50 prompts, chain and tree,
    and acceptance far above the random drafter's."""
    m, prompts, refs = qwen3
    d = random_drafter(m, seed=1)
    eng = SpeculativeDecoder(m, d, max_len=64)
    rand_tau = sum(eng.generate(p, NEW, mode=CHAIN).tau for p in prompts[:10]) / 10
    loss = overfit_drafter(eng, d, [p + r for p, r in zip(prompts, refs)], steps=150, lr=1e-2)
    assert loss < 1.0, loss
    for mode in (CHAIN, TREE):
        taus = []
        for p, ref in zip(prompts, refs):
            r = eng.generate(p, NEW, mode=mode)
            assert r.token_ids == ref
            taus.append(r.tau)
        assert sum(taus) / len(taus) > rand_tau + 0.5, (mode.kind, sum(taus) / len(taus), rand_tau)


TRAINED_DRAFTER = os.environ.get("DRAFTSMITH_TEST_DRAFTER")  # a drafter trained by `draftsmith train`


@pytest.mark.skipif(not TRAINED_DRAFTER, reason="set DRAFTSMITH_TEST_DRAFTER to a trained drafter for the target")
def test_greedy_equal_trained_checkpoint():
    from draftsmith.drafter import Drafter
    from draftsmith.target_model import load_target

    t = load_target(os.environ.get("DRAFTSMITH_TEST_TARGET", PYCODE_TINY), dtype="fp32")
    d = Drafter.from_pretrained(TRAINED_DRAFTER, target=t).float()
    eng = SpeculativeDecoder(t, d, max_len=128)
    prompts = _code_prompts(t.tokenizer)
    taus = []
    for p in prompts:
        ref = _hf_greedy(t.model, p, 32, eos=0)
        for mode in (CHAIN, TREE):
            r = eng.generate(p, 32, mode=mode)
            assert r.token_ids == ref
            taus.append(r.tau)
    assert sum(taus) / len(taus) > 1.3


@pytest.fixture(scope="module")
def qwen3_overfit(qwen3):
    m, prompts, refs = qwen3
    d = random_drafter(m, seed=1)
    eng = SpeculativeDecoder(m, d, max_len=64)
    overfit_drafter(eng, d, [p + r for p, r in zip(prompts[:10], refs[:10])], steps=80, lr=1e-2)
    return eng, prompts[:10], refs[:10]


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
@pytest.mark.parametrize("mode", [CHAIN, TREE, DecodeMode("plain")], ids=["chain", "tree", "plain"])
def test_stops_exactly_on_eos_and_length(qwen3_overfit, mode, lookahead):
    """EOS inside an accepted run of draft tokens cuts the output right after it; max_new_tokens is exact — with
    the next round launched before the last is read (`lookahead`, a GPU's default) as without."""
    eng, prompts, refs = qwen3_overfit
    for p, ref in zip(prompts, refs):
        for n in (1, 2, 5, NEW):
            assert eng.generate(p, n, mode=mode, lookahead=lookahead).token_ids == ref[:n]
        eos = ref[len(ref) // 2]
        cut = ref.index(eos) + 1
        r = eng.generate(p, NEW, mode=mode, eos_ids=[eos], lookahead=lookahead)
        assert r.token_ids == ref[:cut] and r.finish_reason == "eos"
    assert eng.generate(prompts[0], 0, mode=mode, lookahead=lookahead).token_ids == []


def _counting_launches(eng):
    """-> (launches, counting, real): `counting` wraps eng._runner_for (`real`) so that each unit it runs adds one to
    launches["n"]; the caller installs it as eng._runner_for and puts `real` back."""
    launches = {"n": 0}
    real = eng._runner_for

    def counting(*a, **k):
        fn = real(*a, **k)

        def run():
            launches["n"] += 1
            return fn()

        return run

    return launches, counting, real


@pytest.mark.parametrize("mode", [CHAIN, TREE, DecodeMode("plain")], ids=["chain", "tree", "plain"])
def test_lookahead_keeps_every_result_field(qwen3_overfit, mode):
    """`generate(lookahead=True)` (the next unit launched before the host reads the last) returns what the
    synchronous loop does — tokens, per-round acceptance, round count, margins, finish reason, streamed batches, a
    cancellation — and really runs ahead: it launches one unit more than it keeps when it stops early."""
    eng, prompts, refs = qwen3_overfit
    launches, counting, real = _counting_launches(eng)
    ran_ahead = 0
    eng.record_margins = True
    eng.lookahead_tail = False  # always a round ahead (the tail rule's own test is below)
    try:
        for p in prompts:
            for n, every in ((NEW, 8), (NEW, 3), (7, 8)):
                got = {}
                for la in (False, True):
                    batches = []
                    eng._runner_for = counting
                    launches["n"] = 0
                    r = eng.generate(p, n, mode=mode, lookahead=la, on_tokens=batches.append, sync_every=every)
                    eng._runner_for = real
                    got[la] = (r.token_ids, r.accepted, r.rounds, r.margins, r.finish_reason, batches, launches["n"])
                assert got[True][:6] == got[False][:6]
                extra = got[True][6] - got[False][6]
                assert 0 <= extra <= (1 if mode.kind != "plain" else every)
                ran_ahead += extra > 0
            # a consumer that cancels after its second batch: the same tokens, "cancelled", either way
            res = []
            for la in (False, True):
                seen = []
                r = eng.generate(p, NEW, mode=mode, lookahead=la, on_tokens=lambda t: seen.append(t) or len(seen) < 2)
                res.append((r.token_ids, r.finish_reason, seen))
            assert res[0] == res[1] and res[0][1] == "cancelled"
    finally:
        eng.record_margins = False
        eng.lookahead_tail = True
        eng._runner_for = real
    if mode.kind != "plain":  # rounds stopped by length mid-flight: the one launched ahead was run and dropped
        assert ran_ahead > 0


@pytest.mark.parametrize("mode", [CHAIN, TREE], ids=["chain", "tree"])
def test_lookahead_tail_drops_fewer_rounds(qwen3_overfit, mode):
    """`lookahead_tail`: no round launched ahead while the one in flight is expected (at the generation's mean
    tokens a round) to reach max_new_tokens. Length-bound generations then run fewer rounds they drop than with a
    round always ahead, with the same tokens and rounds kept."""
    eng, prompts, _ = qwen3_overfit
    launches, counting, real = _counting_launches(eng)
    dropped = {}
    eng._runner_for = counting
    try:
        for tail in (False, True):
            eng.lookahead_tail = tail
            launches["n"] = kept = 0
            out = []
            for p in prompts:
                for n in (9, 17, NEW):
                    r = eng.generate(p, n, mode=mode, lookahead=True)
                    kept += len(r.accepted)
                    out.append((r.token_ids, r.accepted))
            dropped[tail] = (launches["n"] - kept, out)
    finally:
        eng.lookahead_tail = True
        eng._runner_for = real
    assert dropped[True][1] == dropped[False][1]
    assert dropped[False][0] > 0 and dropped[True][0] < dropped[False][0], (dropped[False][0], dropped[True][0])


@pytest.mark.parametrize("lookahead", [False, True], ids=["sync", "lookahead"])
def test_cache_end_falls_back_to_plain_steps(qwen3, lookahead):
    """When a round no longer fits the cache, decoding continues with plain steps, then stops ('cache')."""
    m, prompts, _ = qwen3
    eng = SpeculativeDecoder(m, random_drafter(m), max_len=32)
    p = prompts[0][:8]
    ref = _hf_greedy(m, p, 40)
    for mode in (CHAIN, TREE, DecodeMode("plain")):
        r = eng.generate(p, 40, mode=mode, lookahead=lookahead)
        assert r.finish_reason == "cache" and 16 <= len(r.token_ids) < 40
        assert r.token_ids == ref[: len(r.token_ids)]


def test_compiled_engine_stays_compiled_across_many_settings(pycode, monkeypatch):
    """Each draft/verify width is one static graph; bench/decode.py --compile runs ~8 settings on one engine.
    Past dynamo's default recompile limit (8 per function) the rest would silently run eagerly, so the engine
    raises the limit; this runs more widths than 8 and checks dynamo never reports hitting it. The limit is
    dynamo's, whatever the backend: the graphs run through the "eager" backend here (inductor's C++ builds of nine
    graphs took ~80 s of a cold CI run; the compiled numerics are test_greedy_equal_compiled_rounds_pycode's)."""
    import functools
    import logging

    import torch._dynamo

    t, prompts, _ = pycode
    from draftsmith.drafter import Drafter

    hits: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "recompile_limit" in record.getMessage() or "cache_size_limit" in record.getMessage():
                hits.append(record.getMessage())

    h = Catch(level=logging.WARNING)
    lg = logging.getLogger("torch._dynamo.convert_frame")
    lg.addHandler(h)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        eng = SpeculativeDecoder(t, Drafter.from_target(t, draft_vocab_size=512), max_len=96, compile=True)
        for k in range(1, 9):  # drafter hand-off widths 2..9 + the 1-token draft step: 9 graphs of one function
            eng.generate(prompts[0], 4, mode=DecodeMode("chain", draft_tokens=k))
    finally:
        lg.removeHandler(h)
        torch._dynamo.reset()
    assert not hits, hits[0]


def test_cpu_chain_round_equals_generic_round(trained):
    """The CPU's greedy chain round (host-side acceptance, a+1-row hand-off, the flat drafter step) makes the same
    drafts and accepts the same tokens, round for round, as the device-agnostic round a GPU runs."""
    eng, _, prompts, _ = trained
    assert eng.host_rounds and eng.cpu_paths == {"target": True, "drafter": True}
    for K in (1, 3):
        m = DecodeMode("chain", draft_tokens=K)
        for p in prompts[:6]:
            a = eng.generate(p, NEW, mode=m, trace=True)
            eng.host_rounds = False
            try:
                b = eng.generate(p, NEW, mode=m, trace=True)
            finally:
                eng.host_rounds = True
            assert a.token_ids == b.token_ids and a.accepted == b.accepted
            assert [r["draft"] for r in a.trace] == [r["draft"] for r in b.trace]


def test_cpu_draft_step_matches_the_drafter_module(trained):
    """`CpuDraftStep` (transposed weights, no module calls) against the Drafter's own forward, fc and logits on the
    same inputs and cache (a prefill first writes the cache slots the rows see)."""
    from draftsmith.decode.sampling import SamplingParams

    eng, d, _, _ = trained
    g = torch.Generator().manual_seed(0)
    eng.prefill(torch.randint(0, eng.vocab_size, (12,), generator=g).tolist(), SamplingParams(), draft=True)
    T, H = 4, int(d.config.hidden_size)
    ids = torch.randint(0, eng.vocab_size, (T,), generator=g)
    aux = torch.randn(T, d.fc.in_features, generator=g)
    pos = torch.arange(10, 10 + T)
    mask = eng.mask(pos)
    with torch.no_grad():
        fast = eng.draft_forward(ids, eng.fuse(aux), pos, pos, mask)
        fast_logits = eng.draft_logits(fast)
        eng.set_cpu_paths(False)
        try:
            assert eng.cpu_paths == {"target": False, "drafter": False}
            ref = eng.draft_forward(ids, eng.fuse(aux), pos, pos, mask)
            ref_logits = eng.draft_logits(ref)
        finally:
            eng.set_cpu_paths(True)
        assert eng.cpu_paths == {"target": True, "drafter": True}
        ref_direct = d(ids[None], d.fuse(aux)[None], pos[None])[0]  # causal SDPA over these T tokens alone
    assert fast.shape == (T, H)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_logits, ref_logits, atol=1e-4, rtol=1e-4)
    # rows see only themselves and earlier rows of this call when the mask hides the cache before slot 10
    only = mask & (torch.arange(mask.shape[1]) >= 10)[None]
    with torch.no_grad():
        own = eng.draft_forward(ids, eng.fuse(aux), pos, pos, only)
    torch.testing.assert_close(own, ref_direct, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [CHAIN, TREE, DecodeMode("plain")], ids=["chain", "tree", "plain"])
def test_padded_prefill_equals_eager_prefill(qwen3_overfit, mode):
    """`prefill_graphs` (a prompt padded to a length bucket: one CUDA graph per bucket on a GPU, the same body eagerly
    here): the same first token, tokens, acceptance and margins as the unpadded prefill, and the same drafter state
    after it; prompts past the largest bucket or the cache prefill unpadded."""
    from draftsmith.decode.sampling import SamplingParams

    eng0, prompts, _ = qwen3_overfit
    eng = SpeculativeDecoder(eng0.model, eng0.drafter, max_len=576)
    g = torch.Generator().manual_seed(3)
    longer = [torch.randint(0, eng.vocab_size, (n,), generator=g).tolist() for n in (16, 17, 64, 65, 300, 512, 513)]
    eng.record_margins = True
    try:
        for p in prompts[:4] + longer:
            res = {}
            for padded in (False, True):
                eng.prefill_graphs = padded
                assert (eng._prefill_bucket(len(p)) is not None) == (padded and len(p) <= 512)
                r = eng.generate(p, NEW, mode=mode)
                first = eng.prefill(p, SamplingParams(), draft=mode.kind != "plain")
                res[padded] = (r, first, eng.h_last.clone(), int(eng.L), eng.prefill_margin)
            (a, fa, ha, La, ma), (b, fb, hb, Lb, mb) = res[False], res[True]
            assert a.token_ids == b.token_ids and a.accepted == b.accepted
            assert fa == fb and La == Lb == len(p)
            assert [x[0] for x in a.margins] == pytest.approx([x[0] for x in b.margins], abs=1e-4)
            assert ma == pytest.approx(mb, abs=1e-4)
            if mode.kind != "plain":
                torch.testing.assert_close(ha, hb, atol=1e-4, rtol=1e-4)  # as the margins: summation order
    finally:
        eng.record_margins = False
        eng.prefill_graphs = False


def test_padded_prefill_capture_sees_its_own_prompt(qwen3_overfit):
    """A prefill graph's first use runs its body (warm-up, capture) before the replay: the body must already see the
    prompt being prefilled. Longer prompts first, so a longer one's length left behind would index past a smaller
    bucket (it did: a device-side assert on the H200, 2026-12-02). The capture here is a stand-in that runs the body
    once and replays it eagerly."""
    from draftsmith.decode.sampling import SamplingParams

    eng0, _, _ = qwen3_overfit
    eng = SpeculativeDecoder(eng0.model, eng0.drafter, max_len=576)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, eng.vocab_size, (n,), generator=g).tolist() for n in (300, 100, 20, 9)]
    want = []
    for p in prompts:
        want.append((eng.prefill(p, SamplingParams()), eng.h_last.clone()))
    warmed = []

    def capture(fn, pool=None):
        fn()
        warmed.append(int(eng._pf_n))
        return fn

    eng.prefill_graphs, eng.cuda_graphs, eng._capture = True, True, capture
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture falls back to eager with a warning: none may fail
        for p, (first, h) in zip(prompts, want):
            assert eng.prefill(p, SamplingParams()) == first and int(eng.L) == len(p)
            torch.testing.assert_close(eng.h_last, h, atol=1e-5, rtol=1e-4)
    assert warmed == [len(p) for p in prompts]  # one capture per bucket (320, 128, 32, 16), each with its own prompt


def test_warmup_captures_every_prefill_bucket_for_its_mode(qwen3_overfit):
    """`warmup(mode, prefill=True)` (a server's start): every length bucket's prefill graph for the mode (with the
    drafter, or the target alone for plain) is captured then, each with a length that fits its bucket, and a later
    prefill of any length reuses them — equal to the unpadded prefill. Buckets past the cache are not captured."""
    from draftsmith.decode.sampling import SamplingParams

    eng0, _, _ = qwen3_overfit
    eng = SpeculativeDecoder(eng0.model, eng0.drafter, max_len=200)
    p = torch.randint(0, eng.vocab_size, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    want = (eng.prefill(p, SamplingParams()), eng.h_last.clone())
    captured = []

    def capture(fn, pool=None):
        fn()  # the capture's warm-up runs the body with the buffers as they are
        captured.append((fn.args[0], fn.args[1], int(eng._pf_n)))
        return fn

    eng.prefill_graphs, eng.cuda_graphs, eng._capture = True, True, capture
    eng._runner_for = lambda mode, sp: None  # (the rounds' graphs are not this test's)
    eng.warmup(CHAIN, prefill=True)
    assert [(B, draft) for B, draft, _ in captured] == [(B, True) for B in (16, 32, 64, 128, 192)]  # max_len 200
    assert all(n <= B for B, _, n in captured)
    eng.warmup(DecodeMode("plain"), prefill=True)
    assert [draft for _, draft, _ in captured[5:]] == [False] * 5
    n = len(captured)
    assert eng.prefill(p, SamplingParams()) == want[0] and len(captured) == n  # bucket 128, already captured
    torch.testing.assert_close(eng.h_last, want[1], atol=1e-5, rtol=1e-4)


def test_graphs_are_kept_for_a_bounded_number_of_sampling_settings(qwen3_overfit):
    """A graph bakes its sampling setting in; a server's clients send any temperature. Graphs are keyed by the
    canonical setting (greedy with any top_p / top_k is one setting) and kept for at most `max_graph_samplings`
    settings, the least recently used one's rounds and prefills dropped first. Capture is a stand-in here (the
    eager round, as on the CPU), so the outputs are the engine's own."""
    from draftsmith.decode.sampling import SamplingParams

    eng0, prompts, _ = qwen3_overfit
    eng = SpeculativeDecoder(eng0.model, eng0.drafter, max_len=256)
    want = eng.generate(prompts[0], 6, mode=CHAIN).token_ids
    eng.prefill_graphs, eng.cuda_graphs, eng._capture = True, True, lambda fn, pool=None: fn
    eng.max_graph_samplings = 2
    p = prompts[0]
    for sp in (SamplingParams(), SamplingParams(0.0, 0.9, 40), SamplingParams(top_k=-1)):  # all greedy: one setting
        assert eng.generate(p, 6, mode=CHAIN, sampling=sp).token_ids == want
    assert {k[1] for k in eng._graphs} == {SamplingParams()} and {k[2] for k in eng._pf_graphs} == {SamplingParams()}
    hot, warm = SamplingParams(0.8, 0.95, 50), SamplingParams(1.1, 2.0, 0)
    assert warm.canonical() == SamplingParams(1.1, 1.0, 0)
    for sp in (hot, warm):
        eng.generate(p, 6, mode=CHAIN, sampling=sp, seed=1)
    # three settings seen, two kept: greedy (the least recently used) went, rounds and prefills alike
    assert {k[1] for k in eng._graphs} == {hot, warm.canonical()}
    assert {k[2] for k in eng._pf_graphs} == {hot, warm.canonical()}
    assert eng.generate(p, 6, mode=CHAIN).token_ids == want  # and comes back when asked for
    assert {k[1] for k in eng._graphs} == {warm.canonical(), SamplingParams()}


def test_public_drafter_calls_see_weights_changed_under_the_engine():
    """The engine's decoding view of the drafter (fused q/k/v, the CPU draft step) is rebuilt when the drafter's
    weights change under it (trained further, loaded): the rounds did that, the public calls (`fuse`,
    `draft_forward`, `draft_logits`, `draft_token`) did not — run before any round they used the stale copy."""
    from decode_helpers import random_drafter, tiny_llama

    m = tiny_llama(vocab_size=64, hidden=64, layers=2)
    d = random_drafter(m, seed=3)
    eng = SpeculativeDecoder(m, d, max_len=32)
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(3, d.fc.in_features, generator=g)
    ids = torch.randint(0, 64, (3,), generator=g)
    pos = torch.arange(3)
    with torch.no_grad():
        before = eng.draft_logits(eng.draft_forward(ids, eng.fuse(aux), pos, pos, eng.mask(pos)))
        for p_ in d.parameters():  # an optimizer step's in-place update
            p_.mul_(1.5)
        after = eng.draft_logits(eng.draft_forward(ids, eng.fuse(aux), pos, pos, eng.mask(pos)))
        ref = d.compute_logits(d(ids[None], d.fuse(aux)[None], pos[None])[0]).float()
        tok = eng.draft_token(eng.draft_forward(ids[:1], eng.fuse(aux[:1]), pos[:1], pos[:1], eng.mask(pos[:1]))[0])
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
    assert tok.shape == (1,) and int(tok) == int(eng.d_ids[torch.argmax(ref[0])])
