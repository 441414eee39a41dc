"""Capture while serving (`draftsmith serve --capture-to STORE`): every served request's tokens (prompt + response)
with the target's aux and final pre-norm hidden states, written as a hidden-state store in the capture format
(`draftsmith.store.format`: shards, progress records, token counts, manifest with sha256s), so
`HiddenStateStore.open`, `draftsmith store verify` and `draftsmith train --store` read it like any capture.

How the states are obtained (`engine` given, the default): from the target forwards the server runs anyway. The
engine records (`SpeculativeDecoder.set_state_recording`): every prefill, verify and plain-step forward also returns
its rows' aux states and the last layer's output before the final norm, and writes them into a buffer indexed like
the KV cache by slot (inside the CUDA graphs: one index_copy_ a forward). A chain round's rejected rows sit at slots
the next round rewrites, a tree round compacts the accepted path's rows with its K/V, so after a response the buffer
holds the states of prompt + response but the last token (the last emitted token is never forwarded: it is not
recorded). `record` slices that, converts (bf16, or fp8 with its scales) on the device and starts one
asynchronous device-to-host copy; the writer thread waits for it. No second target forward, and the next request's
prefill follows the copy on the same stream. The states are those of the served forwards (K+1-row verifies, tree
verifies, one-row steps), equal to an offline capture's prefill up to matmul blocking (fp32: ~1e-6 relative;
tested), so the recorded store equals `draftsmith capture` of the same tokens within bf16 rounding.

Without an engine that records (the generic HF path has no compact forward to return the final state), `record`
falls back to ONE extra target forward over prompt + response through the same forward hooks as `draftsmith
capture` (`AuxCapture` on the HF decoder, eager), after the response's last event was sent: it delays only the
next queued request, and records the last token too.

Disk writes are off the engine thread: a writer thread packs samples into shards, writes each atomically, then
rewrites token_counts and the manifest, so the store is complete and verifiable after every flush (a shard is
flushed when it holds `shard_tokens` tokens, or when its oldest sample is `flush_s` old, or at shutdown). A
restarted server appends to its own store (same target, aux layers and dtype), shard numbers continuing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

from draftsmith import __version__
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import (
    atomic_save_file,
    atomic_save_safetensors_streaming,
    atomic_write_json,
    read_json,
)
from draftsmith.store import format as fmt
from draftsmith.target_model.layers import to_hidden_states_ids

log = logging.getLogger("draftsmith.serve")

SOURCE = "draftsmith serve"


class ServeRecorder:
    """`record(prompt_ids, response_ids)` on the engine thread, right after the engine's `generate` of that request;
    a writer thread does the disk work.

    The loss mask covers the response tokens (what the target produced, the drafter's targets); the prompt is
    context. `max_tokens`: stop recording once the store holds this many tokens (None: no limit). `engine`: a
    `SpeculativeDecoder` with state recording on (`set_state_recording(True)`, before its graphs are captured):
    the states come from its served forwards; None, or an engine that does not record: one extra target forward
    per request."""

    def __init__(
        self,
        out: str | Path,
        target,
        aux_layers,
        dtype: str = "bf16",
        max_tokens: int | None = None,
        shard_tokens: int = 65536,
        flush_s: float = 60.0,
        engine=None,
    ):
        from draftsmith.capture import AuxCapture

        if dtype not in fmt.STORE_DTYPES:
            raise DraftsmithError(f"--capture-dtype: {dtype!r} is not a store dtype (choose bf16 or fp8)")
        self.out = Path(out)
        self.target = target
        self.aux_layers = [int(i) for i in aux_layers]
        self.dtype = dtype
        self.max_tokens = max_tokens
        self.shard_tokens = max(1, int(shard_tokens))
        self.flush_s = float(flush_s)
        self.H = int(target.hidden_size)
        self.engine = engine if getattr(engine, "states", None) is not None else None
        if self.engine is not None and list(self.engine.aux_layers) != self.aux_layers:
            raise DraftsmithError(f"capture: the engine records aux layers {self.engine.aux_layers}, not {aux_layers}")
        self.served_states = self.engine is not None  # False: the extra target forward per request
        self._cap = None if self.served_states else AuxCapture(target, self.aux_layers, capture_final=True)
        self._shards: list[dict] = []
        self._num_samples = 0
        self._counts = torch.zeros(int(target.vocab_size), dtype=torch.int64)
        self._open_store()
        self._queued_tokens = self._stored_tokens()
        self._full_logged = False
        self.engine_s = 0.0  # engine-thread seconds spent recording (for the logs / benchmarks)
        self.recorded = 0
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="draftsmith-capture-writer", daemon=True)
        self._writer.start()

    # -- the store -----------------------------------------------------------------------------------
    def _stored_tokens(self) -> int:
        return int(sum(s["num_tokens"] for s in self._shards))

    def _open_store(self) -> None:
        m_path = self.out / fmt.MANIFEST
        if m_path.is_file():
            m = read_json(m_path, "store manifest")
            if m.get("data", {}).get("path") != SOURCE:
                raise DraftsmithError(
                    f"{self.out}: a store written by `draftsmith capture`, not by serve; choose another --capture-to"
                )
            mine = self.target.identity()
            for key in ("config_hash", "tokenizer_hash"):
                if m.get("target", {}).get(key) != mine.get(key):
                    raise DraftsmithError(
                        f"{m_path}: target.{key} differs — this store was recorded from "
                        f"{m.get('target', {}).get('path')!r}; choose another --capture-to"
                    )
            for key, val in (("aux_layers", self.aux_layers), ("dtype", self.dtype)):
                if m.get(key) != val:
                    raise DraftsmithError(
                        f"{m_path}: field {key!r} is {m.get(key)!r}, this server records {val!r}; "
                        "choose another --capture-to"
                    )
            self._shards = list(m["shards"])
            self._num_samples = int(m["num_samples"])
            from safetensors.torch import load_file

            self._counts = load_file(str(self.out / fmt.TOKEN_COUNTS))["token_counts"]
            return
        if self.out.exists() and any(p.name not in (fmt.SHARD_DIR, fmt.PROGRESS_DIR) for p in self.out.iterdir()):
            raise DraftsmithError(
                f"{self.out}: exists and is not a store recorded by draftsmith serve; choose another --capture-to"
            )
        (self.out / fmt.SHARD_DIR).mkdir(parents=True, exist_ok=True)
        (self.out / fmt.PROGRESS_DIR).mkdir(parents=True, exist_ok=True)

    # -- the engine thread ---------------------------------------------------------------------------
    @torch.no_grad()
    def record(self, prompt_ids, response_ids) -> bool:
        """Queue prompt + response for the store (their states from the engine's buffer, else from one target
        forward); the writer does the rest. False when not recorded."""
        if self._error is not None:
            raise DraftsmithError(f"capture writer failed: {self._error}")
        if not response_ids:
            return False
        ids = [int(x) for x in prompt_ids] + [int(x) for x in response_ids]
        if self.served_states:
            ids = ids[:-1]  # the last emitted token never went through the target
        if self.max_tokens is not None and self._queued_tokens + len(ids) > self.max_tokens:
            if not self._full_logged:
                log.warning("capture: --capture-max-tokens %d reached; not recording further requests", self.max_tokens)
                self._full_logged = True
            return False
        t0 = time.perf_counter()
        rows = self._served_rows(len(ids)) if self.served_states else self._forward_rows(ids)
        self.engine_s += time.perf_counter() - t0
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(prompt_ids) :] = True
        self._queued_tokens += len(ids)
        self.recorded += 1
        self._q.put((np.asarray(ids, dtype=np.int32), mask, rows, time.monotonic()))
        return True

    def _served_rows(self, n: int):
        """The engine buffer's first n rows ([n, (k+1)*H], slot == position), converted on the device and copied to
        the host without waiting: (host tensors, the copy's CUDA event or None). The writer splits and waits."""
        eng = self.engine
        if n > int(eng.L):  # (generate has synchronized: reading L costs no wait)
            raise DraftsmithError(f"capture: {n} tokens to record but the engine holds {int(eng.L)}")
        x = eng.states[:n]
        if self.dtype == "fp8":
            parts = fmt.quantize_fp8_rows(x, self.H)  # new tensors: the buffer is free for the next request
        else:
            parts = (x.to(torch.bfloat16, copy=x.device.type != "cuda"),)  # CUDA: the async copy below copies
        if x.device.type != "cuda":
            return parts, None
        host = tuple(p.to("cpu", non_blocking=True) for p in parts)  # pinned; in stream order before the next prefill
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _forward_rows(self, ids) -> dict:
        x = torch.tensor([ids], dtype=torch.long, device=self.target.device)
        with self._cap:
            self.target.decoder(input_ids=x, use_cache=False)
        aux, final = self._cap.aux[0], self._cap.final[0]
        if self.dtype == "fp8":
            aux_q, aux_s = fmt.quantize_fp8_rows(aux, self.H)
            fq, fs = fmt.quantize_fp8_rows(final, self.H)
            return {
                "aux": aux_q.cpu(),
                "aux_scale": aux_s.cpu(),
                "final": fq.cpu(),
                "final_scale": fs.reshape(-1).cpu(),
            }
        return {"aux": aux.to(torch.bfloat16).cpu(), "final": final.to(torch.bfloat16).cpu()}

    def _split(self, rows) -> dict:
        """The writer's view of a sample's states: aux [n, k*H] and final [n, H] (+ fp8 scales [n, k] and [n])."""
        if isinstance(rows, dict):
            return rows
        parts, ev = rows
        if ev is not None:
            ev.synchronize()
        kH, k = len(self.aux_layers) * self.H, len(self.aux_layers)
        out = {"aux": parts[0][:, :kH].contiguous(), "final": parts[0][:, kH:].contiguous()}
        if self.dtype == "fp8":
            out["aux_scale"], out["final_scale"] = parts[1][:, :k].contiguous(), parts[1][:, k].contiguous()
        return out

    def close(self, timeout: float = 120.0) -> None:
        """Flush what is pending and stop the writer (the manifest then lists every recorded request)."""
        self._q.put(None)
        self._writer.join(timeout)

    # -- the writer thread ---------------------------------------------------------------------------
    def _write_loop(self) -> None:
        pending: list = []
        tokens = 0
        closing = False
        while not closing:
            timeout = None
            if pending:
                timeout = max(0.0, pending[0][3] + self.flush_s - time.monotonic())
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                item = "flush"
            if item is None:
                closing = True
            elif item != "flush":
                pending.append(item)
                tokens += len(item[0])
            due = pending and (
                closing
                or item == "flush"
                or tokens >= self.shard_tokens
                or time.monotonic() - pending[0][3] >= self.flush_s
            )
            if due:
                try:
                    self._write_shard(pending)
                except BaseException as e:  # reported on the next record() and in the log
                    self._error = e
                    log.error("capture: writing a shard into %s failed: %s", self.out, e)
                pending, tokens = [], 0

    def _write_shard(self, samples: list) -> None:
        si = len(self._shards)
        first = self._num_samples
        n = len(samples)
        samples = [(s[0], s[1], self._split(s[2]), s[3]) for s in samples]
        states = {
            "aux_hidden_states": torch.cat([s[2]["aux"] for s in samples]),
            "final_hidden_states": torch.cat([s[2]["final"] for s in samples]),
        }
        if self.dtype == "fp8":
            states["aux_scale"] = torch.cat([s[2]["aux_scale"] for s in samples])
            states["final_scale"] = torch.cat([s[2]["final_scale"] for s in samples])
        masks = [s[1] for s in samples]
        tensors = fmt.shard_tensors(first, [s[0] for s in samples], masks, states)
        digest, nbytes = atomic_save_safetensors_streaming(
            tensors, self.out / fmt.shard_name(si), metadata={"format": f"{fmt.FORMAT_NAME}:shard-{si:05d}"}
        )
        record = fmt.shard_record(si, first, tensors, masks, digest, nbytes)
        atomic_write_json(self.out / fmt.progress_name(si), record)
        for ids, mask, _, _ in samples:
            masked = torch.from_numpy(ids[mask].astype(np.int64))
            if masked.numel():
                self._counts.index_add_(0, masked.clamp(0, self._counts.numel() - 1), torch.ones_like(masked))
        self._shards.append(record)
        self._num_samples += n
        self._write_manifest()

    def _write_manifest(self) -> None:
        counts_sha = atomic_save_file({"token_counts": self._counts}, self.out / fmt.TOKEN_COUNTS)
        t = self.target
        num_tokens = self._stored_tokens()
        manifest = {
            "format": fmt.FORMAT_NAME,
            "format_version": fmt.FORMAT_VERSION,
            "draftsmith_version": __version__,
            "target": t.identity(),
            "aux_layers": self.aux_layers,
            "aux_layers_convention": "layer-output",
            "aux_hidden_states_ids": to_hidden_states_ids(self.aux_layers),
            "num_aux": len(self.aux_layers),
            "has_final": True,
            "final_layer": t.num_layers - 1,
            "final_is_pre_norm": True,
            "hidden_size": self.H,
            "vocab_size": t.vocab_size,
            "dtype": self.dtype,
            "fp8_scale": "power-of-two per (token, layer) row, uint8 exponent+127" if self.dtype == "fp8" else None,
            "max_length": None,
            "num_samples": self._num_samples,
            "num_tokens": num_tokens,
            "num_loss_tokens": int(sum(r["num_loss_tokens"] for r in self._shards)),
            "bytes_per_token": round(sum(r["bytes"] for r in self._shards) / max(num_tokens, 1), 3),
            "data": {
                "path": SOURCE,
                "num_samples": self._num_samples,
                "loss_mask": "response tokens (the prompt is context)",
            },
            "token_counts": {"file": fmt.TOKEN_COUNTS, "sha256": counts_sha},
            "shards": self._shards,
        }
        atomic_write_json(self.out / fmt.MANIFEST, manifest)
