"""`draftsmith serve` overhead: streamed HTTP tokens/s against the engine's own `generate` tokens/s on the same
prompts and settings, and the cost of capture while serving.

For each setting (plain decoding; a drafter's chain rounds): the engine in this process (greedy, the same cache
size and settings the server uses) and a `draftsmith serve` process on loopback (streamed /v1/completions) take
the same prompts, interleaved prompt by prompt. Engine tokens/s = new tokens / (prefill + decode seconds); HTTP
tokens/s = completion tokens / (last chunk received - request sent), both summed over the prompts before
dividing, so the HTTP figure carries everything the server adds (JSON, tokenization, the queue hand-off, per-round
SSE chunks, the client's parsing). Capture: a second server of each setting with --capture-to, timed back to
back in blocks alternating with the first server's: its rounds write their states into the engine's buffer (inside
the CUDA graphs) and each response ends with one device-to-host copy, so back-to-back throughput shows the whole
cost (on the generic HF path the server falls back to one extra target forward after each response).

    python bench/serve.py --target T --drafter D [--prompts humaneval.jsonl] [--num-prompts 8] [--new-tokens 256]
    python bench/serve.py --target T --train-drafter-s 90 --train-data DIR   # train a drafter online first
    python bench/serve.py --smoke                                            # CPU: pycode-tiny, random drafter
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


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


class EngineDirect:
    """The engine in this process, built as `draftsmith serve` builds it (same cache size and settings)."""

    def __init__(self, target, drafter, args, max_model_len, record_to=None):
        from draftsmith.decode.engine import DecodeMode
        from draftsmith.decode.sampling import SamplingParams
        from draftsmith.decode.setup import build_engine, decode_mode, load_models

        self.t, d = load_models(target, drafter, args.device, "auto")
        self.mode = decode_mode(drafter is None, False, args.draft_tokens, 8, 5, 32, d)
        self.eng = build_engine(self.t, d, max_model_len + self.mode.cache_need + 2, "auto", True)
        self.recorder = None
        if record_to is not None:  # as `serve --capture-to` records: the served forwards' states, a writer thread
            from draftsmith.serve.recorder import ServeRecorder

            self.eng.set_state_recording(True)
            self.recorder = ServeRecorder(record_to, self.t, self.eng.aux_layers, engine=self.eng)
        self.sp = SamplingParams()
        self.eng.warmup(self.mode, self.sp)
        if self.mode.kind != "plain":
            self.eng.warmup(DecodeMode("plain"), self.sp)
        self.new_tokens = args.new_tokens

    def run(self, prompt: str, new_tokens: int | None = None):
        """(token_ids, prefill + decode seconds, tau)"""
        ids = self.t.tokenizer(prompt)["input_ids"]
        r = self.eng.generate(ids, new_tokens or self.new_tokens, sampling=self.sp, mode=self.mode)
        if self.recorder is not None:
            self.recorder.record(ids, r.token_ids)
        return r.token_ids, r.prefill_s + r.decode_s, r.tau

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


class Served:
    """A `draftsmith serve` process on loopback; `request(prompt)` sends one streamed greedy completion."""

    def __init__(self, target, drafter, args, max_model_len, capture_to=None):
        import httpx

        self.port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "draftsmith",
            "serve",
            "--target",
            target,
            "--port",
            str(self.port),
            "--device",
            args.device,
            "--max-model-len",
            str(max_model_len),
            "--log-level",
            "info",
        ]
        if drafter:
            cmd += ["--drafter", drafter, "--draft-tokens", str(args.draft_tokens)]
        if capture_to:
            cmd += ["--capture-to", str(capture_to)]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO), env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.client = httpx.Client(timeout=600)
        self.new_tokens = args.new_tokens

    def wait_ready(self) -> None:
        import httpx

        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server did not start:\n{self.log_text()[-3000:]}")
            try:
                if self.client.get(self.base[:-3] + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def request(self, prompt: str, new_tokens: int | None = None) -> dict:
        from draftsmith.serve.bench_endpoint import one_request

        r = one_request(self.client, self.base, None, {"prompt": prompt}, new_tokens or self.new_tokens, 0.0, False, {})
        if not r["ok"]:
            raise RuntimeError(f"request failed: {r['error']}")
        return r

    def stop(self) -> str:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.log_text()

    def log_text(self) -> str:
        return Path(self.log.name).read_text()


def measure(target, drafter, prompts, args, max_model_len, capture_to=None, rounds=4):
    """Engine and server on the same prompts. Per prompt, interleaved (TTFT, equal lengths, τ); and back to back:
    each contender sends all prompts in sequence as one block, blocks alternating (engine, [recording engine],
    server, [capturing server]; the order rotating by one every round) for `rounds` rounds, so each runs alone on the GPU with its graphs warm, and a drift
    in the machine's load hits all alike. The ratios come from the blocks: interleaving one prompt at a time
    switches the GPU between processes' contexts on every request, which slowed engine and server alike (2026-12-01:
    1,436 tok/s interleaved vs 1,846 back to back for the same server). With capture_to: a second server with
    --capture-to and an engine in this process that records the same way (what recording costs without HTTP)."""
    import torch

    servers = [Served(target, drafter, args, max_model_len)]
    if capture_to:
        servers.append(Served(target, drafter, args, max_model_len, capture_to))
    engines = []
    try:
        engines.append(EngineDirect(target, drafter, args, max_model_len))
        if capture_to:
            engines.append(EngineDirect(target, drafter, args, max_model_len, Path(str(capture_to) + "_engine")))
        for srv in servers:
            srv.wait_ready()
        for p in prompts[:2]:  # warm-up (first-request costs: allocator, tokenizer caches)
            for eng in engines:
                eng.run(p, min(32, args.new_tokens))
            for srv in servers:
                srv.request(p, min(32, args.new_tokens))
        pairs = [(engines[0].run(p), servers[0].request(p)) for p in prompts]
        contenders = [("engine", e.run, lambda r: len(r[0])) for e in engines]
        contenders += [("server", s.request, lambda r: r["tokens"]) for s in servers]
        blocks = {i: [0, 0.0] for i in range(len(contenders))}  # contender -> [tokens, seconds] back to back
        for r in range(rounds):
            # the order rotates every round: the block right after another server's ran 7-10 % slower, whatever it
            # was (two identical servers without capture measured 0.90-0.93 of each other in a fixed order, 2026-12-01)
            n = len(contenders)
            for i in [(j + r) % n for j in range(n)]:
                _, fn, ntok = contenders[i]
                t0 = time.perf_counter()
                blocks[i][0] += sum(ntok(fn(p)) for p in prompts)
                blocks[i][1] += time.perf_counter() - t0
        for eng in engines:
            eng.close()
        del engines
    finally:
        logs = [srv.stop() for srv in servers]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    tok_s = [b[0] / b[1] for b in blocks.values()]
    b2b = {"engine": tok_s[0], "server": tok_s[len(tok_s) // 2] if capture_to else tok_s[1]}
    if capture_to:
        b2b.update(engine_rec=tok_s[1], server_capture=tok_s[3])
    return pairs, b2b, logs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None, help="A trained drafter; 'random' = untrained (τ ~ 1).")
    ap.add_argument("--train-drafter-s", type=float, default=0, help="Train a drafter online for this long first.")
    ap.add_argument("--train-data", default=None, help="Directory of .py files for --train-drafter-s.")
    ap.add_argument(
        "--train-steps",
        type=int,
        default=600,
        help="The LR schedule's length for --train-drafter-s (training stops at --train-drafter-s either way).",
    )
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
        cmd = [
            sys.executable,
            "-m",
            "draftsmith",
            "train",
            "--target",
            args.target,
            "--online",
            "--data",
            args.train_data,
            "--out",
            str(run),
            "--steps",
            str(args.train_steps),
            "--lr",
            "1e-3",
            "--max-time",
            str(args.train_drafter_s),
            "--compile",
            "off",
        ]
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
        cap = work / f"store_{len(rows)}" if not args.no_capture else None
        try:
            pairs, b2b, logs = measure(args.target, d, prompts, args, max_model_len, capture_to=cap)
        except Exception as e:  # record what was measured, say what failed
            data.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {str(e)[-500:]}")
            continue
        # tokens / seconds over all requests (a mean of per-request rates would let a prompt that ends at once on
        # EOS, all prefill, weigh as much as a full response)
        eng_mean = sum(len(ids) for (ids, _, _), _ in pairs) / sum(sec for (_, sec, _), _ in pairs)
        http_mean = sum(r["tokens"] for _, r in pairs) / sum(r["elapsed"] for _, r in pairs)
        row = {
            "setting": name,
            "engine_tok_s": eng_mean,
            "http_tok_s": http_mean,
            "ratio": http_mean / eng_mean,
            "b2b_engine_tok_s": b2b["engine"],
            "b2b_tok_s": b2b["server"],
            "b2b_ratio": b2b["server"] / b2b["engine"],
            "http_ttft_ms": 1e3 * _mean([r["ttft"] for _, r in pairs if r["ttft"] is not None]),
            "http_extra_ms_per_req": 1e3 * sum(r["elapsed"] - sec for (_, sec, _), r in pairs) / len(pairs),
            "tau": sum(e[2] for e, _ in pairs) / len(pairs),
            "same_len": f"{sum(len(e[0]) == r['tokens'] for e, r in pairs)}/{len(pairs)}",
        }
        # the servers' engine threads: generate tok/s over all their requests (warm-up and interleaved included)
        for i, key in enumerate(["server_engine_tok_s", "capture_server_engine_tok_s"][: len(logs)]):
            m = re.search(
                r"engine thread: \d+ requests, \d+ tokens in [0-9.]+ s of generate \(([0-9.]+) tok/s\)", logs[i]
            )
            row[key] = float(m.group(1)) if m else None
        if cap is not None:
            # the server's last line: "... (states from the served forwards; engine thread 0.012 s in all)"
            capture_s, how = None, None
            for ln in logs[1].splitlines():
                m = re.search(r"\((.+); engine thread ([0-9.]+) s in all\)", ln)
                if m:
                    how = "served" if "served forwards" in m.group(1) else "extra forward"
                    capture_s = float(m.group(2))
            row.update(
                {
                    "b2b_capture_tok_s": b2b["server_capture"],
                    "capture_vs_no_capture": b2b["server_capture"] / b2b["server"],
                    "engine_rec_vs_engine": b2b["engine_rec"] / b2b["engine"],
                    "capture_states": how,
                    "capture_engine_s": capture_s,
                }
            )
        rows.append(row)
        data["settings"].append(row)
        print(json.dumps(row), flush=True)
    cols = [
        "setting",
        "engine_tok_s",
        "http_tok_s",
        "ratio",
        "http_ttft_ms",
        "http_extra_ms_per_req",
        "tau",
        "same_len",
        "b2b_engine_tok_s",
        "b2b_tok_s",
        "b2b_ratio",
        "b2b_capture_tok_s",
        "capture_vs_no_capture",
        "engine_rec_vs_engine",
        "server_engine_tok_s",
        "capture_server_engine_tok_s",
        "capture_states",
        "capture_engine_s",
    ]
    body = (
        f"{Path(args.target).name}, {len(prompts)} prompts x {args.new_tokens} new tokens, greedy, drafter: "
        f"{drafter_note}. ratio = streamed HTTP tok/s / engine generate tok/s (all tokens / all seconds; "
        "engine and HTTP interleaved prompt by prompt: every request switches the GPU between two processes); "
        "b2b = back-to-back throughput of the prompts sent in sequence (4 blocks each, alternating engine, "
        "recording engine, server, capturing server, the order rotating every round); b2b_ratio = server / engine back to back (the overhead figure); "
        "capture_vs_no_capture = capturing server / server; server_engine_tok_s / capture_server_engine_tok_s = the "
        "servers' engine threads' own generate tok/s (all their requests); engine_rec_vs_engine = the same recording in this "
        "process without HTTP / the engine; capture_states = where the recorded states "
        "came from (served: the engine's own forwards; extra forward: one more target pass per request); "
        "capture_engine_s = the server's total engine-thread time in the recorder (the buffer slice, conversion and "
        "the copy's launch, or the extra forward).\n\n"
        + markdown_table(rows, cols)
        + "".join(f"\n\nfailed: {e}" for e in data.get("errors", []))
    )
    record(
        "serve",
        f"serve: HTTP vs engine tokens/s, capture while serving ({Path(args.target).name})",
        body,
        data,
        "python bench/serve.py " + " ".join(sys.argv[1:]),
    )


if __name__ == "__main__":
    main()
