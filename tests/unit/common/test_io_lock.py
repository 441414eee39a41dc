"""draftsmith.common.io.dir_lock: a second holder of a directory fails at once with one line naming the pid."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import LOCK_FILE_NAME, dir_lock

_HOLD = """
import sys, time
from draftsmith.common.io import dir_lock
with dir_lock(sys.argv[1], what="capture"):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_second_process_fails_at_once_naming_the_owner(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DraftsmithError) as e, dir_lock(out, what="capture"):
            pass
        msg = str(e.value)
        assert msg == f"{out} is in use by another draftsmith capture (pid {holder.pid})"
    finally:
        holder.communicate("\n", timeout=30)
    # the holder is gone (its lock with it): the stale .lock file does not block
    with dir_lock(out, what="capture"):
        assert (out / LOCK_FILE_NAME).read_text().strip() == str(os.getpid())


def test_killed_holder_releases_the_lock(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait(timeout=30)
    with dir_lock(out, what="train"):
        pass


def test_not_reentrant_and_released_after_the_block(tmp_path):
    with dir_lock(tmp_path, what="train"):
        with pytest.raises(DraftsmithError, match="in use by another draftsmith train"):
            with dir_lock(tmp_path, what="train"):
                pass
    with dir_lock(tmp_path):
        pass


def test_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DraftsmithError, match="exists and is not a directory"):
        with dir_lock(f):
            pass
