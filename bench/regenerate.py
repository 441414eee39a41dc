"""`draftsmith regenerate` throughput: output tokens/s of transformers generate() at batch 1 vs the batch size
regenerate uses (dynamic and static KV cache), and of the whole command (issue 18).

The target gets a minimal chat template (its own tokens only); the conversations are built from the function
signatures of this Python's standard library (every machine has them), one user turn and one assistant turn each.

Usage:  python bench/regenerate.py [--target assets/pycode-tiny] [--batch-size 64] [--prompts 256]
        [--max-new-tokens 128] [--batch1-prompts 16]
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import markdown_table, record  # noqa: E402

TEMPLATE = (
    "{%- for m in messages %}### {{ m['role'] }}<|pad|>{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}### assistant<|pad|>{% endif %}"
)


def stdlib_prompts(n: int) -> list[str]:
    out = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                sig = f'def {node.name}({ast.unparse(node.args)}):\n    """{ast.get_docstring(node)[:200]}"""\n'
                out.append(sig)
                if len(out) >= n:
                    return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="assets/pycode-tiny")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    import torch

    from draftsmith.regenerate import RegenerateConfig, run_regenerate
    from draftsmith.regenerate.job import _Generator, _prompt_ids
    from draftsmith.target_model import load_target

    tmp = Path(tempfile.mkdtemp())
    tgt = tmp / "target"
    shutil.copytree(args.target, tgt)
    tc = json.loads((tgt / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (tgt / "tokenizer_config.json").write_text(json.dumps(tc))
    texts = stdlib_prompts(args.prompts)
    data = tmp / "chats.jsonl"
    with open(data, "w") as f:
        for t in texts:
            f.write(
                json.dumps({"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "x"}]}) + "\n"
            )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(str(tgt), dtype="bf16" if dev == "cuda" else "fp32", device=dev)
    rows = []

    def measure(label, bs, cache, prompts):
        cfg = RegenerateConfig(
            target=str(tgt),
            data=str(data),
            out=str(tmp / "x.jsonl"),
            max_new_tokens=args.max_new_tokens,
            batch_size=bs,
            cache=cache,
            device=dev,
        )
        gen = _Generator(target, cfg)
        ids = [_prompt_ids(target.tokenizer, [{"role": "user", "content": t}], {}) for t in prompts]
        gen.generate(ids[:bs])  # warm-up (kernels, static cache allocation)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        toks = 0
        for i in range(0, len(ids), bs):
            # tokens kept in the output (stopped rows pad the rest of a batch: they are not counted)
            toks += sum(len(t) for t, _ in gen.generate(ids[i : i + bs]))
        if dev == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        rows.append(
            {
                "what": label,
                "batch": bs,
                "cache": cache,
                "prompts": len(ids),
                "new_tokens": toks,
                "seconds": s,
                "tok_s": toks / s,
            }
        )
        print(rows[-1], flush=True)

    measure("generate() batch 1", 1, "dynamic", texts[: args.batch1_prompts])
    measure("generate() batch 1, static cache", 1, "static", texts[: args.batch1_prompts])
    measure(f"generate() batch {args.batch_size}", args.batch_size, "dynamic", texts)
    measure(f"generate() batch {args.batch_size}, static cache", args.batch_size, "static", texts)
    t0 = time.perf_counter()
    rep = run_regenerate(
        RegenerateConfig(
            target=str(tgt),
            data=str(data),
            out=str(tmp / "regen.jsonl"),
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            device=dev,
        ),
        log=lambda s: None,
        progress=False,
    )
    s = time.perf_counter() - t0
    rows.append(
        {
            "what": f"draftsmith regenerate --batch-size {args.batch_size} (whole command, load included)",
            "batch": args.batch_size,
            "cache": "dynamic",
            "prompts": rep["records"],
            "new_tokens": rep["new_tokens"],
            "seconds": s,
            "tok_s": rep["new_tokens"] / s,
        }
    )
    base = rows[0]["tok_s"]
    for r in rows:
        r["vs_batch1"] = r["tok_s"] / base
    body = (
        f"Target {args.target} (bf16 on GPU), {args.max_new_tokens} new tokens max per answer, stdlib-signature "
        "prompts; tok/s counts the answer tokens kept (up to the end-of-turn token).\n\n"
        + markdown_table(rows, ["what", "batch", "cache", "prompts", "new_tokens", "seconds", "tok_s", "vs_batch1"])
    )
    print(body)
    if not args.no_record:
        record(
            "regenerate",
            "draftsmith regenerate: output tokens/s vs transformers generate() at batch 1",
            body,
            {"rows": rows},
            "python bench/regenerate.py " + " ".join(sys.argv[1:]),
        )


if __name__ == "__main__":
    main()
