"""Training data: held-out split, deterministic shuffled token-budget packing, offline and online batches.

A *micro-batch* is one packed row: consecutive samples of a seeded per-epoch permutation, concatenated
until the token budget (`batch_tokens`) is reached. Position ids restart at each document and attention
never crosses documents (see `ttt.py`), so no padding is trained as data. The packing is a pure function
of (sample lengths, seed, epoch), which is what makes resume and multi-process runs reproducible: the
data position is just (epoch, micro-batch index).

Sources:
* offline: a `HiddenStateStore` (memory-mapped) or anything with `len()` and `[i] -> dict` (tests use a
  list of dicts) holding input_ids, loss_mask, aux_hidden_states, final_hidden_states;
* online: tokenized samples (`draftsmith.data.load_samples`); the target runs in the loop and
  `AuxCapture` supplies the states.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draftsmith.common.errors import DraftsmithError
from draftsmith.train.ttt import document_ids_from_lengths, positions_from_doc_ids


# ----------------------------------------------------------------------------------------------------
# lengths, split and packing
# ----------------------------------------------------------------------------------------------------
def source_lengths(source) -> np.ndarray:
    lens = getattr(source, "lengths", None)
    if lens is not None and not callable(lens):
        return np.asarray(lens, dtype=np.int64)
    out = []
    for i in range(len(source)):
        item = source[i]
        ids = item["input_ids"] if isinstance(item, dict) else item.input_ids
        out.append(len(ids))
    return np.asarray(out, dtype=np.int64)


def split_train_eval(
    n: int, eval_fraction: float, seed: int, max_eval: int | None = None
) -> tuple[list[int], list[int]]:
    """Seeded split of sample indices. At least one eval sample when eval_fraction > 0 and n >= 2."""
    if n == 0:
        return [], []
    g = torch.Generator().manual_seed(int(seed) + 7919)
    perm = torch.randperm(n, generator=g).tolist()
    n_eval = int(round(n * eval_fraction)) if eval_fraction > 0 else 0
    if eval_fraction > 0 and n >= 2:
        n_eval = max(1, n_eval)
    if max_eval is not None:
        n_eval = min(n_eval, max_eval)
    n_eval = min(n_eval, n - 1)
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def pack_rows(indices: Sequence[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Greedy in-order packing of `indices` into rows of at most `budget` tokens (long samples are cut)."""
    rows: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in indices:
        L = min(int(lengths[i]), budget)
        if L <= 0:
            continue
        if cur and used + L > budget:
            rows.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += L
    if cur:
        rows.append(cur)
    return rows


def epoch_rows(
    train_idx: Sequence[int], lengths: np.ndarray, budget: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    idx = list(train_idx)
    if shuffle:
        g = torch.Generator().manual_seed(int(seed) * 1000003 + int(epoch))
        perm = torch.randperm(len(idx), generator=g).tolist()
        idx = [idx[p] for p in perm]
    return pack_rows(idx, lengths, budget)


# ----------------------------------------------------------------------------------------------------
# micro-batches
# ----------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [1, T] long
    loss_mask: torch.Tensor  # [1, T] bool
    doc_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    aux_hidden: torch.Tensor | None  # [1, T, k*H]
    final_hidden: torch.Tensor | None  # [1, T, H]
    doc_lengths: list[int]
    num_tokens: int  # real tokens (without padding)
    # fp8 rows still quantized (a store read with `defer_dequantize`): uint8 scale exponents [1, T, k] / [1, T, 1];
    # `to()` dequantizes after the copy, on the target device
    aux_scale: torch.Tensor | None = None
    final_scale: torch.Tensor | None = None
    states_dtype: torch.dtype = torch.bfloat16  # what deferred fp8 rows dequantize to

    def to(self, device, dtype=None) -> MicroBatch:
        def mv(x, fl=False):
            if x is None:
                return None
            x = x.to(device, non_blocking=True)
            return x.to(dtype) if (fl and dtype is not None) else x

        aux, final = mv(self.aux_hidden), mv(self.final_hidden)
        if self.aux_scale is not None:
            from draftsmith.store.format import dequantize_fp8_rows

            out = dtype or self.states_dtype
            aux = dequantize_fp8_rows(aux[0], mv(self.aux_scale)[0], out)[None]
            final = None if final is None else dequantize_fp8_rows(final[0], mv(self.final_scale)[0], out)[None]
        elif dtype is not None:
            aux = None if aux is None else aux.to(dtype)
            final = None if final is None else final.to(dtype)
        return MicroBatch(
            mv(self.input_ids),
            mv(self.loss_mask),
            mv(self.doc_ids),
            mv(self.position_ids),
            aux,
            final,
            self.doc_lengths,
            self.num_tokens,
        )

    def pin_memory(self) -> MicroBatch:
        """Page-locked copies (built in the prefetch thread) so that `.to(cuda, non_blocking=True)` is a real
        asynchronous DMA instead of a synchronous pageable copy of the [T, k*H] states on every step."""

        def pin(x):
            return None if x is None or x.is_cuda else x.pin_memory()

        return MicroBatch(
            pin(self.input_ids),
            pin(self.loss_mask),
            pin(self.doc_ids),
            pin(self.position_ids),
            pin(self.aux_hidden),
            pin(self.final_hidden),
            self.doc_lengths,
            self.num_tokens,
            pin(self.aux_scale),
            pin(self.final_scale),
            self.states_dtype,
        )


def _get(item, key):
    if isinstance(item, dict):
        return item.get(key)
    return getattr(item, key, None)


def _as_tensor(x) -> torch.Tensor:
    return x if torch.is_tensor(x) else torch.from_numpy(np.ascontiguousarray(np.asarray(x)))


def build_micro_batch(
    source, row: Sequence[int], budget: int, with_states: bool, pad_to: int = 1, pad_token_id: int = 0
) -> MicroBatch:
    ids, masks, auxs, finals, lens = [], [], [], [], []
    a_scales, f_scales = [], []  # fp8 rows read without dequantizing (HiddenStateStore.defer_dequantize)
    for i in row:
        item = source[i]
        x = _as_tensor(_get(item, "input_ids")).to(torch.long)
        m = _as_tensor(_get(item, "loss_mask")).to(torch.bool)
        L = min(x.numel(), budget)
        ids.append(x[:L])
        masks.append(m[:L])
        lens.append(L)
        if with_states:
            a = _get(item, "aux_hidden_states")
            f = _get(item, "final_hidden_states")
            if f is None:
                raise DraftsmithError(
                    f"sample {i}: the store has no final_hidden_states (the teacher needs them; recapture with "
                    f"final states)"
                )
            auxs.append(a[:L])
            finals.append(f[:L])
            sa = _get(item, "aux_scale")
            if sa is not None:
                a_scales.append(sa[:L])
                f_scales.append(_get(item, "final_scale")[:L])
    T = sum(lens)
    Tp = -(-T // pad_to) * pad_to
    input_ids = torch.cat(ids)
    loss_mask = torch.cat(masks)
    if Tp > T:
        input_ids = torch.cat([input_ids, torch.full((Tp - T,), pad_token_id, dtype=torch.long)])
        loss_mask = torch.cat([loss_mask, torch.zeros(Tp - T, dtype=torch.bool)])
    doc_ids = document_ids_from_lengths(lens, Tp)
    aux = final = aux_s = final_s = None

    def packed(parts):  # concatenated and zero-padded to Tp rows (zeros dequantize to zeros: any scale)
        x = torch.cat(parts)
        return (torch.cat([x, x.new_zeros(Tp - T, x.shape[-1])]) if Tp > T else x)[None]

    if with_states:
        aux, final = packed(auxs), packed(finals)
        if a_scales:
            aux_s, final_s = packed(a_scales), packed(f_scales)
    return MicroBatch(
        input_ids[None],
        loss_mask[None],
        doc_ids[None],
        positions_from_doc_ids(doc_ids)[None],
        aux,
        final,
        lens,
        T,
        aux_s,
        final_s,
        getattr(source, "compute_dtype", torch.bfloat16),
    )


class OnlineStates:
    """Runs the target on a micro-batch's documents (right-padded batch, one row per document) and fills
    `aux_hidden`/`final_hidden` exactly as an offline capture of each sample would."""

    def __init__(self, target, aux_layers: Sequence[int], max_docs_per_forward: int = 64):
        from draftsmith.capture import AuxCapture

        self.target = target
        self.cap = AuxCapture(target, list(aux_layers), capture_final=True)
        self.max_docs = max_docs_per_forward

    @torch.no_grad()
    def fill(self, mb: MicroBatch, device) -> MicroBatch:
        dev = torch.device(device)
        ids = mb.input_ids[0].cpu()  # one device->host copy, not one sync per document slice
        starts = np.cumsum([0] + mb.doc_lengths)
        aux_parts, fin_parts = [], []
        docs = [(int(starts[j]), int(starts[j + 1])) for j in range(len(mb.doc_lengths))]
        for c in range(0, len(docs), self.max_docs):
            group = docs[c : c + self.max_docs]
            Lmax = max(b - a for a, b in group)
            x = torch.zeros(len(group), Lmax, dtype=torch.long)
            am = torch.zeros(len(group), Lmax, dtype=torch.long)
            for r, (a, b) in enumerate(group):
                x[r, : b - a] = ids[a:b]
                am[r, : b - a] = 1
            x, am = x.to(dev), am.to(dev)
            with self.cap:
                if len(group) == 1:
                    self.target.decoder(input_ids=x, use_cache=False)
                else:
                    self.target.decoder(input_ids=x, attention_mask=am, use_cache=False)
            for r, (a, b) in enumerate(group):
                aux_parts.append(self.cap.aux[r, : b - a])
                fin_parts.append(self.cap.final[r, : b - a])
        aux = torch.cat(aux_parts)
        fin = torch.cat(fin_parts)
        T = mb.input_ids.shape[1]
        if T > aux.shape[0]:
            aux = torch.cat([aux, aux.new_zeros(T - aux.shape[0], aux.shape[-1])])
            fin = torch.cat([fin, fin.new_zeros(T - fin.shape[0], fin.shape[-1])])
        mb.aux_hidden = aux[None]
        mb.final_hidden = fin[None]
        return mb


# ----------------------------------------------------------------------------------------------------
# batch sources: where the trainer's micro-batches come from
# ----------------------------------------------------------------------------------------------------
class BatchSource:
    """The samples of one training run and how a packed row of them becomes a micro-batch on the device.

    The trainer plans its packing from `lengths`, builds the drafter from `token_counts` (loss-masked token
    frequencies) and `aux_layers` (layer-output ids), and turns a row of sample indices into a micro-batch in two
    halves: `build(row)` on the host (called from the prefetch thread; thread-safe) and `to_device(mb, device)` on
    the main thread. `describe(row)` names a row's samples for an error message. Two implementations:
    `StoreBatches` (offline: the states come from a store) and `OnlineBatches` (the target runs in the loop).
    `fingerprint()` identifies the data (lengths + token counts), so a resume can tell whether it changed."""

    online = False

    def __init__(
        self,
        samples,
        lengths: np.ndarray,
        token_counts: torch.Tensor,
        aux_layers: Sequence[int],
        batch_tokens: int,
        pad_to: int = 1,
        pin: bool = False,
        where: str = "data",
    ):
        self.samples = samples
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.token_counts = token_counts
        self.aux_layers = list(aux_layers)
        self.batch_tokens = batch_tokens
        self.pad_to = pad_to
        self.pin = pin
        self.where = where  # the store or data path, for messages
        self._lock = threading.Lock()  # shard handles / tokenized samples are read from two threads

    def __len__(self) -> int:
        return len(self.samples)

    def build(self, row: Sequence[int]) -> MicroBatch:
        with self._lock:
            mb = build_micro_batch(
                self.samples, row, self.batch_tokens, with_states=not self.online, pad_to=self.pad_to
            )
        return mb.pin_memory() if self.pin else mb  # pinned: an asynchronous host->device copy of the states

    def to_device(self, mb: MicroBatch, device) -> MicroBatch:
        return mb.to(device)

    def describe(self, row: Sequence[int]) -> str:
        return f"samples {list(row)} of {self.where}"

    def fingerprint(self) -> str:
        import hashlib

        h = hashlib.sha256(self.lengths.tobytes())
        h.update(self.token_counts.to(torch.int64).numpy().tobytes())
        return h.hexdigest()[:32]


class StoreBatches(BatchSource):
    """Offline: micro-batches with the states a store (or any indexable of sample dicts) holds."""

    def describe(self, row: Sequence[int]) -> str:
        locate = getattr(self.samples, "locate", None)
        if locate is None:
            return super().describe(row)
        parts = []
        for i in row:
            si, j = locate(int(i))
            parts.append(f"sample {int(i)} ({self.samples.shards[si]['file']} #{j})")
        return f"{', '.join(parts)} of {self.where}"


class OnlineBatches(BatchSource):
    """Online: tokenized samples; `to_device` runs the target on the row's documents for the states
    (`OnlineStates`), rounded to bf16 like a bf16 store unless `state_dtype` is "fp32"."""

    online = True

    def __init__(
        self,
        samples,
        lengths,
        token_counts,
        aux_layers,
        batch_tokens,
        pad_to=1,
        pin=False,
        where="data",
        target=None,
        state_dtype: str = "bf16",
    ):
        super().__init__(samples, lengths, token_counts, aux_layers, batch_tokens, pad_to, pin, where)
        self.states = OnlineStates(target, self.aux_layers)
        self.state_dtype = state_dtype

    def to_device(self, mb: MicroBatch, device) -> MicroBatch:
        mb = self.states.fill(mb.to(device), device)
        if self.state_dtype == "bf16":
            mb.aux_hidden, mb.final_hidden = mb.aux_hidden.to(torch.bfloat16), mb.final_hidden.to(torch.bfloat16)
        return mb

    def describe(self, row: Sequence[int]) -> str:
        names = [getattr(self.samples[int(i)], "source", None) for i in row]
        if all(names):
            return f"samples {list(row)} ({', '.join(dict.fromkeys(names))})"
        return super().describe(row)


class Prefetcher:
    """Builds micro-batches in a background thread (order preserved). `items` yields (key, row)."""

    def __init__(self, build, items, depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._build = build
        self._items = items
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        try:
            for key, row in self._items:
                if self._stop:
                    break
                self._q.put((key, self._build(row), None))
        except BaseException as e:  # surface in the consumer
            self._q.put((None, None, e))
        self._q.put(None)

    def __iter__(self):
        while True:
            it = self._q.get()
            if it is None:
                return
            key, mb, err = it
            if err is not None:
                raise err
            yield key, mb

    def close(self):
        self._stop = True
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
