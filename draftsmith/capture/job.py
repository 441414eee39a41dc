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
import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from tqdm.auto import tqdm

from draftsmith import __version__
from draftsmith.capture.config import (
    CaptureConfig,  # CaptureConfig lived here: still importable from this module
)
from draftsmith.capture.graphs import GraphedCapture, bucket_seq_len
from draftsmith.capture.hooks import AuxCapture
from draftsmith.common.dist import barrier, dist_info, init_dist, resolve_device
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import (
    LOCK_FILE_NAME,
    atomic_save_file,
    atomic_save_safetensors_streaming,
    atomic_write_json,
    dir_lock,
    is_no_space,
    no_space_error,
    read_json,
    sha256_file,
)
from draftsmith.data import DataReport, load_samples
from draftsmith.store import format as fmt
from draftsmith.target_model import load_target
from draftsmith.target_model.layers import to_hidden_states_ids, validate_aux_layers
from draftsmith.target_model.load import load_tokenizer

SHARD_PLAN_KEY = "plan_sha256"  # shard metadata key: the hash of the capture plan the shard was written under


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

    def view(self, num_tokens: int) -> _ShardBuffers:
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
    tokenized samples (skips reading `cfg.data`). The out directory is locked for the whole job (a second
    capture into it fails at once); a full disk is the one-line error "no space left on device: PATH".
    """
    _check_options(cfg)
    rank = dist_info()[0]
    # Rank 0 holds the lock for the whole torchrun job (the other ranks are the same capture).
    lock = dir_lock(cfg.out, what="capture") if rank == 0 else contextlib.nullcontext()
    try:
        with lock:
            job = _CaptureJob(cfg, log, target, samples)
            if job.complete is not None:
                return job.complete
            job.capture(stats)
            return job.finish()
    except Exception as e:  # only a full disk is translated; everything else propagates unchanged
        if is_no_space(e):  # a write outside atomic_file (a directory, the lock file) ran out of space
            raise no_space_error(getattr(e, "filename", None) or cfg.out) from None
        raise


def _check_options(cfg: CaptureConfig) -> None:
    if cfg.dtype not in fmt.STORE_DTYPES:
        raise DraftsmithError(f"--dtype: {cfg.dtype!r} is not a store dtype (choose bf16 or fp8)")
    if cfg.on_bad not in ("error", "skip"):
        raise DraftsmithError(f"--on-bad: {cfg.on_bad!r} (choose error or skip)")
    if cfg.batch_tokens < 1:
        raise DraftsmithError("--batch-tokens must be >= 1")
    if cfg.max_length is not None and cfg.max_length < 1:
        raise DraftsmithError("--max-length must be >= 1")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise DraftsmithError(f"{out}: exists and is not a directory; choose another --out")


def plan_sha256(plan: dict) -> str:
    """The hash of a capture plan, stamped into every shard's metadata: a shard is reused only by the same plan."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _CaptureJob:
    """One capture: setup (data, target, plan) in __init__, `capture` (a loop of `_capture_shard`), `finish`."""

    def __init__(self, cfg: CaptureConfig, log, target, samples):
        self.cfg = cfg
        self.rank, self.world, local_rank = dist_info()
        self.device = resolve_device(cfg.device, local_rank)
        if self.world > 1:
            init_dist(self.world, "nccl" if self.device.type == "cuda" else "gloo")
        self.is_main = self.rank == 0
        self.log = log
        self.say = log if self.is_main else (lambda *a, **k: None)
        # With tensor parallelism every rank runs every batch (the model is split, not the data).
        self.data_world, self.data_rank = (1, 0) if cfg.tp else (self.world, self.rank)
        self.writer = (self.rank == 0) if cfg.tp else True
        self.out = Path(cfg.out)
        self.samples, self.report, self.target = self._load(target, samples)
        self.aux_layers = validate_aux_layers(cfg.aux_layers or self.target.default_aux_layers, self.target.num_layers)
        self.plan = self._make_plan()
        self.plan_sha = plan_sha256(self.plan)
        self.shards = [tuple(s) for s in self.plan["shards"]]
        _check_or_write_plan(self.out, self.plan, self.is_main, self.world)
        self.complete = None
        if (self.out / fmt.MANIFEST).is_file():
            self.say(f"{self.out}: already complete ({len(self.samples)} samples); nothing to do")
            self.complete = read_json(self.out / fmt.MANIFEST)

    def _load(self, target, samples):
        """Data first: a bad record fails in a second, not after loading a large model."""
        cfg = self.cfg
        if target is None and not Path(cfg.target).is_dir():
            raise DraftsmithError(f"{cfg.target}: target not found (expected a Hugging Face model directory)")
        if not cfg.progress:
            transformers.utils.logging.disable_progress_bar()
        tokenizer = target.tokenizer if target is not None else load_tokenizer(cfg.target)
        t0 = time.time()
        if samples is None:
            samples, report = load_samples(
                cfg.data,
                tokenizer,
                max_length=cfg.max_length,
                on_bad=cfg.on_bad,
                glob=cfg.glob,
                split_long=cfg.split_long,
                add_bos=cfg.add_bos,
                follow_symlinks=cfg.follow_symlinks,
            )
            self.say(f"data: {report.summary()} ({time.time() - t0:.1f}s)")
        else:
            report = DataReport(total=len(samples), kept=len(samples), samples=len(samples))
        if not samples:
            raise DraftsmithError(f"{cfg.data}: no usable samples")
        if cfg.max_samples is not None:
            samples = samples[: cfg.max_samples]
        if target is None:
            model_dtype = cfg.model_dtype
            if model_dtype == "auto":
                model_dtype = "bf16" if self.device.type == "cuda" else "auto"
            target = load_target(
                cfg.target,
                dtype=model_dtype,
                device=self.device,
                tp_plan="auto" if cfg.tp else None,
                tokenizer=tokenizer,
            )
        return samples, report, target

    def _make_plan(self) -> dict:
        cfg, target = self.cfg, self.target
        lengths = np.array([len(s.input_ids) for s in self.samples], dtype=np.int64)
        bpt = fmt.bytes_per_token(target.hidden_size, len(self.aux_layers), cfg.dtype, cfg.capture_final)
        shard_tokens = cfg.shard_tokens or max(1024, int(cfg.shard_mb * 2**20 // bpt))
        # Settings first, data and the shard plan last: a rerun that changes a setting (--max-length changes the
        # samples too) is refused naming the setting, not 'data'.
        return {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "target": target.identity(),
            "aux_layers": self.aux_layers,
            "capture_final": cfg.capture_final,
            "dtype": cfg.dtype,
            "max_length": cfg.max_length,
            "batch_tokens": cfg.batch_tokens,
            "shard_tokens": shard_tokens,
            "cuda_graphs": cfg.cuda_graphs,
            "data": {
                "path": str(cfg.data),
                "fingerprint": data_fingerprint(self.samples),
                "num_samples": len(self.samples),
            },
            "shards": [list(s) for s in plan_shards(lengths, shard_tokens)],
        }

    # -- the shards ----------------------------------------------------------------------------------
    def capture(self, stats: dict | None) -> None:
        """Capture every shard of this rank that is not committed yet (checked: size, sha256, plan)."""
        mine = [si for si in range(len(self.shards)) if si % self.data_world == self.data_rank]
        todo = [si for si in mine if not _reuse_committed_shard(self.out, si, self.plan_sha, self.log)]
        if len(todo) < len(mine):
            self.log(f"resuming: {len(mine) - len(todo)} of rank {self.rank}'s {len(mine)} shard(s) already committed")
        self.cap = AuxCapture(self.target, self.aux_layers, capture_final=self.cfg.capture_final)
        self.graphs: dict = {}
        pad_id = self.target.tokenizer.pad_token_id
        self.pad_id = 0 if pad_id is None else pad_id
        bar = self._progress_bar(todo)
        slots = _WriteSlots(
            self.cfg,
            max((self.shards[j][2] for j in todo), default=0),
            len(self.aux_layers),
            self.target.hidden_size,
            pin=self.device.type == "cuda",
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_start = time.time()
        try:
            with torch.no_grad():
                for si in todo:
                    self._capture_shard(si, slots, bar)
                drain_s = slots.drain()
        finally:
            slots.close()  # on an error too: no writer thread outlives the job (and its directory lock)
            bar.close()
        elapsed = time.time() - t_start
        captured = int(sum(self.shards[si][2] for si in todo))
        if stats is not None:
            stats.update(
                capture_s=elapsed,
                alloc_s=slots.alloc_s,
                drain_s=drain_s,
                tokens=captured,
                graphs=len(self.graphs),
                **slots.write_stats(),
            )
        if captured:
            self.say(
                f"captured {captured} tokens in {elapsed:.1f}s ({captured / max(elapsed, 1e-9):,.0f} tok/s on "
                f"rank {self.rank})"
            )

    def _progress_bar(self, todo: list[int]):
        return tqdm(
            total=int(sum(self.shards[si][2] for si in todo)),
            unit="tok",
            unit_scale=True,
            desc=f"capture[{self.rank}]",
            disable=not (self.cfg.progress and (self.is_main or not self.cfg.tp)),
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def _capture_shard(self, si: int, slots: _WriteSlots, bar) -> None:
        """Run shard `si`'s batches into a free host buffer set, then hand it to a writer thread."""
        cfg = self.cfg
        first, n, ntok = self.shards[si]
        shard_samples = self.samples[first : first + n]
        slen = [len(s.input_ids) for s in shard_samples]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(slen, out=offsets[1:])
        slot, buf = slots.acquire(ntok)
        pending = None
        for batch in plan_batches(slen, cfg.batch_tokens):
            res = _run_batch(
                self.target,
                self.cap,
                self.graphs,
                cfg,
                batch,
                shard_samples,
                slen,
                offsets,
                self.pad_id,
                self.device,
                self.target.hidden_size,
            )
            if pending is not None:
                _land(buf, pending, cfg.dtype)  # the previous batch's copy, overlapped by this batch's forward
            pending = res
            bar.update(int(sum(slen[j] for j in batch)))
        if pending is not None:
            _land(buf, pending, cfg.dtype)
        if self.writer:
            slots.submit(slot, _write_shard, self.out, si, first, shard_samples, buf, self.plan_sha)

    # -- the manifest --------------------------------------------------------------------------------
    def finish(self) -> dict:
        barrier(self.world)
        manifest = None
        if self.is_main:
            manifest = _finalize(
                self.out,
                self.plan,
                self.plan_sha,
                self.samples,
                self.report,
                self.target,
                self.aux_layers,
                self.shards,
                self.cfg,
            )
            self.say(
                f"wrote {self.out}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, "
                f"{len(self.shards)} shard(s)"
            )
        barrier(self.world)
        if manifest is None:
            manifest = read_json(self.out / fmt.MANIFEST)
        return manifest


class _WriteSlots:
    """Shards are written by `cfg.writers` threads while the device fills the next shard's buffers; writers+1 sets
    of host buffers rotate, so memory stays bounded and pinned buffers (slow to allocate) are allocated once."""

    def __init__(self, cfg: CaptureConfig, max_tokens: int, k: int, hidden: int, pin: bool):
        self.cfg, self.max_tokens, self.k, self.hidden, self.pin = cfg, max_tokens, k, hidden, pin
        self.n_sets = cfg.writers + 1
        self.pool = cf.ThreadPoolExecutor(max_workers=cfg.writers)
        self.buffers: list[_ShardBuffers] = []
        self.slot_future: list[cf.Future | None] = [None] * self.n_sets
        self.writes: list[cf.Future] = []
        self.n_used = 0
        self.alloc_s = 0.0  # pinned shard buffers, allocated on first use (fixed cost: n_sets allocations per run)

    def acquire(self, num_tokens: int) -> tuple[int, _ShardBuffers]:
        slot = self.n_used % self.n_sets
        if self.slot_future[slot] is not None:
            self.slot_future[slot].result()  # that buffer set's shard is on disk: reuse it
        if slot == len(self.buffers):
            t0 = time.time()
            c = self.cfg
            self.buffers.append(
                _ShardBuffers(
                    self.max_tokens, self.k * self.hidden, self.hidden, self.k, c.dtype, c.capture_final, self.pin
                )
            )
            self.alloc_s += time.time() - t0
        self.n_used += 1
        return slot, self.buffers[slot].view(num_tokens)

    def submit(self, slot: int, fn, *args) -> None:
        self.slot_future[slot] = self.pool.submit(fn, *args)
        self.writes.append(self.slot_future[slot])

    def drain(self) -> float:
        """Wait for the last shards' writes (no longer overlapped by device work); returns the seconds waited."""
        t0 = time.time()
        for f in self.writes:
            f.result()
        return time.time() - t0

    def close(self) -> None:
        """Stop the writer threads: queued writes are cancelled, a running one finishes (atomically) first."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def write_stats(self) -> dict:
        done = [f.result() for f in self.writes]  # all finished (after drain)
        return {"write_s": sum(d[0] for d in done), "bytes_written": sum(d[1] for d in done), "shards": len(done)}


def _check_or_write_plan(out: Path, plan: dict, is_main: bool, world: int) -> None:
    """Rank 0 writes the plan (or checks it on resume); other ranks check it after a barrier."""
    ppath = out / fmt.PLAN

    def check() -> None:
        old = read_json(ppath, "capture plan")
        if not isinstance(old, dict):
            raise DraftsmithError(f"{ppath}: not a capture plan (a JSON object); delete {out} to start over")
        for key in plan:
            if old.get(key) != plan[key]:
                raise DraftsmithError(
                    f"{ppath}: field {key!r} differs from this command's — {out} was started with other "
                    f"settings or data; use a new --out (or delete {out} to start over)"
                )

    def is_ours(p: Path) -> bool:  # what a capture leaves before its plan exists (dirs, lock, killed writes)
        return p.name in (fmt.SHARD_DIR, fmt.PROGRESS_DIR, LOCK_FILE_NAME) or (
            p.name.startswith(".") and p.name.endswith(".tmp")
        )

    if is_main:
        if ppath.is_file():
            check()
            for d in (fmt.SHARD_DIR, fmt.PROGRESS_DIR, "."):  # writes a kill interrupted (never visible)
                for tmp in (out / d).glob(".*.tmp"):
                    tmp.unlink(missing_ok=True)
        else:
            if out.exists() and not all(is_ours(p) for p in out.iterdir()):
                raise DraftsmithError(f"{out}: exists and is not a draftsmith store in progress; choose another --out")
            (out / fmt.SHARD_DIR).mkdir(parents=True, exist_ok=True)
            (out / fmt.PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
            for tmp in out.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            atomic_write_json(ppath, plan)
    barrier(world)
    if not is_main:
        check()


def shard_plan_sha256(path: Path) -> str | None:
    """The plan hash a shard was written with (its safetensors metadata), or None (unreadable, or no stamp)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(SHARD_PLAN_KEY)
    except Exception:  # noqa: BLE001 - any damage means "not reusable"
        return None


def _reuse_committed_shard(out: Path, si: int, plan_sha: str, log) -> bool:
    """Whether shard `si` is committed and intact: its progress record, then its size, plan stamp and sha256.

    A shard stamped by another plan is refused (with plan.json gone, a rerun with other settings must not adopt
    it); a damaged one is redone (its progress record is removed first).
    """
    prog, shard = out / fmt.progress_name(si), out / fmt.shard_name(si)
    if not prog.is_file():
        return False
    try:
        rec = read_json(prog, "shard progress record")
    except DraftsmithError:
        rec = None
    problem = None
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
        problem = "its progress record is unreadable"
    elif not shard.is_file():
        problem = "the shard file is missing"
    elif shard.stat().st_size != rec.get("bytes"):
        problem = f"size {shard.stat().st_size} != {rec.get('bytes')} recorded"
    else:
        stamp = shard_plan_sha256(shard)
        if stamp != plan_sha:
            raise DraftsmithError(
                f"{shard}: captured with other settings or data (plan {str(stamp)[:12]}, this command's "
                f"{plan_sha[:12]}); use a new --out (or delete {out} to start over)"
            )
        if sha256_file(shard) != rec["sha256"]:
            problem = "sha256 differs from its progress record (corrupted)"
    if problem is None:
        return True
    log(f"{shard}: {problem}; capturing it again")
    prog.unlink(missing_ok=True)
    return False


def _run_batch(target, cap, graphs, cfg, batch, shard_samples, slen, offsets, pad_id, device, H):
    """Forward one right-padded batch; gather real tokens on device; start the copy to the host."""
    L = max(slen[j] for j in batch)
    B = len(batch)
    if cfg.cuda_graphs and device.type == "cuda":
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


def _write_shard(out: Path, si: int, first: int, shard_samples, buf: _ShardBuffers, plan_sha: str) -> tuple[float, int]:
    """Commit shard `si`: the shard file (atomic rename), then its progress record. Returns (seconds, bytes)."""
    states = {"aux_hidden_states": buf.aux}
    for key, t in (("final_hidden_states", buf.final), ("aux_scale", buf.aux_scale), ("final_scale", buf.final_scale)):
        if t is not None:
            states[key] = t
    masks = [s.loss_mask for s in shard_samples]
    tensors = fmt.shard_tensors(first, [s.input_ids for s in shard_samples], masks, states)
    t0 = time.perf_counter()
    path = out / fmt.shard_name(si)
    # The plan hash in the shard itself: a resume (even without plan.json) reuses only shards of the same plan.
    digest, nbytes = atomic_save_safetensors_streaming(
        tensors, path, metadata={"format": f"{fmt.FORMAT_NAME}:shard-{si:05d}", SHARD_PLAN_KEY: plan_sha}
    )
    record = fmt.shard_record(si, first, tensors, masks, digest, nbytes)
    atomic_write_json(out / fmt.progress_name(si), record)
    return time.perf_counter() - t0, record["bytes"]


def _finalize(out: Path, plan, plan_sha: str, samples, report, target, aux_layers, shards, cfg) -> dict:
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
        "plan_sha256": plan_sha,
        "shards": records,
    }
    atomic_write_json(out / fmt.MANIFEST, manifest)
    return manifest
