"""Reading a hidden-state store by memory map, with random access to samples."""

from __future__ import annotations

import bisect
import os
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftsmith.common.errors import ArtifactMismatchError, DraftsmithError
from draftsmith.common.io import read_json, sha256_file
from draftsmith.store import format as fmt
from draftsmith.store.manifest import validate_manifest


class HiddenStateStore:
    """A captured store. `s[i]` returns one sample's tensors, dequantized to `compute_dtype`.

    Shards are opened lazily with safetensors' `safe_open` (a memory map): reading a sample touches only
    that sample's rows.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: dict,
        dtype: torch.dtype = torch.bfloat16,
        check_sha256: bool | None = None,
    ):
        self.path = Path(path)
        self.manifest = manifest
        self.compute_dtype = dtype
        # fp8 stores only: hand out the raw fp8 rows plus their `aux_scale`/`final_scale` instead of dequantizing
        # here, so a trainer can dequantize on the GPU (half the bytes to copy, no host float work per row)
        self.defer_dequantize = False
        # Each shard's sha256 is checked against the manifest the first time the shard is opened (a corrupted
        # shard would otherwise train to NaN); off: DRAFTSMITH_STORE_CHECKSUMS=off or check_sha256=False.
        if check_sha256 is None:
            check_sha256 = os.environ.get("DRAFTSMITH_STORE_CHECKSUMS", "on").strip().lower() not in ("off", "0", "no")
        self.check_sha256 = bool(check_sha256)
        self.shards: list[dict] = manifest["shards"]
        # first global sample index of each shard (shards hold consecutive ranges)
        self._firsts = [s["first_sample"] for s in self.shards]
        self._handles: dict[int, Any] = {}
        self._index: dict[int, dict[str, np.ndarray]] = {}
        self._open_lock = threading.Lock()  # a trainer's prefetch thread and the main thread may both open shards

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, check_sha256: bool | None = None
    ) -> HiddenStateStore:
        """Open a complete store after checking its manifest (`draftsmith.store.manifest`: schema, paths inside
        the store, counts bounded by sizes, every shard's size equal to the manifest's). `check_sha256`: hash
        each shard on first use and refuse a mismatch (default on; DRAFTSMITH_STORE_CHECKSUMS=off turns it off)."""
        p = Path(path)
        if not p.is_dir():
            raise DraftsmithError(f"{p}: store not found")
        mpath = p / fmt.MANIFEST
        if not mpath.is_file():
            if (p / fmt.PLAN).is_file():
                raise DraftsmithError(
                    f"{mpath}: missing — the capture into {p} did not finish; rerun the same capture command to resume"
                )
            raise DraftsmithError(f"{mpath}: missing — {p} is not a draftsmith hidden-state store")
        manifest = validate_manifest(read_json(mpath, "store manifest"), p, check_sizes=True)
        return cls(p, manifest, dtype, check_sha256=check_sha256)

    # -- metadata ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def aux_layers(self) -> list[int]:
        """Aux layers in layer-output ids."""
        return list(self.manifest["aux_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def has_final(self) -> bool:
        return bool(self.manifest.get("has_final", False))

    @cached_property
    def lengths(self) -> np.ndarray:
        out = np.empty(len(self), dtype=np.int64)
        for si, sh in enumerate(self.shards):
            offs = self._shard_index(si)["sample_offsets"]
            out[sh["first_sample"] : sh["first_sample"] + sh["num_samples"]] = np.diff(offs)
        return out

    def token_counts(self) -> torch.Tensor:
        entry = self.manifest.get("token_counts") or {}
        p = self.path / entry.get("file", fmt.TOKEN_COUNTS)
        if not p.is_file():
            raise DraftsmithError(f"{p}: missing (token frequency statistics of the store)")
        if self.check_sha256 and entry.get("sha256") and sha256_file(p) != entry["sha256"]:
            raise DraftsmithError(
                f"{p}: sha256 does not match the manifest (corrupted; run `draftsmith store verify {self.path}`)"
            )
        return load_file(str(p))["token_counts"]

    def check_target(self, target) -> None:
        """Refuse a store captured from another target or tokenizer (names the field that differs)."""
        mine = self.manifest.get("target", {})
        for key in ("config_hash", "tokenizer_hash"):
            theirs = getattr(target, key, None)
            if theirs is None or not mine.get(key):
                continue
            if mine[key] != theirs:
                raise ArtifactMismatchError(
                    f"{self.path / fmt.MANIFEST}: target.{key} differs — this store was captured from "
                    f"{mine.get('path')!r}, not {getattr(target, 'path', '?')!r}"
                )

    # -- data ----------------------------------------------------------------------------------------
    def _handle(self, si: int):
        h = self._handles.get(si)
        if h is None:
            with self._open_lock:
                h = self._handles.get(si)
                if h is None:
                    h = self._open_shard(si)
                    self._handles[si] = h
        return h

    def _open_shard(self, si: int):
        sh = self.shards[si]
        f = self.path / sh["file"]
        if not f.is_file():
            raise DraftsmithError(f"{f}: shard missing (run `draftsmith store verify {self.path}`)")
        if "bytes" in sh and f.stat().st_size != sh["bytes"]:
            raise DraftsmithError(
                f"{f}: size {f.stat().st_size} != {sh['bytes']} in the manifest (truncated or "
                f"replaced; run `draftsmith store verify {self.path}`)"
            )
        if self.check_sha256 and "sha256" in sh and sha256_file(f) != sh["sha256"]:
            raise DraftsmithError(
                f"{f}: sha256 does not match the manifest (corrupted; run `draftsmith store verify {self.path}`)"
            )
        try:
            h = safe_open(str(f), framework="pt")
            self._check_shard_layout(si, h, f)
        except DraftsmithError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged header or tensor table, in whatever form it fails
            raise DraftsmithError(f"{f}: not a readable store shard ({' '.join(str(e).split())[:200]})") from None
        return h

    def _check_shard_layout(self, si: int, h, f: Path) -> None:
        """The shard's tensors agree with the manifest (shapes, offsets): its contents bound every later index."""
        sh, m = self.shards[si], self.manifest
        n, T = int(sh["num_samples"]), int(sh.get("num_tokens", -1))
        k, H = len(m["aux_layers"]), int(m["hidden_size"])

        def shape(name: str):
            if name not in h.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                raise DraftsmithError(f"{f}: tensor {name!r} missing from the shard")
            return tuple(h.get_slice(name).get_shape())

        rows = shape("input_ids")[0] if shape("input_ids") else -1
        want = {
            "input_ids": (rows,),
            "sample_offsets": (n + 1,),
            "span_offsets": (n + 1,),
            "aux_hidden_states": (rows, k * H),
        }
        if self.has_final:
            want["final_hidden_states"] = (rows, H)
        for name, expect in want.items():
            if shape(name) != expect:
                raise DraftsmithError(
                    f"{f}: tensor {name!r} has shape {list(shape(name))}, expected {list(expect)} "
                    f"from the manifest ({n} samples, {k} aux layers, hidden size {H})"
                )
        if T >= 0 and rows != T:
            raise DraftsmithError(f"{f}: holds {rows} tokens, the manifest says {T}")
        offs = h.get_tensor("sample_offsets").numpy()
        span_offs = h.get_tensor("span_offsets").numpy()
        spans = shape("loss_spans")
        if (
            offs[0] != 0
            or offs[-1] != rows
            or (np.diff(offs) < 0).any()
            or span_offs[0] != 0
            or (np.diff(span_offs) < 0).any()
            or span_offs[-1] != (spans[0] if spans else 0)
        ):
            raise DraftsmithError(f"{f}: sample_offsets/span_offsets are not consistent with its {rows} tokens")

    def _shard_index(self, si: int) -> dict[str, np.ndarray]:
        idx = self._index.get(si)
        if idx is None:
            h = self._handle(si)
            idx = {k: h.get_tensor(k).numpy() for k in ("sample_offsets", "loss_spans", "span_offsets")}
            self._index[si] = idx
        return idx

    def locate(self, i: int) -> tuple[int, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        if i < 0:
            i += len(self)
        si = bisect.bisect_right(self._firsts, i) - 1
        return si, i - self._firsts[si]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, j = self.locate(int(i))
        h = self._handle(si)
        idx = self._shard_index(si)
        a, b = int(idx["sample_offsets"][j]), int(idx["sample_offsets"][j + 1])
        spans = idx["loss_spans"][idx["span_offsets"][j] : idx["span_offsets"][j + 1]]
        out = {
            "input_ids": h.get_slice("input_ids")[a:b].to(torch.long),
            "loss_mask": torch.from_numpy(fmt.spans_to_mask(spans, b - a)),
        }
        self._read_states(out, h, "aux_hidden_states", "aux_scale", a, b)
        if self.has_final:
            self._read_states(out, h, "final_hidden_states", "final_scale", a, b)
        return out

    def _read_states(self, out: dict, h, name: str, scale_name: str, a: int, b: int) -> None:
        x = h.get_slice(name)[a:b]
        if self.manifest["dtype"] == "fp8":
            s = h.get_slice(scale_name)[a:b]
            if s.dim() == 1:
                s = s.unsqueeze(-1)
            if self.defer_dequantize:
                out[name], out[scale_name] = x, s
            else:
                out[name] = fmt.dequantize_fp8_rows(x, s, self.compute_dtype)
        else:
            out[name] = x.to(self.compute_dtype)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        self._handles.clear()
        self._index.clear()

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"HiddenStateStore({str(self.path)!r}, samples={len(self)}, tokens={m.get('num_tokens')}, "
            f"aux_layers={self.aux_layers} (layer-output ids), H={self.hidden_size}, dtype={m['dtype']})"
        )
