"""`draftsmith bench-endpoint`: streamed requests against any OpenAI-compatible server (SGLang, vLLM, draftsmith).

Per request (streamed, `stream_options.include_usage` asked for): time to first token (first non-empty text
chunk), the gaps between text chunks (inter-token latency: a speculative server sends several tokens in one chunk,
so its gaps are per chunk, as in vLLM's benchmark), completion tokens (the usage chunk; the number of text chunks
when the server sends none), and tokens/s = completion tokens / (last chunk - request sent). The row's
`tokens_per_s` is the mean of that over the successful requests: with --concurrency 1 it is the single-stream
figure engines are compared by ("vLLM 82.5 / SGLang 63.6 / tuned SGLang 90.0 tok/s").
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import json
import sys
import time
from pathlib import Path

from draftsmith.common.errors import DraftsmithError

COLUMNS = [
    "label",
    "tokens_per_s",
    "ttft_ms_p50",
    "itl_ms_p50",
    "itl_ms_p99",
    "tpot_ms",
    "throughput_tok_s",
    "requests",
    "errors",
    "concurrency",
    "max_tokens",
    "date",
]


def load_prompts(path: Path) -> list[dict]:
    """[{"prompt": str} | {"messages": [...]}]: JSONL records (prompt, text, messages, EAGLE `turns`) or lines."""
    if not path.is_file():
        raise DraftsmithError(f"--prompts: {path}: not found")
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    is_jsonl = any(ln.strip().startswith("{") for ln in lines[:5])
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        if not is_jsonl:
            out.append({"prompt": ln.replace("\\n", "\n")})
            continue
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise DraftsmithError(f"{path}:{i}: expected a JSON object")
        if isinstance(rec.get("messages"), list):
            out.append({"messages": rec["messages"]})
        elif isinstance(rec.get("prompt"), str):
            out.append({"prompt": rec["prompt"]})
        elif isinstance(rec.get("text"), str):
            out.append({"prompt": rec["text"]})
        elif isinstance(rec.get("turns"), list) and rec["turns"]:
            out.append({"messages": [{"role": "user", "content": str(rec["turns"][0])}]})
        else:
            raise DraftsmithError(f"{path}:{i}: no 'prompt', 'text', 'messages' or 'turns' field")
    if not out:
        raise DraftsmithError(f"--prompts: {path}: no prompts")
    return out


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def one_request(
    client, base: str, model: str, item: dict, max_tokens: int, temperature: float, chat: bool, headers: dict
) -> dict:
    """Send one streamed request; returns {ok, error, ttft, gaps, tokens, elapsed}."""
    use_chat = chat or "messages" in item
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if use_chat:
        body["messages"] = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
        path = "/chat/completions"
    else:
        body["prompt"] = item["prompt"]
        path = "/completions"
    t0 = time.perf_counter()
    times: list[float] = []
    usage_tokens = None
    try:
        with client.stream("POST", base + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = r.read().decode("utf-8", "replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except Exception:
                    pass
                return {"ok": False, "error": f"HTTP {r.status_code}: {text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    return {"ok": False, "error": str(obj["error"].get("message", obj["error"]))[:200]}
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                for c in obj.get("choices") or []:
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece:
                        times.append(time.perf_counter())
    except Exception as e:  # connection refused, timeout, malformed stream
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    t_end = times[-1] if times else time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else len(times)
    return {
        "ok": True,
        "error": None,
        "ttft": (times[0] - t0) if times else None,
        "gaps": [b - a for a, b in zip(times, times[1:])],
        "tokens": int(tokens),
        "elapsed": t_end - t0,
        "decode_s": (t_end - times[0]) if times else 0.0,
    }


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    gaps = [g for r in ok for g in r["gaps"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    rates = [r["tokens"] / r["elapsed"] for r in ok if r["elapsed"] > 0 and r["tokens"]]
    tpots = [r["decode_s"] / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]

    def ms(x):
        return None if x is None else x * 1e3

    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "requests": len(results),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "tokens_per_s": sum(rates) / len(rates) if rates else None,
        "ttft_ms_p50": ms(_percentile(ttfts, 0.5)),
        "ttft_ms_mean": ms(sum(ttfts) / len(ttfts)) if ttfts else None,
        "itl_ms_p50": ms(_percentile(gaps, 0.5)),
        "itl_ms_p99": ms(_percentile(gaps, 0.99)),
        "tpot_ms": ms(sum(tpots) / len(tpots)) if tpots else None,
        "completion_tokens": sum(r["tokens"] for r in ok),
        "throughput_tok_s": sum(r["tokens"] for r in ok) / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
    }


def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for i, ln in enumerate(path.read_text().splitlines(), 1):
            if ln.strip():
                try:
                    rows.append(json.loads(ln))
                except json.JSONDecodeError:
                    print(f"warning: {path}:{i}: not JSON, skipped", file=sys.stderr)
    return rows


def print_table(rows: list[dict], file=None) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text


def write_chart(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    labels = [str(r.get("label")) for r in rows]
    vals = [r.get("tokens_per_s") or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.5))
    bars = ax.bar(range(len(rows)), vals, color="#4C72B0")
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("streamed tokens/s per request")
    ax.set_title("bench-endpoint: single-stream tokens/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def run_bench(
    url: str,
    prompts_path: Path,
    model: str | None,
    max_tokens: int,
    concurrency: int,
    num_requests: int | None,
    label: str | None,
    out: Path,
    api_key: str | None,
    temperature: float,
    chat: bool,
    timeout: float,
    progress: bool = True,
) -> dict:
    import httpx
    from tqdm.auto import tqdm

    items = load_prompts(Path(prompts_path))
    base = _base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n_req = num_requests if num_requests is not None else len(items)
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), limits=limits) as client:
        if model is None:
            try:
                r = client.get(base + "/models", headers=headers)
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            except Exception as e:
                raise DraftsmithError(
                    f"--url {url}: could not list models ({type(e).__name__}: {e}); pass --model"
                ) from None
        results: list[dict] = []
        bar = tqdm(
            total=n_req, desc="bench-endpoint", unit="req", disable=not progress, file=sys.stderr, dynamic_ncols=True
        )
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [
                pool.submit(
                    one_request, client, base, model, items[i % len(items)], max_tokens, temperature, chat, headers
                )
                for i in range(n_req)
            ]
            for f in cf.as_completed(futures):
                results.append(f.result())
                bar.update(1)
        wall = time.perf_counter() - t0
        bar.close()
    row = {
        "label": label or url,
        "url": url,
        "model": model,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        **summarize(results, wall),
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    rows = read_rows(out / "results.jsonl")
    print_table(rows)
    chart = write_chart(rows, out / "results.png")
    if row["errors"]:
        print(
            f"{row['errors']} of {row['requests']} requests failed, e.g.: {row['error_examples'][0]}", file=sys.stderr
        )
    print(
        f"wrote {out / 'results.jsonl'}" + (f" and {chart}" if chart else " (install matplotlib for the chart)"),
        file=sys.stderr,
    )
    return row
