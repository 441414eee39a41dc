"""`draftsmith store verify`: check every checksum of a store and name what is wrong."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import read_json, sha256_file
from draftsmith.store import format as fmt
from draftsmith.store.manifest import validate_manifest


def verify_store(path: str | Path, progress: bool = True) -> list[str]:
    """Return a list of problems (empty = the store is intact).

    A manifest that fails its schema (`draftsmith.store.manifest`: fields, paths confined to the store, counts)
    raises a one-line DraftsmithError instead: nothing it names is opened or hashed.
    """
    p = Path(path)
    mpath = p / fmt.MANIFEST
    if not mpath.is_file():
        raise DraftsmithError(f"{mpath}: missing — not a complete draftsmith store")
    m = validate_manifest(read_json(mpath, "store manifest"), p)
    problems = []
    files = [(s["file"], s["sha256"], s.get("bytes")) for s in m.get("shards", [])]
    tc = m.get("token_counts")
    if tc:
        files.append((tc["file"], tc["sha256"], None))

    for name, digest, size in tqdm(files, desc="verify", unit="file", disable=not progress):
        f = p / name
        if not f.is_file():
            problems.append(f"{name}: missing")
            continue
        if size is not None and f.stat().st_size != size:
            problems.append(f"{name}: size {f.stat().st_size} != {size} in manifest (truncated or replaced)")
            continue
        got = sha256_file(f)
        if got != digest:
            problems.append(f"{name}: sha256 mismatch (corrupted): {got[:16]}… != {digest[:16]}…")
    return problems
