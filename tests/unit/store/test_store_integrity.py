"""Nothing written half, nothing read from outside the store, nothing reused from another capture (issue #14 items
1, 2, 4, 5, 6, 17): the manifest schema, the reader's size/sha256 checks, the capture's resume checks, its directory
lock and a full disk at each of its writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import capture, make_corpus, resize_tmpfs, small_tmpfs

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import LOCK_FILE_NAME, dir_lock
from draftsmith.store import HiddenStateStore
from draftsmith.store import format as fmt
from draftsmith.store.verify import verify_store
from draftsmith.target_model import load_target

REPO = Path(__file__).resolve().parents[3]
SETTINGS = {"aux_layers": [1, 3, 4], "max_length": 64, "shard_tokens": 150, "batch_tokens": 256, "writers": 1}


@pytest.fixture(scope="module")
def target(tiny_path):
    return load_target(tiny_path, dtype="fp32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data"), n_files=4)


@pytest.fixture(scope="module")
def store(tiny_path, corpus, target, tmp_path_factory):
    out = tmp_path_factory.mktemp("stores") / "ref"
    m = capture(tiny_path, corpus, out, target=target, **SETTINGS)
    assert len(m["shards"]) >= 3
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE_NAME
    }


def _copy(store: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(store, dst)
    if edit is not None:
        m = json.loads((dst / fmt.MANIFEST).read_text())
        edit(m)
        (dst / fmt.MANIFEST).write_text(json.dumps(m))
    return dst


# -- the manifest schema (item 5) ------------------------------------------------------------------------------
def _set(path: str, value):
    def edit(m):
        obj, keys = m, path.split(".")
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        if value is _DELETE:
            del obj[keys[-1]]
        else:
            obj[keys[-1]] = value

    return edit


_DELETE = object()
BAD_MANIFESTS = [
    ("hidden_size", _DELETE, r"field 'hidden_size' is missing"),
    ("num_samples", "12", r"field 'num_samples' must be an integer, not str"),
    ("num_samples", 1e9, r"field 'num_samples' must be an integer, not float 1000000000.0"),  # JSON's 1e9
    ("num_samples", 10**9, r"field 'num_samples' is 1000000000, but the shards hold \d+ samples"),
    ("shards.0.num_samples", 10**9, r"field 'shards\[0\]' claims 1000000000 samples .* more than its \d+ bytes"),
    ("shards.0.num_tokens", 10**7, r"field 'shards\[0\]' claims .* 10000000 tokens, more than its"),
    ("shards.0.file", "/etc/passwd", r"field 'shards\[0\].file' '/etc/passwd' is not a relative path inside"),
    ("shards.1.file", "shards/../../etc/passwd", r"field 'shards\[1\].file' .* leaves or is not a plain path"),
    ("shards.0.sha256", 5, r"field 'shards\[0\].sha256' must be a 64-digit"),
    ("shards.1.first_sample", 0, r"field 'shards\[1\].first_sample' is 0, expected \d+ \(shards hold consecutive"),
    ("token_counts.file", "../secret", r"field 'token_counts.file' '../secret' leaves"),
    ("dtype", "fp4", r"field 'dtype' is 'fp4', expected one of"),
    ("aux_layers", [1, "x"], r"field 'aux_layers' must be a non-empty list of layer ids"),
]


@pytest.mark.parametrize(
    "field,value,message",
    BAD_MANIFESTS,
    ids=[f"{b[0]}={'deleted' if b[1] is _DELETE else repr(b[1])[:12]}" for b in BAD_MANIFESTS],
)
def test_a_bad_manifest_is_one_line_naming_the_field(store, tmp_path, field, value, message):
    bad = _copy(store, tmp_path / "bad", _set(field, value))
    for reader in (HiddenStateStore.open, lambda p: verify_store(p, progress=False)):
        with pytest.raises(DraftsmithError, match=message) as e:
            reader(bad)
        assert "\n" not in str(e.value) and str(bad / fmt.MANIFEST) in str(e.value)


def test_a_shard_symlinked_out_of_the_store_is_refused(store, tmp_path):
    bad = _copy(store, tmp_path / "bad")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(store / fmt.shard_name(0), outside)  # same bytes: only the link's target is wrong
    (bad / fmt.shard_name(0)).unlink()
    (bad / fmt.shard_name(0)).symlink_to(outside)
    for reader in (HiddenStateStore.open, lambda p: verify_store(p, progress=False)):
        with pytest.raises(DraftsmithError, match=r"field 'shards\[0\].file' .* resolves outside the store"):
            reader(bad)


def test_cli_verify_and_info_refuse_a_bad_manifest_in_one_line(store, tmp_path):
    bad = _copy(store, tmp_path / "bad", _set("shards.0.file", "/etc/passwd"))
    e = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in (["store", "verify", str(bad), "-q"], ["store", "info", str(bad)]):
        r = subprocess.run(
            [sys.executable, "-m", "draftsmith", *cmd], cwd=REPO, env=e, capture_output=True, text=True, check=False
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.strip().splitlines() == [
            f"error: {bad / fmt.MANIFEST}: field 'shards[0].file' '/etc/passwd' is not a relative path inside the store"
        ]


# -- the reader trusts nothing (item 2) -------------------------------------------------------------------------
def test_a_corrupted_shard_is_named_on_first_read(store, tmp_path):
    bad = _copy(store, tmp_path / "bad")
    shard = bad / fmt.shard_name(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # flipped bits in the hidden states: same size, different sha256
    shard.write_bytes(bytes(data))
    s = HiddenStateStore.open(bad)  # sizes are right: opening is cheap and passes
    first_of_shard1 = s.manifest["shards"][1]["first_sample"]
    s[0]  # shard 0 is intact
    with pytest.raises(DraftsmithError, match=rf"{shard}: sha256 does not match the manifest \(corrupted"):
        s[first_of_shard1]
    fast = HiddenStateStore.open(bad, check_sha256=False)  # the check can be turned off (and then reads the damage)
    fast[first_of_shard1]


def test_a_truncated_shard_is_refused_when_opening(store, tmp_path):
    bad = _copy(store, tmp_path / "bad")
    shard = bad / fmt.shard_name(2)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DraftsmithError, match=rf"{shard}: size \d+ != \d+ in the manifest \(truncated"):
        HiddenStateStore.open(bad)


# -- capture: resume reuses only its own, intact shards (items 4, 17) --------------------------------------------
def _in_progress(store: Path, dst: Path, drop_plan: bool = False) -> Path:
    """A copy of a finished store as a capture killed before its manifest would leave it."""
    shutil.copytree(store, dst)
    (dst / fmt.MANIFEST).unlink()
    (dst / fmt.TOKEN_COUNTS).unlink()
    if drop_plan:
        (dst / fmt.PLAN).unlink()
    return dst


def test_without_plan_json_other_aux_layers_do_not_adopt_old_shards(tiny_path, corpus, target, store, tmp_path):
    out = _in_progress(store, tmp_path / "s", drop_plan=True)
    with pytest.raises(DraftsmithError, match=rf"{out / fmt.shard_name(0)}: captured with other settings or data"):
        capture(tiny_path, corpus, out, target=target, **{**SETTINGS, "aux_layers": [1, 2, 4]})


def test_a_corrupted_committed_shard_is_captured_again(tiny_path, corpus, target, store, tmp_path):
    out = _in_progress(store, tmp_path / "s")
    shard = out / fmt.shard_name(1)
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    capture(tiny_path, corpus, out, target=target, **SETTINGS)
    assert _tree(out) == _tree(store)


def test_changing_only_max_length_is_refused_naming_it(tiny_path, corpus, target, store, tmp_path):
    out = _in_progress(store, tmp_path / "s")
    with pytest.raises(DraftsmithError, match=r"field 'max_length' differs"):
        capture(tiny_path, corpus, out, target=target, **{**SETTINGS, "max_length": 48})


# -- capture: one job per directory, a file is not a directory (item 6) -----------------------------------------
def test_a_second_capture_into_a_locked_dir_fails_at_once(tiny_path, corpus, target, tmp_path):
    out = tmp_path / "s"
    with dir_lock(out, what="capture"):  # another capture holds it (flock: a second open file conflicts)
        want = rf"^{out} is in use by another draftsmith capture \(pid {os.getpid()}\)$"
        with pytest.raises(DraftsmithError, match=want):
            capture(tiny_path, corpus, out, target=target, **SETTINGS)
    assert not (out / fmt.PLAN).exists()


def test_cli_out_that_is_a_file_is_one_line(tiny_path, corpus, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    e = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith",
            "capture",
            "--target",
            str(tiny_path),
            "--data",
            str(corpus),
            "--out",
            str(f),
            "-q",
        ],
        cwd=REPO,
        env=e,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {f}: exists and is not a directory; choose another --out"
    ], r.stderr[-2000:]
    assert f.read_text() == "x"


# -- capture: a full disk at each write (item 1) ----------------------------------------------------------------
PAGE = 4096


def _pages(n: int) -> int:
    return max(1, -(-n // PAGE))


def _writes_in_order(store: Path) -> list[tuple[str, int]]:
    """(file, pages) in the order a one-writer capture commits them (after its .lock)."""
    m = json.loads((store / fmt.MANIFEST).read_text())
    order = [(fmt.PLAN, _pages((store / fmt.PLAN).stat().st_size))]
    for si in range(len(m["shards"])):
        order.append((fmt.shard_name(si), _pages((store / fmt.shard_name(si)).stat().st_size)))
        order.append((fmt.progress_name(si), 1))
    order.append((fmt.TOKEN_COUNTS, _pages((store / fmt.TOKEN_COUNTS).stat().st_size)))
    order.append((fmt.MANIFEST, _pages((store / fmt.MANIFEST).stat().st_size)))
    return order


@pytest.mark.parametrize("which", ["plan.json", "shard 0", "progress 1", "shard 2", "token_counts", "manifest"])
def test_a_full_disk_at_each_write_is_one_line_then_a_rerun_completes(
    tiny_path, corpus, target, store, tmp_path, which
):
    order = _writes_in_order(store)
    names = {
        "plan.json": fmt.PLAN,
        "shard 0": fmt.shard_name(0),
        "progress 1": fmt.progress_name(1),
        "shard 2": fmt.shard_name(2),
        "token_counts": fmt.TOKEN_COUNTS,
        "manifest": fmt.MANIFEST,
    }
    j = [name for name, _ in order].index(names[which])
    # room for the lock and every earlier file, and one page short of this one
    pages = 1 + sum(p for _, p in order[:j]) + order[j][1] - 1
    with small_tmpfs(tmp_path / "disk", pages * PAGE) as disk:
        out = disk / "store"
        with pytest.raises(DraftsmithError) as e:
            capture(tiny_path, corpus, out, target=target, **SETTINGS)
        assert str(e.value) == f"no space left on device: {out / names[which]}"
        assert not (out / names[which]).exists() and not list(out.rglob(".*.tmp"))  # nothing renamed, no temp left
        assert not (out / fmt.MANIFEST).exists()
        resize_tmpfs(disk, 64 * 1024 * 1024)
        capture(tiny_path, corpus, out, target=target, **SETTINGS)
        assert _tree(out) == _tree(store)


@pytest.mark.slow
def test_cli_full_disk_is_one_line_and_exit_2(tiny_path, corpus, store, tmp_path):
    with small_tmpfs(tmp_path / "disk", 3 * PAGE) as disk:  # the lock, plan.json, and no room for a shard
        out = disk / "store"
        e = dict(os.environ, OMP_NUM_THREADS="1")
        args = [
            "--target",
            str(tiny_path),
            "--data",
            str(corpus),
            "--out",
            str(out),
            "--aux-layers",
            "1,3,4",
            "--max-length",
            "64",
            "--shard-tokens",
            "150",
            "--batch-tokens",
            "256",
            "--writers",
            "1",
            "--model-dtype",
            "fp32",
            "-q",
        ]
        r = subprocess.run(
            [sys.executable, "-m", "draftsmith", "capture", *args],
            cwd=REPO,
            env=e,
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        errors = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error")]
        want = [f"error: no space left on device: {out / fmt.shard_name(0)}"]
        assert errors == want == r.stderr.strip().splitlines()[-1:]


def test_a_full_disk_during_a_store_export_is_one_line_and_leaves_nothing(store, tmp_path):
    pytest.importorskip("datasets")
    from draftsmith.export.speculators_store import export_speculators

    with small_tmpfs(tmp_path / "disk", 16 * PAGE) as disk:
        with pytest.raises(DraftsmithError, match=r"^no space left on device: .*spec\.tmp"):
            export_speculators(HiddenStateStore.open(store), disk / "spec", progress=False)
        assert list(disk.iterdir()) == []
