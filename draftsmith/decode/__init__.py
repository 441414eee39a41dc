"""Speculative decoding with an EAGLE-3 drafter (batch size 1): plain, chain and EAGLE-2 dynamic tree.

    from draftsmith.target_model import load_target
    from draftsmith.drafter import Drafter
    from draftsmith.decode import SpeculativeDecoder, DecodeMode, SamplingParams

    t = load_target("path/to/target", dtype="bf16", device="cuda")
    d = Drafter.from_pretrained("path/to/drafter", target=t).to("cuda", torch.bfloat16)
    eng = SpeculativeDecoder(t, d, max_len=4096)          # CUDA graphs on by default on GPU
    ids = t.tokenizer("def fib(n):")["input_ids"]
    r = eng.generate(ids, max_new_tokens=256, mode=DecodeMode("tree", top_k=8, depth=6, tree_tokens=48))
    r.token_ids, r.text, r.tau, r.accepted, r.to_json()
    eng.generate(ids, 256, sampling=SamplingParams(temperature=0.7, top_p=0.9), seed=0)   # lossless sampling
    eng.generate(ids, 256, mode=DecodeMode("plain"))      # the honest baseline, same engine
    best = tune(eng, prompts[:4])                          # the fastest mode on this engine, or plain
    eng.generate(ids, 256, mode=best.mode)

Guarantees: greedy output == plain greedy decoding of the target, token for token (exact in fp32; in
bf16 a verify forward over T>1 tokens may round differently from a T=1 step, like any engine);
sampling is lossless (chain: standard speculative sampling; tree: recursive rejection sampling over
siblings with the drafter's deterministic top-k proposals). Stops on EOS (included in the output), stop
strings (the completing token included) and max_new_tokens exactly.

Targets: `draftsmith.decode.llama.LlamaFamilyForward` (Llama, Mistral, Qwen2, Qwen3; compact, static KV
cache, CUDA graphs) or, for any other HF architecture, `draftsmith.decode.hf_generic.HFGenericForward`
(the stock HF module with a DynamicCache and a 4D mask: eager, one host sync per forward — slower).
Module map: engine.py (rounds, hand-off, graphs), llama.py (target forward), hf_generic.py (fallback),
sampling.py (warp, acceptance rules), tuning.py (`tune`), certificate.py (bf16 greedy
certificate), evaluate.py (`draftsmith eval`), cli.py, testing.py (test helpers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.decode.engine import DecodeMode, GenerationResult, SpeculativeDecoder
    from draftsmith.decode.sampling import SamplingParams
    from draftsmith.decode.tuning import Tuning, tune

__all__ = ["DecodeMode", "GenerationResult", "SamplingParams", "SpeculativeDecoder", "Tuning", "tune"]
# torch-free --help: the generate/eval CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DecodeMode": "draftsmith.decode.engine",
        "GenerationResult": "draftsmith.decode.engine",
        "SpeculativeDecoder": "draftsmith.decode.engine",
        "SamplingParams": "draftsmith.decode.sampling",
        "Tuning": "draftsmith.decode.tuning",
        "tune": "draftsmith.decode.tuning",
    },
)
