"""`draftsmith capture`: run the target over data and write aux hidden states into a store.

Resumable by construction: the data is tokenized and cut into a deterministic shard plan before any
forward pass; each shard's batches are a function of its samples only; a shard becomes visible by an
atomic rename, and its progress record is written after that. Rerunning the same command after `kill -9`
at any moment redoes only shards without a progress record, and produces a store byte-identical to an
uninterrupted run. Under torchrun, shard i belongs to rank i % world, so N processes write exactly the
shards one process would.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from draftsmith import __version__
from draftsmith.capture.config import CaptureConfig  # re-exported: CaptureConfig lived here
from draftsmith.common.dist import barrier, dist_info, init_dist, resolve_device
from draftsmith.common.errors import DraftsmithError
from draftsmith.store import format as fmt
from draftsmith.target_model.layers import to_hidden_states_ids, validate_aux_layers
from draftsmith.common.io import atomic_save_file, atomic_save_safetensors_streaming, atomic_write_json, read_json


def _crash_point(name: str, index: int) -> None:
    """Fault injection for the resume tests: DRAFTSMITH_CRASH_AT=name:index kills this process (SIGKILL)."""
    spec = os.environ.get("DRAFTSMITH_CRASH_AT")
    if spec and spec == f"{name}:{index}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


# -- planning --------------------------------------------------------------------------------------
def plan_shards(lengths: np.ndarray, shard_tokens: int) -> list[tuple[int, int, int]]:
    """Consecutive samples into shards of at most `shard_tokens` tokens (at least one sample each).

    Returns [(first_sample, num_samples, num_tokens)].
    """
    shards = []
    first, tokens = 0, 0
    for i, n in enumerate(lengths.tolist()):
        if i > first and tokens + n > shard_tokens:
            shards.append((first, i - first, tokens))
            first, tokens = i, 0
        tokens += n
    if len(lengths) > first:
        shards.append((first, len(lengths) - first, tokens))
    return shards


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group a shard's samples (local indices) into right-padded batches of <= batch_tokens padded tokens.

    Longest first, so each batch's padding is small; a deterministic function of the lengths alone.
    """
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    batches, cur = [], []
    for j in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(j)
    if cur:
        batches.append(cur)
    return batches


def data_fingerprint(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(np.int64(len(s.input_ids)).tobytes())
        h.update(np.ascontiguousarray(s.input_ids, dtype=np.int32).tobytes())
        h.update(np.packbits(np.asarray(s.loss_mask, dtype=bool)).tobytes())
    return h.hexdigest()


# -- the job ---------------------------------------------------------------------------------------
class _ShardBuffers:
    """Host buffers one shard is assembled in (pinned on GPU machines so device->host copies are async)."""

    def __init__(self, num_tokens: int, aux_cols: int, hidden: int, k: int, dtype: str, with_final: bool, pin: bool):
        state_dtype = torch.bfloat16 if dtype == "bf16" else fmt.FP8_DTYPE
        kw = {"pin_memory": pin}
        self.capacity = num_tokens
        self.aux = torch.empty(num_tokens, aux_cols, dtype=state_dtype, **kw)
        self.final = torch.empty(num_tokens, hidden, dtype=state_dtype, **kw) if with_final else None
        self.aux_scale = torch.empty(num_tokens, k, dtype=torch.uint8, **kw) if dtype == "fp8" else None
        self.final_scale = torch.empty(num_tokens, dtype=torch.uint8, **kw) if dtype == "fp8" and with_final else None

    def view(self, num_tokens: int) -> "_ShardBuffers":
        """The first `num_tokens` rows (buffers are reused across shards: pinning memory is slow)."""
        v = object.__new__(_ShardBuffers)
        v.capacity = num_tokens
        for name in ("aux", "final", "aux_scale", "final_scale"):
            t = getattr(self, name)
            setattr(v, name, None if t is None else t[:num_tokens])
        return v


def run_capture(cfg: CaptureConfig, log=print, target=None, stats: dict | None = None, samples=None) -> dict:
    """Capture (or resume capturing) a store. Returns the manifest.

    `target`: an already loaded `Target` (benchmarks and tests build random models in memory); `stats`: a
    dict that receives timings (capture seconds, writer seconds, bytes written); `samples`: already
    tokenized samples (skips reading `cfg.data`).
    """
    from draftsmith.data import load_samples
    from draftsmith.capture import AuxCapture
    from draftsmith.target_model import load_target
    from draftsmith.target_model.load import load_tokenizer

    if cfg.dtype not in fmt.STORE_DTYPES:
        raise DraftsmithError(f"--dtype: {cfg.dtype!r} is not a store dtype (choose bf16 or fp8)")
    if cfg.on_bad not in ("error", "skip"):
        raise DraftsmithError(f"--on-bad: {cfg.on_bad!r} (choose error or skip)")
    if cfg.batch_tokens < 1:
        raise DraftsmithError("--batch-tokens must be >= 1")
    if cfg.max_length is not None and cfg.max_length < 1:
        raise DraftsmithError("--max-length must be >= 1")

    rank, world, local_rank = dist_info()
    device = resolve_device(cfg.device, local_rank)
    if world > 1:
        init_dist(world, "nccl" if device.type == "cuda" else "gloo")
    is_main = rank == 0
    say = log if is_main else (lambda *a, **k: None)
    # With tensor parallelism every rank runs every batch (the model is split, not the data).
    data_world, data_rank = (1, 0) if cfg.tp else (world, rank)
    writer = (rank == 0) if cfg.tp else True

    if target is None and not Path(cfg.target).is_dir():
        raise DraftsmithError(f"{cfg.target}: target not found (expected a Hugging Face model directory)")
    if not cfg.progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    # Data first: a bad record fails in a second, not after loading a large model.
    tokenizer = target.tokenizer if target is not None else load_tokenizer(cfg.target)
    t0 = time.time()
    if samples is None:
        samples, report = load_samples(
            cfg.data, tokenizer, max_length=cfg.max_length, on_bad=cfg.on_bad,
            glob=cfg.glob, split_long=cfg.split_long, add_bos=cfg.add_bos,
        )
        say(f"data: {report.summary()} ({time.time() - t0:.1f}s)")
    else:
        from draftsmith.data import DataReport

        report = DataReport(total=len(samples), kept=len(samples), samples=len(samples))
    if not samples:
        raise DraftsmithError(f"{cfg.data}: no usable samples")
    if cfg.max_samples is not None:
        samples = samples[: cfg.max_samples]

    model_dtype = cfg.model_dtype
    if model_dtype == "auto":
        model_dtype = "bf16" if device.type == "cuda" else "auto"
    if target is None:
        target = load_target(cfg.target, dtype=model_dtype, device=device, tp_plan="auto" if cfg.tp else None,
                             tokenizer=tokenizer)
    aux_layers = validate_aux_layers(cfg.aux_layers or target.default_aux_layers, target.num_layers)
    H, k = target.hidden_size, len(aux_layers)

    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    bpt = fmt.bytes_per_token(H, k, cfg.dtype, cfg.capture_final)
    shard_tokens = cfg.shard_tokens or max(1024, int(cfg.shard_mb * 2**20 // bpt))
    shards = plan_shards(lengths, shard_tokens)

    out = Path(cfg.out)
    plan = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "target": target.identity(),
        "data": {"path": str(cfg.data), "fingerprint": data_fingerprint(samples), "num_samples": len(samples)},
        "aux_layers": aux_layers,
        "capture_final": cfg.capture_final,
        "dtype": cfg.dtype,
        "max_length": cfg.max_length,
        "batch_tokens": cfg.batch_tokens,
        "shard_tokens": shard_tokens,
        "cuda_graphs": cfg.cuda_graphs,
        "shards": [list(s) for s in shards],
    }
    _check_or_write_plan(out, plan, is_main, world)
    if (out / fmt.MANIFEST).is_file():
        say(f"{out}: already complete ({len(samples)} samples); nothing to do")
        return read_json(out / fmt.MANIFEST)

    mine = [si for si in range(len(shards)) if si % data_world == data_rank]
    todo = [si for si in mine if not _shard_done(out, si)]
    if len(todo) < len(mine):
        log(f"resuming: {len(mine) - len(todo)} of rank {rank}'s {len(mine)} shard(s) already committed")

    cap = AuxCapture(target, aux_layers, capture_final=cfg.capture_final)
    graphs: dict = {}
    pin = device.type == "cuda"
    pad_id = target.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = 0
    from tqdm.auto import tqdm

    bar = tqdm(
        total=int(sum(shards[si][2] for si in todo)), unit="tok", unit_scale=True, desc=f"capture[{rank}]",
        disable=not (cfg.progress and (is_main or not cfg.tp)), dynamic_ncols=True, file=sys.stderr,
    )
    # Shards are written by `writers` threads while the GPU fills the next shard's buffers; writers+1 sets
    # of host buffers rotate, so memory stays bounded and pinned buffers are allocated once.
    n_sets = cfg.writers + 1
    pool = cf.ThreadPoolExecutor(max_workers=cfg.writers)
    writes: list[cf.Future] = []
    buffers: list = []
    slot_future: list[cf.Future | None] = [None] * n_sets
    n_done = 0
    max_tok = max((shards[j][2] for j in todo), default=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_start = time.time()
    captured_tokens = 0
    alloc_s = 0.0  # pinned shard buffers, allocated on first use (fixed cost: n_sets allocations per run)
    with torch.no_grad():
        for si in todo:
            first, n, ntok = shards[si]
            shard_samples = samples[first : first + n]
            slen = [len(s.input_ids) for s in shard_samples]
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(slen, out=offsets[1:])
            slot = n_done % n_sets
            if slot_future[slot] is not None:
                slot_future[slot].result()  # that buffer set's shard is on disk: reuse it
            if slot == len(buffers):
                ta = time.time()
                buffers.append(_ShardBuffers(max_tok, k * H, H, k, cfg.dtype, cfg.capture_final, pin))
                alloc_s += time.time() - ta
            buf = buffers[slot].view(ntok)
            n_done += 1
            pending = None
            for batch in plan_batches(slen, cfg.batch_tokens):
                res = _run_batch(target, cap, graphs, cfg, batch, shard_samples, slen, offsets, pad_id, device, H)
                if pending is not None:
                    _land(buf, pending, cfg.dtype)
                pending = res
                bar.update(int(sum(slen[j] for j in batch)))
            if pending is not None:
                _land(buf, pending, cfg.dtype)
            if writer:
                slot_future[slot] = pool.submit(_write_shard, out, si, first, shard_samples, offsets, buf, cfg)
                writes.append(slot_future[slot])
            captured_tokens += ntok
        t_drain = time.time()  # the last shards' writes, no longer overlapped by GPU work (fixed cost)
        for f in writes:
            f.result()
        drain_s = time.time() - t_drain
    pool.shutdown()
    bar.close()
    elapsed = time.time() - t_start
    if stats is not None:
        stats.update(
            capture_s=elapsed, alloc_s=alloc_s, drain_s=drain_s, tokens=captured_tokens,
            write_s=sum(f.result()[0] for f in writes),
            bytes_written=sum(f.result()[1] for f in writes), shards=len(writes), graphs=len(graphs),
        )
    if captured_tokens:
        say(f"captured {captured_tokens} tokens in {elapsed:.1f}s ({captured_tokens / max(elapsed, 1e-9):,.0f} tok/s on rank {rank})")

    barrier(world)
    manifest = None
    if is_main:
        manifest = _finalize(out, plan, samples, report, target, aux_layers, shards, cfg)
        say(f"wrote {out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, {len(shards)} shard(s)")
    barrier(world)
    if manifest is None:
        manifest = read_json(out / fmt.MANIFEST)
    return manifest


def _check_or_write_plan(out: Path, plan: dict, is_main: bool, world: int) -> None:
    """Rank 0 writes the plan (or checks it on resume); other ranks check it after a barrier."""
    ppath = out / fmt.PLAN

    def check() -> None:
        old = read_json(ppath, "capture plan")
        for key in plan:
            if old.get(key) != plan[key]:
                raise DraftsmithError(
                    f"{ppath}: field {key!r} differs from this command's — {out} was started with other "
                    f"settings or data; use a new --out (or delete {out} to start over)"
                )

    def is_leftover(p: Path) -> bool:
        return p.name.startswith(".") and p.name.endswith(".tmp")

    if is_main:
        if ppath.is_file():
            check()
            for d in (fmt.SHARD_DIR, fmt.PROGRESS_DIR, "."):  # writes a kill interrupted (never visible)
                for tmp in (out / d).glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
        else:
            if out.exists() and any(
                p.name not in (fmt.SHARD_DIR, fmt.PROGRESS_DIR) and not is_leftover(p) for p in out.iterdir()
            ):
                raise DraftsmithError(f"{out}: exists and is not a draftsmith store in progress; choose another --out")
            (out / fmt.SHARD_DIR).mkdir(parents=True, exist_ok=True)
            (out / fmt.PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
            for tmp in out.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            atomic_write_json(ppath, plan)
    barrier(world)
    if not is_main:
        check()


def _shard_done(out: Path, si: int) -> bool:
    return (out / fmt.progress_name(si)).is_file() and (out / fmt.shard_name(si)).is_file()


def _run_batch(target, cap, graphs, cfg, batch, shard_samples, slen, offsets, pad_id, device, H):
    """Forward one right-padded batch; gather real tokens on device; start the copy to the host."""
    L = max(slen[j] for j in batch)
    B = len(batch)
    if cfg.cuda_graphs and device.type == "cuda":
        from draftsmith.capture.graphs import GraphedCapture, bucket_seq_len

        Lb = bucket_seq_len(L, cfg.max_length or L)
        Bb = max(B, max(1, cfg.batch_tokens // Lb))
        key = (Bb, Lb)
        if key not in graphs:
            graphs[key] = GraphedCapture(target, cap.aux_layers, Bb, Lb, capture_final=cfg.capture_final)
        ids = torch.full((Bb, Lb), pad_id, dtype=torch.long)
        for r, j in enumerate(batch):
            ids[r, : slen[j]] = torch.from_numpy(shard_samples[j].input_ids.astype(np.int64))
        aux, final = graphs[key](ids.to(device, non_blocking=True))
        Lrow = Lb
    else:
        ids = torch.full((B, L), pad_id, dtype=torch.long)
        for r, j in enumerate(batch):
            ids[r, : slen[j]] = torch.from_numpy(shard_samples[j].input_ids.astype(np.int64))
        # No attention mask: right padding under a causal mask never reaches a real token.
        with cap:
            target.decoder(input_ids=ids.to(device, non_blocking=True), use_cache=False)
        aux, final = cap.aux, cap.final
        Lrow = L
    # Source rows (in the padded batch) and destination rows (in the shard), in matching order.
    src = np.concatenate([r * Lrow + np.arange(slen[j]) for r, j in enumerate(batch)])
    dst = np.concatenate([offsets[j] + np.arange(slen[j]) for j in batch])
    src_t = torch.from_numpy(src).to(device, non_blocking=True)
    aux_rows = aux.reshape(-1, aux.shape[-1]).index_select(0, src_t)
    final_rows = final.reshape(-1, H).index_select(0, src_t) if final is not None else None
    if cfg.dtype == "fp8":
        aux_q, aux_s = fmt.quantize_fp8_rows(aux_rows, H)
        parts = [aux_q, aux_s]
        if final_rows is not None:
            fq, fs = fmt.quantize_fp8_rows(final_rows, H)
            parts += [fq, fs.reshape(-1)]
    else:
        parts = [aux_rows.to(torch.bfloat16)]
        if final_rows is not None:
            parts.append(final_rows.to(torch.bfloat16))
    if device.type == "cuda":
        # Device->host copies on a side stream: the next batch's forward overlaps them.
        copy_stream = _copy_stream(device)
        copy_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(copy_stream):
            host = [p.to("cpu", non_blocking=True) for p in parts]  # pinned destinations (non_blocking D2H)
            ev = torch.cuda.Event()
            ev.record(copy_stream)
        for p in parts:
            p.record_stream(copy_stream)
    else:
        host, ev = parts, None
    return torch.from_numpy(dst), host, ev


_COPY_STREAMS: dict = {}


def _copy_stream(device: torch.device):
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


def _land(buf: _ShardBuffers, pending, dtype: str) -> None:
    dst, host, ev = pending
    if ev is not None:
        ev.synchronize()
    # fp8 has no CPU index_copy kernel: move the rows as raw bytes (same thing, any dtype)
    targets = [buf.aux, buf.aux_scale, buf.final, buf.final_scale] if dtype == "fp8" else [buf.aux, buf.final]
    for dest, rows in zip([t for t in targets if t is not None], host):
        if dest.dtype.itemsize == 1:
            dest.view(torch.uint8).index_copy_(0, dst, rows.view(torch.uint8))
        else:
            dest.index_copy_(0, dst, rows)


def _write_shard(out: Path, si: int, first: int, shard_samples, offsets, buf: _ShardBuffers, cfg) -> None:
    n = len(shard_samples)
    ids = np.concatenate([s.input_ids for s in shard_samples]).astype(np.int32)
    spans = [fmt.mask_to_spans(s.loss_mask) for s in shard_samples]
    span_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(s) for s in spans], out=span_offsets[1:])
    tensors = {
        "input_ids": torch.from_numpy(ids),
        "sample_offsets": torch.from_numpy(offsets),
        "sample_index": torch.arange(first, first + n, dtype=torch.int64),
        "loss_spans": torch.from_numpy(np.concatenate(spans).reshape(-1, 2).astype(np.int32)),
        "span_offsets": torch.from_numpy(span_offsets),
        "aux_hidden_states": buf.aux,
    }
    if buf.final is not None:
        tensors["final_hidden_states"] = buf.final
    if buf.aux_scale is not None:
        tensors["aux_scale"] = buf.aux_scale
    if buf.final_scale is not None:
        tensors["final_scale"] = buf.final_scale
    t0 = time.perf_counter()
    path = out / fmt.shard_name(si)
    _crash_point("before_shard", si)
    digest, nbytes = atomic_save_safetensors_streaming(
        tensors, path, metadata={"format": f"{fmt.FORMAT_NAME}:shard-{si:05d}"}
    )
    _crash_point("after_shard", si)
    record = {
        "file": fmt.shard_name(si),
        "sha256": digest,
        "bytes": nbytes,
        "first_sample": first,
        "num_samples": n,
        "num_tokens": int(offsets[-1]),
        "num_loss_tokens": int(sum(int(s.loss_mask.sum()) for s in shard_samples)),
    }
    atomic_write_json(out / fmt.progress_name(si), record)
    _crash_point("after_progress", si)
    return time.perf_counter() - t0, record["bytes"]


def _finalize(out: Path, plan, samples, report, target, aux_layers, shards, cfg) -> dict:
    records = []
    for si in range(len(shards)):
        p = out / fmt.progress_name(si)
        if not p.is_file():
            raise DraftsmithError(f"{p}: missing after capture — a rank failed; rerun the command to resume")
        records.append(read_json(p))
    counts = torch.zeros(target.vocab_size, dtype=torch.int64)
    for s in samples:
        ids = torch.from_numpy(np.asarray(s.input_ids, dtype=np.int64)[np.asarray(s.loss_mask, dtype=bool)])
        if ids.numel():
            counts.index_add_(0, ids.clamp(0, target.vocab_size - 1), torch.ones_like(ids))
    _crash_point("before_finalize", 0)
    counts_sha = atomic_save_file({"token_counts": counts}, out / fmt.TOKEN_COUNTS)
    num_tokens = int(sum(r["num_tokens"] for r in records))
    manifest = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "draftsmith_version": __version__,
        "target": target.identity(),
        "aux_layers": aux_layers,
        "aux_layers_convention": "layer-output",
        "aux_hidden_states_ids": to_hidden_states_ids(aux_layers),
        "num_aux": len(aux_layers),
        "has_final": bool(cfg.capture_final),
        "final_layer": target.num_layers - 1,
        "final_is_pre_norm": True,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": cfg.dtype,
        "fp8_scale": "power-of-two per (token, layer) row, uint8 exponent+127" if cfg.dtype == "fp8" else None,
        "max_length": cfg.max_length,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "num_loss_tokens": int(sum(r["num_loss_tokens"] for r in records)),
        "bytes_per_token": round(sum(r["bytes"] for r in records) / max(num_tokens, 1), 3),
        "data": {**plan["data"], "report": report.to_dict()},
        "token_counts": {"file": fmt.TOKEN_COUNTS, "sha256": counts_sha},
        "shards": records,
    }
    atomic_write_json(out / fmt.MANIFEST, manifest)
    return manifest
