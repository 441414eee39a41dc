"""Superseded by `draftsmith prune-vocab` (the same selection, counts from any --data).

Experiment (issue 18): cut a drafter's draft vocab to its N most frequent tokens (counted on this Python's stdlib
sources with the target's tokenizer) — the lm_head rows, d2t and t2d — to see what a smaller draft head buys on CPU.

    python dev/prune_draft_vocab.py N OUT_DIR [SOURCE_DIR]     (reads assets/pycode-tiny-drafter)
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

sys.path.insert(0, ".")
from draftsmith.data import load_samples
from draftsmith.drafter.vocab import ids_to_mappings

N = int(sys.argv[1])
out = Path(sys.argv[2])
src = Path("assets/pycode-tiny-drafter")
sd = load_file(src / "model.safetensors")
tok = AutoTokenizer.from_pretrained("assets/pycode-tiny")
samples, _ = load_samples(
    sys.argv[3] if len(sys.argv) > 3 else sysconfig.get_paths()["stdlib"],
    tok,
    max_length=2048,
    on_bad="skip",
    max_samples=1500,
)
counts = torch.zeros(16384, dtype=torch.int64)
for s in samples:
    counts += torch.bincount(torch.as_tensor(s.input_ids, dtype=torch.int64), minlength=16384)
V = sd["d2t"].numel()
tids = sd["d2t"] + torch.arange(V)
order = torch.sort(counts[tids], descending=True, stable=True).indices[:N]
keep = torch.sort(order).values  # draft ids kept, in target-id order
d2t, t2d = ids_to_mappings(tids[keep], 16384)
sd["d2t"], sd["t2d"], sd["lm_head.weight"] = d2t, t2d, sd["lm_head.weight"][keep].contiguous()
out.mkdir(parents=True, exist_ok=True)
save_file(sd, out / "model.safetensors")
cfg = json.loads((src / "config.json").read_text())
cfg["draft_vocab_size"] = N
(out / "config.json").write_text(json.dumps(cfg, indent=2))
cov = counts[tids[keep]].sum() / counts.sum()
print(
    "kept",
    N,
    "coverage of local stdlib tokens",
    float(cov),
    "full draft vocab coverage",
    float(counts[tids].sum() / counts.sum()),
)
