"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

```
RUN_DIR/checkpoints/step-00000120/
  model.safetensors       drafter weights + d2t/t2d (fp32 master weights; never the target embedding)
  optimizer.safetensors   per-parameter optimizer state, keys "state.<param name>.<field>"
  optimizer.json          param groups (parameter names instead of indices), scalar state
  rng.safetensors         torch CPU / CUDA generator states (uint8)
  trainer_state.json      step, data position, scheduler, python/numpy RNG, config (written last)
RUN_DIR/checkpoints/latest.json   {"step": 120, "dir": "step-00000120"}
```
A checkpoint is written into a temporary directory and renamed into place, so a `kill -9` at any moment
leaves either the previous checkpoint or the new one, never a partial one.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import atomic_write_json, fsync_dir, is_no_space, no_space_error, read_json

STATE_FILE = "trainer_state.json"
LATEST = "latest.json"


def ckpt_name(step: int) -> str:
    return f"step-{step:08d}"


# ------------------------------------------------------------------------------------ optimizer state
def optimizer_to_flat(osd: dict, names: list[str] | None) -> tuple[dict[str, torch.Tensor], dict]:
    """torch optimizer state_dict -> (tensors, json). `names[i]` names param index i (None: keys are names)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key, st in osd["state"].items():
        name = names[key] if names is not None else str(key)
        for field, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state.{name}.{field}"] = val.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(name, {})[field] = val
    groups = []
    for g in osd["param_groups"]:
        g2 = {}
        for k, v in g.items():
            if k == "params":
                g2[k] = [names[p] if names is not None else str(p) for p in v]
            elif isinstance(v, tuple):
                g2[k] = {"__tuple__": list(v)}
            elif isinstance(v, torch.Tensor):
                g2[k] = {"__tensor__": v.item()}
            else:
                g2[k] = v
        groups.append(g2)
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict, names: list[str] | None) -> dict:
    """Inverse of `optimizer_to_flat`: keys become param indices (via `names`) or stay names."""
    index = {n: i for i, n in enumerate(names)} if names is not None else None
    state: dict = {}
    for k, v in tensors.items():
        assert k.startswith("state.")
        name, field = k[len("state.") :].rsplit(".", 1)
        key = index[name] if index is not None else name
        state.setdefault(key, {})[field] = v
    for name, fields in meta.get("scalars", {}).items():
        key = index[name] if index is not None else name
        state.setdefault(key, {}).update(fields)
    groups = []
    for g in meta["param_groups"]:
        g2 = {}
        for k, v in g.items():
            if k == "params":
                g2[k] = [index[p] if index is not None else p for p in v]
            elif isinstance(v, dict) and "__tuple__" in v:
                g2[k] = tuple(v["__tuple__"])
            elif isinstance(v, dict) and "__tensor__" in v:
                g2[k] = torch.tensor(v["__tensor__"])
            else:
                g2[k] = v
        groups.append(g2)
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------ RNG
def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if cuda and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "python" in meta:
        v, st, g = meta["python"]
        random.setstate((v, tuple(st), g))
    if "numpy" in meta:
        a, keys, pos, hg, cg = meta["numpy"]
        np.random.set_state((a, np.asarray(keys, dtype=np.uint32), pos, hg, cg))


# ------------------------------------------------------------------------------------ save / load
def save_checkpoint(
    root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_tensors: dict[str, torch.Tensor],
    optim_meta: dict,
    trainer_state: dict,
    keep: int = 2,
) -> Path:
    """Write a checkpoint atomically (temp dir + rename), point latest.json at it, prune old ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / ckpt_name(step)
    tmp = root / f".tmp-{ckpt_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        _write_checkpoint_files(tmp, model_state, optim_tensors, optim_meta, trainer_state)
    except OSError as e:  # nothing is renamed into place: the previous checkpoints stay the latest
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(e):
            raise no_space_error(final) from None
        raise
    if final.exists():  # a re-save of the same step (e.g. after resume): replace
        old = root / f".old-{ckpt_name(step)}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_json(root / LATEST, {"step": step, "dir": final.name})
    if keep and keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    for junk in root.glob(".tmp-*"):  # leftovers of killed writers
        if junk != tmp:
            shutil.rmtree(junk, ignore_errors=True)
    return final


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`save_file`, with a full disk raised as the OSError it is (safetensors reports it as its own error type)."""
    try:
        save_file(tensors, str(path))
    except OSError:
        raise
    except Exception as e:
        text = str(e)
        if "os error 28" in text or "os error 122" in text or "No space left" in text:
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise


def _write_checkpoint_files(tmp: Path, model_state, optim_tensors, optim_meta, trainer_state) -> None:
    tmp.mkdir()
    _save_tensors({k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}, tmp / "model.safetensors")
    _save_tensors(optim_tensors, tmp / "optimizer.safetensors")
    rng_t, rng_meta = rng_state()
    _save_tensors(rng_t, tmp / "rng.safetensors")
    (tmp / "optimizer.json").write_text(json.dumps(optim_meta, indent=1))
    state = dict(trainer_state)
    state["rng"] = rng_meta
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)


def list_checkpoints(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(out, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(root: Path) -> Path | None:
    ck = list_checkpoints(root)
    return ck[-1] if ck else None


def load_checkpoint(path: Path) -> dict:
    """Every file of a checkpoint; a missing, truncated or unparsable one is a one-line DraftsmithError naming it."""
    path = Path(path)
    for f in ("model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", STATE_FILE):
        if not (path / f).is_file():
            raise DraftsmithError(f"{path / f}: missing — checkpoint {path} is incomplete")

    def tensors(name: str) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(path / name))
        except Exception as e:  # safetensors raises its own error type for a cut or garbled file
            raise DraftsmithError(f"{path / name}: unreadable ({' '.join(str(e).split())[:160]})") from None

    out = {
        "model": tensors("model.safetensors"),
        "optim_tensors": tensors("optimizer.safetensors"),
        "optim_meta": read_json(path / "optimizer.json", "optimizer state"),
        "rng_tensors": tensors("rng.safetensors"),
        "state": read_json(path / STATE_FILE, "trainer state"),
    }
    if not isinstance(out["state"], dict):
        raise DraftsmithError(f"{path / STATE_FILE}: not a JSON object")
    for key in ("step", "data_position", "scheduler"):
        if key not in out["state"]:
            raise DraftsmithError(f"{path / STATE_FILE}: field {key!r} missing")
    return out


def load_latest_checkpoint(root: Path, log=None) -> tuple[Path, dict] | None:
    """(path, contents) of the newest checkpoint under `root` that reads back whole; None when there is none.

    A newer one that does not read back (a file cut short or garbled after it was written) is skipped with a
    warning through `log`, naming it and the one used instead; if none reads back, the newest one's error is raised.
    """
    first_error = None
    for path in reversed(list_checkpoints(root)):
        try:
            ck = load_checkpoint(path)
        except DraftsmithError as e:
            first_error = first_error or e
            if log is not None:
                log(f"warning: checkpoint {path.name} is unreadable ({e}); trying the previous one")
            continue
        if first_error is not None and log is not None:
            log(
                f"warning: resuming from the older checkpoint {path.name} (step {ck['state']['step']}): the newer "
                f"one is unreadable"
            )
        return path, ck
    if first_error is not None:
        raise first_error
    return None
