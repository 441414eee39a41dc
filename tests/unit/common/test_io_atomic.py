"""draftsmith.common.io writes: whole or nothing, and a full disk is one line naming the file."""

from __future__ import annotations

import errno

import pytest
import torch
from store_helpers import small_tmpfs

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import (
    _FullWriter,
    atomic_save_safetensors_streaming,
    atomic_write_bytes,
)


class _ShortRaw:
    """A raw file whose write() takes at most 3 bytes at a time (what a kernel may do), then 0 when 'full'."""

    name = "fake"

    def __init__(self, capacity):
        self.data = bytearray()
        self.capacity = capacity

    def write(self, b):
        n = min(3, len(b), self.capacity - len(self.data))
        self.data += bytes(b[:n])
        return n


def test_short_writes_are_retried_and_a_zero_write_is_a_full_disk():
    raw = _ShortRaw(capacity=100)
    w = _FullWriter(raw)
    assert w.write(b"0123456789") == 10 and bytes(raw.data) == b"0123456789"
    assert w.write(memoryview(torch.arange(4, dtype=torch.int32).numpy())) == 16  # non-byte views count bytes
    with pytest.raises(OSError) as e:
        w.write(b"x" * 200)
    assert e.value.errno == errno.ENOSPC


def test_enospc_is_one_line_and_nothing_is_renamed(tmp_path):
    with small_tmpfs(tmp_path / "disk", 256 * 1024) as disk:
        target = disk / "manifest.json"
        target.write_bytes(b"old")
        with pytest.raises(DraftsmithError) as e:
            atomic_write_bytes(target, b"x" * (1024 * 1024))
        assert str(e.value) == f"no space left on device: {target}"
        assert target.read_bytes() == b"old"  # the old file stays, nothing half-written replaced it
        assert sorted(p.name for p in disk.iterdir()) == ["manifest.json"]  # the temp file is gone
        with pytest.raises(DraftsmithError, match="no space left on device: .*shard.safetensors"):
            atomic_save_safetensors_streaming({"x": torch.zeros(200_000)}, disk / "shard.safetensors", chunk=4096)
        assert sorted(p.name for p in disk.iterdir()) == ["manifest.json"]
        # after freeing space the same write completes
        atomic_write_bytes(target, b"y" * (64 * 1024))
        assert target.read_bytes() == b"y" * (64 * 1024)
