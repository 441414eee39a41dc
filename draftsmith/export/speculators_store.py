"""Export a hidden-state store as the offline training data of vLLM's `speculators` 0.9.0 trainer.

`draftsmith store export STORE --format speculators --out DIR` writes DIR so that
`speculators train --data-path DIR --target-layer-ids ... --hidden-states-dtype bfloat16 --on-missing raise`
(or `scripts/train.py`) trains on exactly the tokens, loss masks and hidden states of the store. The layout is
the one speculators' own `prepare-data` + `generate-offline-data` produce (docs/speculators-format.md cites the
speculators functions that read each piece):

```
DIR/
  data-00000-of-0000N.arrow      HF `datasets` save_to_disk layout, torch format set (state.json),
  dataset_info.json, state.json  columns input_ids list<int32>, loss_mask list<int64> (0/1), seq_len int64
  hidden_states/hs_{i}.safetensors   per row i: hidden_states [L, k+1, H] (aux layers in the store's order,
                                  then the last layer's output *before* the final norm), token_ids int64 [L]
  token_freq.pt                  torch.save of {token_id: count} over loss-masked input_ids
  draftsmith_export.json         what was exported, and the speculators flags that match it (ignored by speculators)
```

Layer ids: the store names its aux layers in layer-output ids; speculators' `--target-layer-ids` uses
hidden_states ids (HF `output_hidden_states` index), i.e. layer-output id + 1. The summary and
`draftsmith_export.json` give both.

No pickle is read here: `token_freq.pt` is *written* with `torch.save` because that is the file speculators
loads (with `torch.load(weights_only=True)`); draftsmith never loads it back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from tqdm.auto import tqdm

from draftsmith.common.dtypes import torch_dtypes
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import fsync_dir, is_no_space, no_space_error
from draftsmith.store.reader import HiddenStateStore
from draftsmith.target_model.layers import to_hidden_states_ids

logger = logging.getLogger(__name__)

FORMAT_NAME = "speculators"
SPECULATORS_VERSION = "0.9.0"
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
EXPORT_INFO = "draftsmith_export.json"
_INCOMPLETE_MARKER = ".draftsmith-export-incomplete"
_STAGING_DIR = "_staging"

_DTYPES = torch_dtypes()  # the names --dtype takes (draftsmith.common.dtypes)


_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def hs_file_name(index: int) -> str:
    """speculators' name for row `index`'s hidden states (hs_connectors.FileTransfer.get_cached)."""
    return f"hs_{index}.safetensors"


def _require_datasets():
    try:
        import datasets  # optional dependency (the speculators extra)
        import pyarrow  # noqa: F401
    except ImportError as e:
        raise DraftsmithError(
            f"--format speculators needs the optional packages 'datasets' and 'pyarrow' ({e.name} is not "
            "installed): pip install 'draftsmith[speculators]'"
        ) from None
    import datasets  # optional dependency (the speculators extra)

    return datasets


def _resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        dtype = default
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise DraftsmithError(f"--dtype: {dtype!r} is not one of {sorted(set(_DTYPES))}")
        dtype = _DTYPES[dtype]
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise DraftsmithError(f"--dtype: hidden states can be exported as bf16, fp16 or fp32, not {dtype}")
    return dtype


def _prepare_tmp(out: Path) -> Path:
    if out.exists():
        if not out.is_dir():
            raise DraftsmithError(f"{out}: exists and is not a directory; choose another --out")
        if any(out.iterdir()):
            raise DraftsmithError(f"{out}: directory exists and is not empty; choose another --out or remove it")
    tmp = Path(str(out) + ".tmp")
    if tmp.exists():
        # Left by an interrupted export of ours (it carries our marker): safe to discard.
        if tmp.is_dir() and (tmp / _INCOMPLETE_MARKER).is_file():
            shutil.rmtree(tmp)
        else:
            raise DraftsmithError(
                f"{tmp}: exists and was not left by a draftsmith export; remove it or choose another --out"
            )
    tmp.mkdir(parents=True)
    (tmp / _INCOMPLETE_MARKER).write_text("draftsmith store export in progress\n")
    return tmp


def _write_synced(path: Path, data: bytes) -> None:
    """Write and fsync one file (inside the export's .tmp directory, which is renamed as a whole); a buffered write
    writes everything or raises, so a full disk is an OSError (ENOSPC), not a short file."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _store_meta(store) -> tuple[list[int], int, dict]:
    manifest = getattr(store, "manifest", None)
    if not isinstance(manifest, dict):
        raise DraftsmithError("store export: the store has no manifest")
    where = f"{getattr(store, 'path', 'store')}/manifest.json"
    try:
        aux_layers = [int(i) for i in manifest["aux_layers"]]
        hidden_size = int(manifest["hidden_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"{where}: field 'aux_layers' or 'hidden_size' missing or not integers ({e})") from None
    if not aux_layers:
        raise DraftsmithError(f"{where}: field 'aux_layers' is empty")
    if len(set(aux_layers)) != len(aux_layers):
        raise DraftsmithError(
            f"{where}: field 'aux_layers' {aux_layers} repeats a layer; speculators' --target-layer-ids must be "
            "distinct (speculators.models.utils.resolve_target_layer_ids), so this store cannot be trained there"
        )
    if manifest.get("has_final") is False:
        raise DraftsmithError(
            f"{where}: the store has no final_hidden_states (captured without the last layer's output); "
            "speculators needs it as the last slot of hidden_states — recapture with the final layer"
        )
    if manifest.get("final_is_pre_norm") is False:
        raise DraftsmithError(
            f"{where}: final_hidden_states were captured after the final norm; speculators expects the last "
            "layer's output before it (its frozen verifier_norm is applied at training time)"
        )
    return aux_layers, hidden_size, manifest


def _num_target_layers(manifest: dict) -> int | None:
    """The target's decoder layer count, from the store manifest (None when it does not say)."""
    target = manifest.get("target") if isinstance(manifest.get("target"), dict) else {}
    for value in (target.get("num_layers"), manifest.get("num_layers")):
        if value is not None:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    if manifest.get("final_layer") is not None:
        try:
            return int(manifest["final_layer"]) + 1
        except (TypeError, ValueError):
            return None
    return None


def export_speculators(
    store,
    out_dir: str | os.PathLike,
    progress: bool = True,
    *,
    dtype: torch.dtype | str | None = None,
) -> dict[str, Any]:
    """Write `store` as speculators 0.9.0 offline training data into `out_dir`; return a summary dict.

    `store` is a `HiddenStateStore`, a path to one, or anything with its interface (`len`, `__getitem__`,
    `manifest`, optionally `token_counts()` and `compute_dtype`). `dtype` is the dtype of the exported hidden
    states; default: what the store returns (`store.compute_dtype`, bf16 unless the store was opened
    otherwise) — speculators casts them to its `--hidden-states-dtype` while batching anyway. Row i of the
    Arrow dataset is store sample i (samples without loss tokens are kept, and counted in the summary).
    The export is atomic: it is built in `out_dir + ".tmp"` and renamed into place; an existing non-empty
    `out_dir` is refused. The summary (also written to `draftsmith_export.json`) names the layer ids in both
    conventions and the speculators train flags that match the export. A full disk is the one-line error
    "no space left on device: PATH" and leaves nothing behind.
    """
    datasets = _require_datasets()
    if isinstance(store, (str, os.PathLike)):
        store = HiddenStateStore.open(store)
    plan = _ExportPlan.of(store, dtype)
    out = Path(out_dir)
    tmp = _prepare_tmp(out)
    try:
        rows = _RowWriter(tmp, plan)

        with rows:
            for i in tqdm(range(plan.num_samples), desc="export speculators", unit="sample", disable=not progress):
                rows.add(i, store[i])
        _save_dataset(datasets, rows.rows_path, tmp, progress)
        summary = _write_summary(store, tmp, out, plan, rows)
        _commit(tmp, out)
    except BaseException as e:
        # Leave nothing half-written under the final name; the marked .tmp is removed too.
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(e):
            raise no_space_error(getattr(e, "filename", None) or tmp) from None
        raise
    if summary["token_counts_match_store"] is False:
        logger.warning(
            "token_freq.pt was counted from the exported rows (as speculators counts: input_ids where loss_mask); "
            "it differs from the store's token_counts.safetensors"
        )
    return summary


@dataclass
class _ExportPlan:
    """What the export writes, from the store's manifest (checked against what speculators can train on)."""

    aux_layers: list[int]
    hidden_size: int
    manifest: dict
    target_layer_ids: list[int]  # hidden_states ids (speculators' --target-layer-ids)
    num_layers: int | None
    num_samples: int
    out_dtype: torch.dtype

    @property
    def k(self) -> int:
        return len(self.aux_layers)

    @classmethod
    def of(cls, store, dtype) -> _ExportPlan:
        aux_layers, hidden_size, manifest = _store_meta(store)
        target_layer_ids = to_hidden_states_ids(aux_layers)
        num_layers = _num_target_layers(manifest)
        if num_layers is not None and max(target_layer_ids) > num_layers:
            raise DraftsmithError(
                f"store manifest: aux_layers {aux_layers} (layer-output ids) out of range for a {num_layers}-layer "
                "target"
            )
        final_layer = manifest.get("final_layer")
        if num_layers is not None and final_layer is not None and int(final_layer) != num_layers - 1:
            raise DraftsmithError(
                f"store manifest: final_layer is {final_layer}, but speculators' last hidden_states slot is the "
                f"output of the last decoder layer ({num_layers - 1} of a {num_layers}-layer target)"
            )
        n = len(store)
        if n == 0:
            raise DraftsmithError(f"{getattr(store, 'path', 'store')}: the store has no samples; nothing to export")
        out_dtype = _resolve_dtype(dtype, getattr(store, "compute_dtype", None) or torch.bfloat16)
        return cls(aux_layers, hidden_size, manifest, target_layer_ids, num_layers, n, out_dtype)


class _RowWriter:
    """One hidden-state file per sample, its row into a staged Arrow stream, and the loss-masked token counts."""

    def __init__(self, tmp: Path, plan: _ExportPlan):
        import pyarrow as pa  # optional dependency (the speculators extra)

        self.plan = plan
        self.hs_dir = tmp / HIDDEN_STATES_DIR
        self.hs_dir.mkdir()
        staging = tmp / _STAGING_DIR
        staging.mkdir()
        self.rows_path = staging / "rows.arrow"
        self.schema = pa.schema(
            [
                # int32, as `datasets` stores a column named input_ids (OptimizedTypedSequence) and so
                # speculators' prepare-data output has it; the hidden-state files carry int64 token_ids.
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.int64())),
                ("seq_len", pa.int64()),
            ]
        )
        self.counts = torch.zeros(0, dtype=torch.long)
        self.buf = torch.empty(0, dtype=plan.out_dtype)
        self.num_tokens = self.num_loss_tokens = self.hs_bytes = self.unsupervised = 0
        self.batch: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}

    def __enter__(self) -> _RowWriter:
        import pyarrow as pa  # optional dependency (the speculators extra)

        self._sink = pa.OSFile(str(self.rows_path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, self.schema)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._flush()
            self._writer.close()
        finally:
            self._sink.close()
        if exc_type is None:
            fsync_dir(self.hs_dir)

    def _flush(self) -> None:
        import pyarrow as pa  # optional dependency (the speculators extra)

        if self.batch["seq_len"]:
            self._writer.write_batch(pa.record_batch(self.batch, schema=self.schema))
            for v in self.batch.values():
                v.clear()

    def add(self, i: int, s: dict) -> None:
        """Export store sample `i`: its hidden-state file, its Arrow row, its token counts."""
        ids, mask, hs = self._hidden_states(i, s)
        path = self.hs_dir / hs_file_name(i)
        _write_synced(path, save({"hidden_states": hs, "token_ids": ids.contiguous()}))
        self.hs_bytes += path.stat().st_size
        self._count(i, ids, mask)
        self.batch["input_ids"].append(ids.tolist())
        self.batch["loss_mask"].append(mask.to(torch.long).tolist())
        self.batch["seq_len"].append(ids.shape[0])
        if len(self.batch["seq_len"]) >= 256:
            self._flush()

    def _hidden_states(self, i: int, s: dict):
        """(input_ids, loss_mask, hidden_states [L, k+1, H]) of one sample, shapes checked."""
        k, hidden_size, out_dtype = self.plan.k, self.plan.hidden_size, self.plan.out_dtype
        where = f"store sample {i}"
        ids = torch.as_tensor(s["input_ids"]).reshape(-1).to(torch.long)
        L = ids.shape[0]
        mask = torch.as_tensor(s["loss_mask"]).reshape(-1).to(torch.bool)
        aux = s["aux_hidden_states"]
        final = s.get("final_hidden_states")
        if final is None:
            raise DraftsmithError(f"{where}: no final_hidden_states; speculators needs the last layer's output")
        if mask.shape[0] != L:
            raise DraftsmithError(f"{where}: loss_mask has {mask.shape[0]} tokens, input_ids {L}")
        if tuple(aux.shape) != (L, k * hidden_size):
            raise DraftsmithError(
                f"{where}: aux_hidden_states shape {tuple(aux.shape)}, expected ({L}, {k}*{hidden_size})"
            )
        if tuple(final.shape) != (L, hidden_size):
            raise DraftsmithError(
                f"{where}: final_hidden_states shape {tuple(final.shape)}, expected ({L}, {hidden_size})"
            )
        # [L, k+1, H]: aux slots in the store's aux_layers order, then the pre-norm final layer output.
        # Assembled in a reused buffer (fresh multi-MB allocations per sample cost page faults).
        if self.buf.numel() < L * (k + 1) * hidden_size:
            self.buf = torch.empty(L * (k + 1) * hidden_size, dtype=out_dtype)
        hs = self.buf[: L * (k + 1) * hidden_size].view(L, k + 1, hidden_size)
        # cat through same-width integer views: a bit-exact copy, and much faster on CPU than a strided bf16 copy_
        iv = _INT_VIEW[out_dtype]
        parts = [
            aux.to(out_dtype).contiguous().view(iv).view(L, k, hidden_size),
            final.to(out_dtype).contiguous().view(iv).view(L, 1, hidden_size),
        ]
        torch.cat(parts, dim=1, out=hs.view(iv))
        return ids, mask, hs

    def _count(self, i: int, ids: torch.Tensor, mask: torch.Tensor) -> None:
        masked = ids[mask]
        if masked.numel():
            if int(masked.min()) < 0:
                raise DraftsmithError(f"store sample {i}: negative token id in input_ids")
            c = torch.bincount(masked, minlength=self.counts.shape[0])
            if c.shape[0] > self.counts.shape[0]:
                c[: self.counts.shape[0]] += self.counts
                self.counts = c
            else:
                self.counts += c
        else:
            self.unsupervised += 1
        self.num_tokens += ids.shape[0]
        self.num_loss_tokens += int(masked.numel())


def _save_dataset(datasets, rows_path: Path, tmp: Path, progress: bool) -> None:
    """The Arrow dataset, in save_to_disk's layout with the torch format recorded in state.json — exactly what
    speculators' prepare-data writes (dataset.set_format("torch"); save_to_disk)."""
    ds = datasets.Dataset.from_file(str(rows_path), in_memory=False)
    ds = ds.with_format("torch")
    # optional dependency (the speculators extra)
    # optional dependency (the speculators extra)
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    silence = not progress and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        ds.save_to_disk(str(tmp))
    finally:
        if silence:
            enable_progress_bars()
    del ds
    shutil.rmtree(rows_path.parent)


def _write_summary(store, tmp: Path, out: Path, plan: _ExportPlan, rows: _RowWriter) -> dict[str, Any]:
    """token_freq.pt and draftsmith_export.json; returns the summary."""
    token_freq = {int(t): int(c) for t, c in enumerate(rows.counts.tolist()) if c}
    torch.save(token_freq, tmp / TOKEN_FREQ)
    store_counts_match = _compare_store_counts(store, rows.counts)
    k, out_dtype = plan.k, plan.out_dtype
    dtype_name = str(out_dtype).removeprefix("torch.")
    train_args = [
        "--data-path", os.path.abspath(out),
        "--target-layer-ids", *[str(i) for i in plan.target_layer_ids],
        "--hidden-states-dtype", "bfloat16" if out_dtype != torch.float32 else "float32",
        "--on-missing", "raise",
    ]  # fmt: skip
    summary: dict[str, Any] = {
        "format": FORMAT_NAME,
        "speculators_version": SPECULATORS_VERSION,
        "out_dir": os.path.abspath(out),
        "source_store": str(getattr(store, "path", "")),
        "num_samples": plan.num_samples,
        "num_tokens": rows.num_tokens,
        "num_loss_tokens": rows.num_loss_tokens,
        "unsupervised_samples": rows.unsupervised,
        "hidden_size": plan.hidden_size,
        "num_aux_layers": k,
        "aux_layers": plan.aux_layers,
        "aux_layers_convention": "layer-output ids",
        "target_layer_ids": plan.target_layer_ids,
        "target_layer_ids_convention": "hidden_states ids (speculators --target-layer-ids)",
        "num_target_layers": plan.num_layers,
        "hidden_states_shape": f"[L, {k + 1}, {plan.hidden_size}]",
        "hidden_states_slots": [f"hidden_states id {i}" for i in plan.target_layer_ids]
        + ["final layer output before the final norm"],
        "hidden_states_dtype": dtype_name,
        "hidden_states_bytes": rows.hs_bytes,
        "token_freq_entries": len(token_freq),
        "token_counts_match_store": store_counts_match,
        "speculators_train_args": train_args,
        "target": plan.manifest.get("target"),
    }
    (tmp / EXPORT_INFO).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return summary


def _commit(tmp: Path, out: Path) -> None:
    """Rename the finished export into place (fsync'ed first)."""
    (tmp / _INCOMPLETE_MARKER).unlink()
    fsync_dir(tmp)
    if out.exists():
        out.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
    os.replace(tmp, out)
    fsync_dir(out.parent)


def _compare_store_counts(store, counts: torch.Tensor) -> bool | None:
    """Whether the store's own loss-masked token counts agree with the exported rows (None: not available)."""
    fn = getattr(store, "token_counts", None)
    if fn is None:
        return None
    try:
        theirs = torch.as_tensor(fn()).reshape(-1).to(torch.long)
    except DraftsmithError:
        return None
    m = max(theirs.shape[0], counts.shape[0])
    a = torch.zeros(m, dtype=torch.long)
    b = torch.zeros(m, dtype=torch.long)
    a[: theirs.shape[0]] = theirs
    b[: counts.shape[0]] = counts
    return bool(torch.equal(a, b))


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """A human-readable rendering of `export_speculators`' summary (for the CLI)."""
    b = summary["hidden_states_bytes"]
    size = f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
    return [
        f"wrote {summary['out_dir']} (speculators {summary['speculators_version']} offline data)",
        f"  samples: {summary['num_samples']}  tokens: {summary['num_tokens']}  loss tokens: "
        f"{summary['num_loss_tokens']}  without loss tokens: {summary['unsupervised_samples']}",
        f"  hidden_states: {summary['hidden_states_shape']} {summary['hidden_states_dtype']} per sample, "
        f"{size}; slots = hidden_states ids {summary['target_layer_ids']} + final (pre-norm)",
        f"  aux layers: {summary['aux_layers']} (layer-output ids) = --target-layer-ids "
        f"{' '.join(map(str, summary['target_layer_ids']))} (hidden_states ids)",
        f"  train with: speculators train --speculator-type eagle3 --verifier-name-or-path TARGET "
        f"{' '.join(summary['speculators_train_args'])} [--draft-vocab-size N]",
    ]
