"""Experiment (issue 18): the target's own greedy continuations of source-file prefixes, as a JSONL of {"text"}
records to train a drafter on (what a drafter sees when it serves greedy completions is the target's own text).

    python dev/selfdistill_text.py --target assets/pycode-tiny --data DIR --out FILE.jsonl --prompts 20000 \
        --new-tokens 256 --batch 512 --max-s 150
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--max-samples", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--max-s", type=float, default=150.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data import load_samples

    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.bfloat16).cuda().eval()
    samples, rep = load_samples(a.data, tok, max_length=2048, on_bad="skip", max_samples=a.max_samples)
    print(rep.summary(), flush=True)
    rng = random.Random(a.seed)
    pool = [s for s in samples if len(s.input_ids) > 48]
    t0 = time.time()
    n_rec = n_tok = 0
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with open(a.out, "w") as f:
        while n_rec < a.prompts and time.time() - t0 < a.max_s:
            prefixes = []
            for _ in range(a.batch):
                s = rng.choice(pool)
                ids = list(map(int, s.input_ids))
                plen = rng.randint(16, min(256, len(ids) - 1))
                start = rng.randint(0, len(ids) - plen) if rng.random() < 0.7 else 0
                prefixes.append(ids[start : start + plen])
            P = max(len(p) for p in prefixes)
            inp = torch.full((len(prefixes), P), pad, dtype=torch.long)
            att = torch.zeros((len(prefixes), P), dtype=torch.long)
            for i, p in enumerate(prefixes):
                inp[i, P - len(p) :] = torch.tensor(p)
                att[i, P - len(p) :] = 1
            with torch.no_grad():
                out = model.generate(
                    input_ids=inp.cuda(),
                    attention_mask=att.cuda(),
                    max_new_tokens=a.new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            for i, p in enumerate(prefixes):
                cont = out[i, P:].tolist()
                f.write(json.dumps({"text": tok.decode(p + cont, skip_special_tokens=True)}) + "\n")
                n_tok += len(cont)
            n_rec += len(prefixes)
            print(f"{n_rec} records, {n_tok} new tokens, {n_tok / (time.time() - t0):.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
