"""`draftsmith serve` overhead: streamed HTTP tokens/s against the engine's own `generate` tokens/s on the same
prompts and settings, and the cost of capture while serving.

For each setting (plain decoding; a drafter's chain rounds): the engine in this process generates every prompt
(greedy, the same cache size and settings the server uses), then a `draftsmith serve` process on loopback gets the
same prompts one at a time as streamed /v1/completions requests. Per request: engine tokens/s = new tokens /
(prefill + decode seconds); HTTP tokens/s = completion tokens / (last chunk received - request sent), so the HTTP
figure carries everything the server adds (JSON, tokenization, the queue hand-off, per-round SSE chunks, the
client's parsing). Capture: the drafter setting again with --capture-to; back-to-back throughput (total tokens /
wall time of the sequential run) includes its per-request states forward, which runs after each response.

    python bench/serve.py --target T --drafter D [--prompts humaneval.jsonl] [--num-prompts 8] [--new-tokens 256]
    python bench/serve.py --target T --train-drafter-s 90 --train-data DIR   # train a drafter online first
    python bench/serve.py --smoke                                            # CPU: pycode-tiny, random drafter
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, markdown_table, record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_prompts(path: str | None, limit: int) -> list[str]:
    if path is None:
        recs = [json.loads(ln) for ln in open(REPO / "assets" / "demo_prompts.jsonl")]
        return [r["text"] for r in recs][:limit]
    out = []
    for ln in open(path):
        r = json.loads(ln)
        text = r["turns"][0] if "turns" in r else r.get("prompt") or r["text"]
        if text.startswith("Complete the code I provided."):  # HumanEval in EAGLE's question format: the code only
            text = text.split("\n", 1)[1]
        out.append(text)
        if len(out) >= limit:
            break
    return out


def engine_run(target, drafter, prompts, args, max_model_len):
    """The engine's own generate on every prompt: [(token_ids, seconds)]; as `draftsmith serve` builds it."""
    import torch

    from draftsmith.decode.cli import _engine, _load, _mode
    from draftsmith.decode.engine import DecodeMode
    from draftsmith.decode.sampling import SamplingParams

    t, d = _load(target, drafter, args.device, "auto")
    mode = _mode(drafter is None, False, args.draft_tokens, 8, 5, 32, d)
    eng = _engine(t, d, max_model_len + mode.cache_need + 2, "auto", True)
    sp = SamplingParams()
    eng.warmup(mode, sp)
    if mode.kind != "plain":
        eng.warmup(DecodeMode("plain"), sp)
    ids = [t.tokenizer(p)["input_ids"] for p in prompts]
    for p in ids[:2]:
        eng.generate(p, min(32, args.new_tokens), sampling=sp, mode=mode)
    out = []
    for p in ids:
        r = eng.generate(p, args.new_tokens, sampling=sp, mode=mode)
        out.append((r.token_ids, r.prefill_s + r.decode_s, r.tau))
    del eng, t, d
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def http_run(target, drafter, prompts, args, max_model_len, capture_to=None):
    """A `draftsmith serve` process; the prompts one at a time, streamed. Returns (rows, wall_s, log text)."""
    import httpx

    from draftsmith.serve.bench_endpoint import one_request

    port = _free_port()
    cmd = [sys.executable, "-m", "draftsmith", "serve", "--target", target, "--port", str(port), "--device",
           args.device, "--max-model-len", str(max_model_len), "--log-level", "info"]
    if drafter:
        cmd += ["--drafter", drafter, "--draft-tokens", str(args.draft_tokens)]
    if capture_to:
        cmd += ["--capture-to", str(capture_to)]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start:\n{Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with httpx.Client(timeout=600) as client:
            for p in prompts[:2]:  # warm-up (first-request costs: allocator, tokenizer caches)
                one_request(client, base + "/v1", None, {"prompt": p}, min(32, args.new_tokens), 0.0, False, {})
            rows = []
            t0 = time.perf_counter()
            for p in prompts:
                r = one_request(client, base + "/v1", None, {"prompt": p}, args.new_tokens, 0.0, False, {})
                if not r["ok"]:
                    raise RuntimeError(f"request failed: {r['error']}")
                rows.append(r)
            wall = time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows, wall, Path(log.name).read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None, help="A trained drafter; 'random' = untrained (τ ~ 1).")
    ap.add_argument("--train-drafter-s", type=float, default=0, help="Train a drafter online for this long first.")
    ap.add_argument("--train-data", default=None, help="Directory of .py files for --train-drafter-s.")
    ap.add_argument("--train-steps", type=int, default=600, help="The LR schedule's length for --train-drafter-s "
                    "(training stops at --train-drafter-s either way).")
    ap.add_argument("--prompts", default=None, help="HumanEval (EAGLE question JSONL) or JSONL with text/prompt.")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-capture", action="store_true", help="Skip the capture-while-serving measurement.")
    ap.add_argument("--smoke", action="store_true", help="CPU: pycode-tiny, 3 prompts, 32 tokens, random drafter.")
    args = ap.parse_args()
    if args.smoke:
        args.target = args.target or str(REPO / "assets" / "pycode-tiny")
        args.drafter = args.drafter or "random"
        args.num_prompts, args.new_tokens = min(args.num_prompts, 3), min(args.new_tokens, 32)
    if not args.target:
        ap.error("--target is required (or --smoke)")
    import torch

    from draftsmith.target_model.load import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    drafter, drafter_note = args.drafter, args.drafter
    if args.train_drafter_s > 0:
        if not args.train_data:
            ap.error("--train-drafter-s needs --train-data")
        run = work / "run"
        t0 = time.time()
        cmd = [sys.executable, "-m", "draftsmith", "train", "--target", args.target, "--online", "--data",
               args.train_data, "--out", str(run), "--steps", str(args.train_steps), "--lr", "3e-4", "--max-time",
               str(args.train_drafter_s), "--compile", "off"]
        try:  # bounded: loading and the last checkpoint come on top of --max-time
            done = subprocess.run(cmd, cwd=str(REPO), timeout=args.train_drafter_s + 150)
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess(cmd, -9)
        if done.returncode == 0 and (run / "final").is_dir():
            drafter = str(run / "final")
            drafter_note = f"trained online for {args.train_drafter_s:g} s ({time.time() - t0:.0f} s with loading)"
        else:  # the overhead ratio is still measurable with an untrained drafter
            drafter = "random"
            print(f"training failed (exit {done.returncode}): using a random drafter", file=sys.stderr)
    if drafter == "random":
        from draftsmith.drafter import Drafter
        from draftsmith.target_model import load_target

        torch.manual_seed(0)
        drafter = str(work / "random_drafter")
        Drafter.from_target(load_target(args.target, dtype="fp32"), draft_vocab_size=2048).save_pretrained(drafter)
        drafter_note = "random (untrained: τ ~ 1)"

    prompts = load_prompts(args.prompts, args.num_prompts)
    tok = load_tokenizer(args.target)
    max_model_len = max(len(tok(p)["input_ids"]) for p in prompts) + args.new_tokens + 16
    settings = [("plain", None)] + ([(f"chain {args.draft_tokens}", drafter)] if drafter else [])
    rows, data = [], {"settings": [], "drafter": drafter_note, "prompts": len(prompts), "new_tokens": args.new_tokens}
    for name, d in settings:
        try:
            eng = engine_run(args.target, d, prompts, args, max_model_len)
        except Exception as e:  # record what was measured, say what failed
            data.setdefault("errors", []).append(f"{name}: engine: {type(e).__name__}: {e}")
            continue
        runs = [("", None)]
        if d and not args.no_capture:
            runs.append((" + capture", work / f"store_{len(rows)}"))
        for suffix, cap in runs:
            try:
                http, wall, log = http_run(args.target, d, prompts, args, max_model_len, capture_to=cap)
            except Exception as e:
                data.setdefault("errors", []).append(f"{name}{suffix}: server: {type(e).__name__}: {str(e)[-500:]}")
                continue
            eng_tps = [len(ids) / s for ids, s, _ in eng]
            http_tps = [r["tokens"] / r["elapsed"] for r in http]
            same_tokens = sum(len(ids) == r["tokens"] for (ids, _, _), r in zip(eng, http))
            eng_mean, http_mean = sum(eng_tps) / len(eng_tps), sum(http_tps) / len(http_tps)
            ttft_ms = 1e3 * sum(r["ttft"] for r in http) / len(http)
            extra_ms = 1e3 * sum(r["elapsed"] - s for (_, s, _), r in zip(eng, http)) / len(http)
            capture_s = None
            if cap:
                for ln in log.splitlines():
                    if "states forward" in ln:
                        capture_s = float(ln.split("states forward")[1].split()[0])
            row = {"setting": name + suffix, "engine_tok_s": eng_mean, "http_tok_s": http_mean,
                   "ratio": http_mean / eng_mean, "b2b_tok_s": sum(r["tokens"] for r in http) / wall,
                   "http_ttft_ms": ttft_ms, "http_extra_ms_per_req": extra_ms,
                   "tau": sum(t for _, _, t in eng) / len(eng), "same_len": f"{same_tokens}/{len(http)}",
                   "capture_forward_s": capture_s}
            rows.append(row)
            data["settings"].append(row)
            print(json.dumps(row), flush=True)
    base = {r["setting"]: r for r in rows}
    for r in rows:
        if r["setting"].endswith(" + capture") and r["setting"][: -len(" + capture")] in base:
            ref = base[r["setting"][: -len(" + capture")]]
            r["capture_b2b_vs_plain_serve"] = r["b2b_tok_s"] / ref["b2b_tok_s"]
    cols = ["setting", "engine_tok_s", "http_tok_s", "ratio", "b2b_tok_s", "http_ttft_ms", "http_extra_ms_per_req",
            "tau", "same_len", "capture_forward_s", "capture_b2b_vs_plain_serve"]
    body = (f"{Path(args.target).name}, {len(prompts)} prompts x {args.new_tokens} new tokens, greedy, drafter: "
            f"{drafter_note}. ratio = streamed HTTP tok/s / engine generate tok/s (per request, mean); b2b = "
            "back-to-back throughput of the sequential run; capture: served with --capture-to.\n\n"
            + markdown_table(rows, cols) + "".join(f"\n\nfailed: {e}" for e in data.get("errors", [])))
    record("serve", f"serve: HTTP vs engine tokens/s, capture while serving ({Path(args.target).name})", body, data,
           "python bench/serve.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
