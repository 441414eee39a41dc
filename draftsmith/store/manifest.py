"""The store manifest's schema: checked before anything in it is used.

A manifest is user input (a store may come from anywhere), so every reader (`HiddenStateStore.open`, which
`train`, `store info` and `store export` use, and `store verify`) runs `validate_manifest` first:

* every field it reads is present and of the right type -- otherwise one line naming the field;
* every file it names is a relative path inside the store: no absolute path, no `..`, no symlink that
  resolves outside the store directory (so no reader ever opens or hashes a file elsewhere);
* every count is bounded by the bytes it claims: shards are consecutive, their sample and token counts add
  up to the totals, and a shard of `bytes` bytes cannot claim more tokens than `bytes / bytes_per_token`
  (so a forged `num_samples: 1e9` is refused before anything is allocated from it). With `check_sizes`, each
  shard's `bytes` must also equal the file's real size (a stat per shard, no reading).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any

from draftsmith.common.errors import DraftsmithError
from draftsmith.store import format as fmt

_MAX_HIDDEN = 1 << 20
_MAX_AUX = 256
# Per-sample bytes every shard holds whatever its tokens: sample_offsets + span_offsets (int64, n+1 each) and
# sample_index (int64, n).
_BYTES_PER_SAMPLE = 24
_SHA256_HEX = frozenset("0123456789abcdef")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Checker:
    def __init__(self, mpath: Path):
        self.mpath = mpath

    def fail(self, field: str, why: str) -> DraftsmithError:
        return DraftsmithError(f"{self.mpath}: field {field!r} {why}")

    def get(self, obj: dict, key: str, field: str, required: bool = True):
        if key not in obj:
            if required:
                raise self.fail(field, "is missing")
            return None
        return obj[key]

    def int_(self, obj: dict, key: str, field: str, lo: int = 0, hi: int | None = None, required: bool = True):
        v = self.get(obj, key, field, required)
        if v is None and not required:
            return None
        if not _is_int(v):
            raise self.fail(field, f"must be an integer, not {type(v).__name__} {v!r:.40}")
        if v < lo or (hi is not None and v > hi):
            raise self.fail(field, f"is {v}, outside [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    def bool_(self, obj: dict, key: str, field: str, required: bool = True):
        v = self.get(obj, key, field, required)
        if v is None and not required:
            return None
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, not {v!r:.40}")
        return v

    def sha256(self, obj: dict, key: str, field: str) -> str:
        v = self.get(obj, key, field)
        if not isinstance(v, str) or len(v) != 64 or not set(v) <= _SHA256_HEX:
            raise self.fail(field, f"must be a 64-digit lowercase hex sha256, not {v!r:.70}")
        return v

    def file(self, obj: dict, key: str, field: str, root: Path, root_real: str) -> str:
        v = self.get(obj, key, field)
        if not isinstance(v, str) or not v:
            raise self.fail(field, f"must be a file path relative to the store, not {v!r:.80}")
        pure = PurePosixPath(v)
        if pure.is_absolute() or v.startswith(("/", "\\")) or "\\" in v or "\x00" in v:
            raise self.fail(field, f"{v!r:.80} is not a relative path inside the store")
        if any(part in ("..", "") for part in v.split("/")) or "." in pure.parts:
            raise self.fail(field, f"{v!r:.80} leaves or is not a plain path inside the store (no '..', '.' or '//')")
        real = os.path.realpath(root / v)
        if os.path.commonpath([real, root_real]) != root_real or real == root_real:
            raise self.fail(field, f"{v!r:.80} resolves outside the store (a symlink to {real})")
        return v


def validate_manifest(manifest: Any, store_dir: str | os.PathLike, check_sizes: bool = False) -> dict:
    """Check a store manifest (see the module docstring); return it unchanged, or raise a one-line DraftsmithError.

    `check_sizes`: also stat every shard and require its real size to equal the manifest's `bytes` (a missing
    shard is an error too). `store verify` leaves this off and reports sizes itself, as a list of problems.
    """
    root = Path(store_dir)
    mpath = root / fmt.MANIFEST
    c = _Checker(mpath)
    if not isinstance(manifest, dict):
        raise DraftsmithError(f"{mpath}: must hold a JSON object, not {type(manifest).__name__}")
    if manifest.get("format") != fmt.FORMAT_NAME:
        raise c.fail("format", f"is {manifest.get('format')!r:.60}, expected {fmt.FORMAT_NAME!r}")
    version = c.int_(manifest, "format_version", "format_version", lo=1)
    if version > fmt.FORMAT_VERSION:
        raise DraftsmithError(
            f"{mpath}: format_version {version} is newer than this draftsmith reads ({fmt.FORMAT_VERSION}); "
            "upgrade draftsmith"
        )
    hidden = c.int_(manifest, "hidden_size", "hidden_size", lo=1, hi=_MAX_HIDDEN)
    aux = c.get(manifest, "aux_layers", "aux_layers")
    if not isinstance(aux, list) or not aux or len(aux) > _MAX_AUX or not all(_is_int(i) and i >= 0 for i in aux):
        raise c.fail("aux_layers", f"must be a non-empty list of layer ids >= 0, not {aux!r:.80}")
    dtype = c.get(manifest, "dtype", "dtype")
    if dtype not in fmt.STORE_DTYPES:
        raise c.fail("dtype", f"is {dtype!r:.40}, expected one of {list(fmt.STORE_DTYPES)}")
    has_final = c.bool_(manifest, "has_final", "has_final", required=False)
    num_samples = c.int_(manifest, "num_samples", "num_samples")
    num_tokens = c.int_(manifest, "num_tokens", "num_tokens")
    c.int_(manifest, "vocab_size", "vocab_size", lo=1, required=False)
    target = manifest.get("target")
    if target is not None and not isinstance(target, dict):
        raise c.fail("target", f"must be an object, not {type(target).__name__}")

    root_real = os.path.realpath(root)
    tc = manifest.get("token_counts")
    if tc is not None:
        if not isinstance(tc, dict):
            raise c.fail("token_counts", f"must be an object with 'file' and 'sha256', not {tc!r:.60}")
        c.file(tc, "file", "token_counts.file", root, root_real)
        c.sha256(tc, "sha256", "token_counts.sha256")

    shards = c.get(manifest, "shards", "shards")
    if not isinstance(shards, list):
        raise c.fail("shards", f"must be a list, not {type(shards).__name__}")
    # the least a token costs in a shard: its id (int32) and its hidden-state rows
    min_token_bytes = fmt.bytes_per_token(hidden, len(aux), dtype, bool(has_final))
    next_first, samples_total, tokens_total, seen = 0, 0, 0, set()
    for si, sh in enumerate(shards):
        where = f"shards[{si}]"
        if not isinstance(sh, dict):
            raise c.fail(where, f"must be an object, not {type(sh).__name__}")
        name = c.file(sh, "file", f"{where}.file", root, root_real)
        if name in seen:
            raise c.fail(f"{where}.file", f"{name!r} is listed twice")
        seen.add(name)
        c.sha256(sh, "sha256", f"{where}.sha256")
        nbytes = c.int_(sh, "bytes", f"{where}.bytes", lo=1)
        first = c.int_(sh, "first_sample", f"{where}.first_sample")
        n = c.int_(sh, "num_samples", f"{where}.num_samples", lo=1)
        t = c.int_(sh, "num_tokens", f"{where}.num_tokens")
        if first != next_first:
            raise c.fail(
                f"{where}.first_sample", f"is {first}, expected {next_first} (shards hold consecutive samples)"
            )
        if n * _BYTES_PER_SAMPLE + t * min_token_bytes > nbytes:
            raise c.fail(where, f"claims {n} samples and {t} tokens, more than its {nbytes} bytes can hold ({name})")
        if check_sizes:
            f = root / name
            try:
                real = f.stat().st_size
            except FileNotFoundError:
                raise DraftsmithError(f"{f}: shard missing (run `draftsmith store verify {root}`)") from None
            if real != nbytes:
                raise DraftsmithError(
                    f"{f}: size {real} != {nbytes} in the manifest (truncated or replaced; run "
                    f"`draftsmith store verify {root}`)"
                )
        next_first += n
        samples_total += n
        tokens_total += t
    if samples_total != num_samples:
        raise c.fail("num_samples", f"is {num_samples}, but the shards hold {samples_total} samples")
    if tokens_total != num_tokens:
        raise c.fail("num_tokens", f"is {num_tokens}, but the shards hold {tokens_total} tokens")
    return manifest
