"""Reading a hidden-state store by memory map, with random access to samples."""

from __future__ import annotations

import bisect
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftsmith.common.errors import ArtifactMismatchError, DraftsmithError
from draftsmith.store import format as fmt
from draftsmith.common.io import read_json


class HiddenStateStore:
    """A captured store. `s[i]` returns one sample's tensors, dequantized to `compute_dtype`.

    Shards are opened lazily with safetensors' `safe_open` (a memory map): reading a sample touches only
    that sample's rows.
    """

    def __init__(self, path: str | os.PathLike, manifest: dict, dtype: torch.dtype = torch.bfloat16):
        self.path = Path(path)
        self.manifest = manifest
        self.compute_dtype = dtype
        # fp8 stores only: hand out the raw fp8 rows plus their `aux_scale`/`final_scale` instead of dequantizing
        # here, so a trainer can dequantize on the GPU (half the bytes to copy, no host float work per row)
        self.defer_dequantize = False
        self.shards: list[dict] = manifest["shards"]
        # first global sample index of each shard (shards hold consecutive ranges)
        self._firsts = [s["first_sample"] for s in self.shards]
        self._handles: dict[int, Any] = {}
        self._index: dict[int, dict[str, np.ndarray]] = {}

    # -- opening -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> "HiddenStateStore":
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
        manifest = read_json(mpath, "store manifest")
        if manifest.get("format") != fmt.FORMAT_NAME:
            raise DraftsmithError(f"{mpath}: field 'format' is {manifest.get('format')!r}, expected {fmt.FORMAT_NAME!r}")
        if int(manifest.get("format_version", -1)) > fmt.FORMAT_VERSION:
            raise DraftsmithError(
                f"{mpath}: format_version {manifest['format_version']} is newer than this draftsmith reads "
                f"({fmt.FORMAT_VERSION}); upgrade draftsmith"
            )
        for key in ("shards", "aux_layers", "hidden_size", "num_samples", "dtype"):
            if key not in manifest:
                raise DraftsmithError(f"{mpath}: missing field {key!r}")
        return cls(p, manifest, dtype)

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
        from safetensors.torch import load_file

        p = self.path / fmt.TOKEN_COUNTS
        if not p.is_file():
            raise DraftsmithError(f"{p}: missing (token frequency statistics of the store)")
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
            from safetensors import safe_open

            f = self.path / self.shards[si]["file"]
            if not f.is_file():
                raise DraftsmithError(f"{f}: shard missing (run `draftsmith store verify {self.path}`)")
            h = safe_open(str(f), framework="pt")
            self._handles[si] = h
        return h

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
