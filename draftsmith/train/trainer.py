"""The training loop: TTT over packed micro-batches, AdamW + warmup/cosine, DDP/FSDP2, checkpoints, resume.

Reading order: `Trainer.run` -> `setup` (device, target, a `BatchSource` -- the store offline, the target in the
loop online --, drafter, data plan, optimizer, resume) -> `train` (the loop) -> `train_step` (one optimizer step).

One optimizer step consumes `world_size * grad_accum` packed rows ("micro-batches") of the global stream
(`data.epoch_rows`); rank r takes rows [r*A, (r+1)*A) of each step's slice. Each micro-batch loss is the
mean over its own valid tokens, and the step's gradient is the mean over all micro-batches — so N
processes with accumulation A equal one process with accumulation N*A (the multi-process test).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from draftsmith.common import dtypes
from draftsmith.common.compiling import compile_seconds
from draftsmith.common.dist import all_reduce, barrier, dist_info, init_dist, resolve_device
from draftsmith.common.errors import DraftsmithError
from draftsmith.common.io import (
    LOCK_FILE_NAME,
    atomic_write_bytes,
    atomic_write_json,
    dir_lock,
    is_no_space,
    no_space_error,
)
from draftsmith.data import token_counts_from_samples
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.batches import (
    BatchSource,
    MicroBatch,
    OnlineBatches,
    Prefetcher,
    StoreBatches,
    epoch_rows,
    pack_rows,
    source_lengths,
    split_train_eval,
)
from draftsmith.train.config import TrainConfig  # re-exported: TrainConfig lived here
from draftsmith.train.ttt import TTTStats, compute_teacher, ttt_unroll
from draftsmith.train.warmup import BackgroundCompile, CacheWarmer, private_copy, warm_spec


# ---------------------------------------------------------------------------------------------------
# the model the optimizer steps: the whole TTT unroll as one forward
# ---------------------------------------------------------------------------------------------------
class TTTModel(nn.Module):
    """Wraps the drafter so that one `forward` is the whole K-step unroll (what DDP/FSDP need)."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = cfg.ttt_steps
        self.step_weight = cfg.step_weight
        # 'background' is flex attention compiled off the training thread (`warmup.py`): flex once it is ready
        self.backend = "flex" if cfg.attn_backend == "background" else cfg.attn_backend
        self.chunk = cfg.attn_chunk
        self.loss_chunk = cfg.loss_chunk
        self.compiled = None  # set by `enable_compile`

    def enable_compile(self, backend: str = "inductor", granularity: str = "unroll", mode: str | None = None) -> None:
        """granularity "unroll": the K-step unroll as one graph (the fastest steps, the longest compile); "step": one
        graph per step kind, reused by every step >= 1 (a compile time independent of K). BENCHMARKS.md has both."""
        from draftsmith.train.ttt import CompiledStepUnroll, CompiledUnroll

        # A recompile costs as much as the first compile (one at step 2 did, until the drafter's RoPE cache was
        # filled before compiling, `ttt._warm_drafter_caches`): if another guard ever fails, the log says which.
        torch._logging.set_logs(recompiles=True)
        if granularity == "step":
            self.compiled = CompiledStepUnroll(backend=backend)
        else:
            self.compiled = CompiledUnroll(backend=backend, mode=mode)

    def disable_compile(self) -> None:
        self.compiled = None

    def forward(self, input_ids, aux, doc_ids, position_ids, loss_mask, t_probs, t_argmax, t_in_vocab):
        from draftsmith.train.ttt import Teacher

        if self.compiled is not None and torch.is_grad_enabled():  # eval stays eager: no second compile
            return self.compiled(
                self.drafter,
                input_ids,
                aux,
                doc_ids,
                position_ids,
                loss_mask,
                Teacher(t_probs, t_argmax, t_in_vocab),
                self.ttt_steps,
                self.step_weight,
                self.loss_chunk,
            )
        loss, stats = ttt_unroll(
            self.drafter,
            input_ids,
            aux,
            doc_ids,
            loss_mask,
            Teacher(t_probs, t_argmax, t_in_vocab),
            ttt_steps=self.ttt_steps,
            step_weight=self.step_weight,
            backend=self.backend,
            chunk=self.chunk,
            position_ids=position_ids,
            loss_chunk=self.loss_chunk,
        )
        return loss, stats.as_tensor()


def lr_lambda_factory(total: int, warmup: int, min_ratio: float) -> Callable[[int], float]:
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if total <= warmup:
            return 1.0
        p = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))

    return f


# ---------------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------------


def forward_micro_batch(model, mb: MicroBatch, target, lm_w, d2t_ids, t2d, amp_dtype, seen=None):
    """Teacher from the micro-batch's final states, then the TTT unroll under autocast -> (loss, stats).
    The one forward of training and of `evaluate_drafter` (so the evaluator reproduces the trainer's numbers).
    `seen(inputs)`, if given, gets the tensors the model is called with (the compile-cache warmer's shapes)."""
    teacher = compute_teacher(mb.final_hidden, target.final_norm, lm_w, d2t_ids, t2d)
    aux = mb.aux_hidden.to(torch.float32) if amp_dtype is None else mb.aux_hidden
    inputs = (
        mb.input_ids,
        aux,
        mb.doc_ids,
        mb.position_ids,
        mb.loss_mask,
        teacher.probs,
        teacher.argmax,
        teacher.in_vocab,
    )
    if seen is not None:
        seen(inputs)
    ctx = torch.autocast(mb.input_ids.device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    with ctx:
        loss, stats = model(*inputs)
    return loss, stats.detach()


def amp_dtype(dtype: str, device: torch.device):
    """Autocast dtype for a --dtype value on a device (None = no autocast)."""
    dt = dtypes.parse_dtype(dtype, "--dtype")
    if dt == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return None if dt == torch.float32 else dt


# run-directory entries that mark a previous `draftsmith train` run (what may be resumed or trained over)
RUN_DIR_MARKERS = ("train_config.json", "checkpoints")
# settings a resume cannot change: the data plan, the drafter's shape, and what the restored optimizer and
# scheduler state would silently keep (their lr, betas, eps and weight decay come from the checkpoint)
RESUME_FIXED = (
    "ttt_steps",
    "batch_tokens",
    "seed",
    "eval_fraction",
    "draft_vocab_size",
    "step_weight",
    "online",
    "num_layers",
    "freeze_lm_head",
    "aux_layers",
    "lr",
    "beta1",
    "beta2",
    "adam_eps",
    "weight_decay",
)


@dataclass
class DataPlan:
    """The packing plan of a run: which samples train and evaluate, and how many optimizer steps."""

    train_idx: list[int]
    eval_rows: list[list[int]]
    rows_per_epoch: int
    micro_batches_per_step: int  # world_size * grad_accum
    total_steps: int
    warmup: int


class Trainer:
    """`setup()` (device, target, batch source, drafter, data plan, optimizer, resume), then `train()`: a short loop
    over the batch source that calls `train_step()` once per optimizer step and evaluates, logs and checkpoints.
    `run()` does both inside the run directory's lock."""

    def __init__(self, cfg: TrainConfig, *, target=None, source=None, log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.rank, self.world, self.local_rank = dist_info()
        self.is_main = self.rank == 0
        self._log = log or (lambda s: print(s, flush=True))
        self._given_target = target
        self._given_source = source
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"
        self.background: BackgroundCompile | None = None
        self.warmer: CacheWarmer | None = None
        self._prefetcher = None

    def log(self, msg: str) -> None:
        if self.is_main:
            self._log(msg)

    # ----------------------------------------------------------------------------------------- run
    def run(self) -> dict:
        cfg = self.cfg
        if cfg.ttt_steps < 1:
            raise DraftsmithError(f"--ttt-steps: must be >= 1, got {cfg.ttt_steps}")
        if cfg.steps is not None and cfg.epochs is not None:
            raise DraftsmithError("--steps and --epochs: give one, not both")
        if self.world > 1:
            backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
            init_dist(self.world, backend)
        self.device = resolve_device(cfg.device, self.local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # small tensors that go through collectives live where the process group's backend wants them
        self._reduce_device = self.device if self.world > 1 and self.device.type == "cuda" else torch.device("cpu")
        with contextlib.ExitStack() as held:
            self._claim_run_dir(held)
            try:
                self.setup()
                return self.train()
            except OSError as e:
                if is_no_space(e):
                    raise no_space_error(e.filename or self.out) from None
                raise
            finally:
                if self.warmer is not None:
                    self.warmer.close()
                if self._prefetcher is not None and hasattr(self._prefetcher, "close"):
                    self._prefetcher.close()

    def _claim_run_dir(self, held: contextlib.ExitStack) -> None:
        """Refuse an --out that holds something other than a run, and lock it (rank 0) for the whole run, so a second
        `draftsmith train` into it stops at once instead of interleaving its metrics and checkpoints."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise DraftsmithError(f"--out {out}: exists and is not a directory")
        if out.is_dir():
            entries = [p.name for p in out.iterdir() if p.name != LOCK_FILE_NAME]
            if entries and not any((out / m).exists() for m in RUN_DIR_MARKERS):
                shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
                raise DraftsmithError(
                    f"--out {out}: not empty ({shown}) and not a draftsmith run directory (no "
                    f"train_config.json or checkpoints/): give a new or an empty directory"
                )
        error = None
        if self.is_main:
            try:
                held.enter_context(dir_lock(out, what="train"))
            except DraftsmithError as e:
                error = e
        if self.world > 1:  # every rank stops when rank 0 could not lock (no rank left waiting in a collective)
            failed = all_reduce(torch.tensor([float(error is not None)], device=self._reduce_device), self.world)
            if error is None and float(failed.item()) > 0:
                raise DraftsmithError(f"--out {out}: rank 0 could not lock the run directory (see its error)")
        if error is not None:
            raise error

    # ----------------------------------------------------------------------------------------- setup
    def setup(self) -> None:
        cfg, device = self.cfg, self.device
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))
        resume = self._find_checkpoint()
        self.target = self._load_target()
        self.source = self._open_source()
        counts = self.source.token_counts
        if int(counts.numel()) != self.target.vocab_size:
            raise DraftsmithError(
                f"store token_counts has {counts.numel()} entries, the target vocab has "
                f"{self.target.vocab_size}: the store is of another target"
            )
        self.drafter = self._build_drafter().to(device)
        self.plan = self._plan_data()
        self.model = TTTModel(self.drafter, cfg)
        self.start_step, self.data_pos = 0, (0, 0)
        if resume is not None:
            self._restore_model(*resume)
        self._choose_step_path()
        self.wrapped = self._wrap(self.model)
        self.opt_params = [
            p for p in (self.wrapped.drafter if cfg.fsdp else self.drafter).parameters() if p.requires_grad
        ]
        self.param_names = [n for n, p in self.drafter.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.opt_params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_factory(self.plan.total_steps, self.plan.warmup, cfg.min_lr_ratio)
        )
        if resume is not None:
            self._restore_optimizer(*resume)
        self.step = self.start_step
        self.amp = amp_dtype(cfg.dtype, device)
        lm_w = self.target.lm_head.weight
        self.teacher_head = (lm_w, self.drafter.draft_target_ids.to(lm_w.device), self.drafter.t2d.to(lm_w.device))
        self.metrics_path = self.out / "metrics.jsonl"
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._truncate_metrics(self.metrics_path, self.start_step)
            atomic_write_json(self.out / "train_config.json", cfg.to_dict())
        self._log_setup()

    def _find_checkpoint(self) -> tuple[Path, dict] | None:
        if not (self.ckpt_root.is_dir() and ckpt.list_checkpoints(self.ckpt_root)):
            if self.cfg.resume:
                self.log(f"--resume: no checkpoint in {self.ckpt_root}; starting from step 0")
            return None
        if not self.cfg.resume:
            raise DraftsmithError(f"{self.out}: already holds checkpoints — pass --resume to continue, or a new --out")
        return ckpt.load_latest_checkpoint(self.ckpt_root, log=self.log)

    def _load_target(self):
        if self._given_target is not None:
            return self._given_target
        from draftsmith.target_model import load_target

        if not self.cfg.target:
            raise DraftsmithError("--target: required (the HF model directory the drafter is trained for)")
        dt = self.cfg.target_dtype
        if dt == "auto":
            dt = "bf16" if self.device.type == "cuda" else "fp32"
        if not self.cfg.progress or not self.is_main:  # -q, and the other ranks: no "Loading weights" bars
            import transformers

            transformers.utils.logging.disable_progress_bar()
        return load_target(self.cfg.target, dtype=dt, device=self.device)

    def _pad_to(self) -> int:
        """Rows padded to the token budget (a multiple of flex attention's 128-token blocks) when the flex backend
        runs: static shapes, one compile of flex attention per TTT step."""
        cfg = self.cfg
        backend = (
            cfg.attn_backend
            if cfg.attn_backend not in ("auto", "background")
            else ("flex" if self.device.type == "cuda" else "chunked")
        )
        pad = cfg.pad_to_budget if cfg.pad_to_budget is not None else backend == "flex"
        return (-(-cfg.batch_tokens // 128) * 128) if pad else 1

    def _open_source(self) -> BatchSource:
        cfg, target = self.cfg, self.target
        kw = dict(batch_tokens=cfg.batch_tokens, pad_to=self._pad_to(), pin=self.device.type == "cuda")
        if cfg.online:
            samples = self._given_source if self._given_source is not None else self._load_online_samples()
            if len(samples) == 0:
                raise DraftsmithError(f"{cfg.data}: no samples — nothing to train on")
            aux = list(cfg.aux_layers) if cfg.aux_layers else self._init_aux() or list(target.default_aux_layers)
            counts = token_counts_from_samples(samples, target.vocab_size)
            return OnlineBatches(
                samples,
                source_lengths(samples),
                counts,
                aux,
                where=cfg.data or "data",
                target=target,
                state_dtype=cfg.online_state_dtype,
                **kw,
            )
        src = self._given_source if self._given_source is not None else self._open_store()
        man = getattr(src, "manifest", None)
        where = f"{cfg.store}/manifest.json" if cfg.store else "store"
        if len(src) == 0:
            raise DraftsmithError(f"{where}: the store is empty (num_samples 0) — nothing to train on")
        if man is not None:
            self._check_store_fits_target(src, man, where)
            aux = list(man["aux_layers"])
            counts = src.token_counts()
        else:
            first = src[0]
            if first.get("final_hidden_states") is None:
                raise DraftsmithError("store: samples have no final_hidden_states (the teacher needs them)")
            aux = list(cfg.aux_layers) if cfg.aux_layers else None
            if aux is None:
                k = first["aux_hidden_states"].shape[-1] // target.hidden_size
                aux = list(target.default_aux_layers)[:k]
            counts = getattr(src, "token_counts", None)
            counts = counts() if callable(counts) else token_counts_from_samples(src, target.vocab_size)
        if cfg.aux_layers and list(cfg.aux_layers) != aux:
            raise DraftsmithError(
                f"--aux-layers {cfg.aux_layers} differ from the store's aux_layers {aux} (layer-output ids)"
            )
        return StoreBatches(src, source_lengths(src), counts, aux, where=cfg.store or "the store", **kw)

    def _load_online_samples(self):
        cfg, target = self.cfg, self.target
        if not cfg.data:
            raise DraftsmithError("--online: needs --data FILE_OR_DIR (the training text/conversations)")
        from draftsmith.data import load_samples

        if target.tokenizer is None:
            raise DraftsmithError(f"{cfg.target}: no tokenizer, needed by --online")
        # the capture's default cut (2048), never past the target's trained positions: online data must look like a
        # store captured with default settings (offline == online)
        max_len = cfg.max_length or min(
            cfg.batch_tokens, 2048, int(getattr(target.config, "max_position_embeddings", None) or 2048)
        )
        t_data = time.time()
        samples, report = load_samples(
            cfg.data,
            target.tokenizer,
            max_length=max_len,
            on_bad=cfg.on_bad,
            glob=cfg.glob,
            max_samples=cfg.max_samples,
        )
        if hasattr(report, "summary"):
            self.log(f"data: {report.summary()} ({time.time() - t_data:.1f}s)")
        return samples

    def _open_store(self):
        if not self.cfg.store:
            raise DraftsmithError("--store: required (or --online --data FILE_OR_DIR)")
        from draftsmith.store import HiddenStateStore

        src = HiddenStateStore.open(
            self.cfg.store, dtype=torch.float32 if self.device.type == "cpu" else torch.bfloat16
        )
        # fp8 rows cross to the GPU as fp8 (half the bytes) and dequantize there: on the host it is float work per
        # row, single-threaded under torchrun (OMP_NUM_THREADS=1), on the prefetch thread
        src.defer_dequantize = self.device.type == "cuda"
        return src

    def _check_store_fits_target(self, src, man: dict, where: str) -> None:
        cfg, target = self.cfg, self.target
        if hasattr(src, "check_target"):
            src.check_target(target)
        if int(man.get("hidden_size", target.hidden_size)) != target.hidden_size:
            raise DraftsmithError(
                f"{where}: field 'hidden_size' is {man['hidden_size']}, the target "
                f"{cfg.target} has {target.hidden_size}: the store is of another target"
            )
        if int(man.get("vocab_size", target.vocab_size)) != target.vocab_size:
            raise DraftsmithError(
                f"{where}: field 'vocab_size' is {man['vocab_size']}, the target "
                f"{cfg.target} has {target.vocab_size}: the store is of another target"
            )
        if not man.get("has_final", False):
            raise DraftsmithError(
                f"{where}: field 'has_final' is false — the store has no final hidden states, "
                f"which the teacher needs; recapture without --no-final"
            )

    def _init_drafter(self):
        """`--init-from`'s drafter (fp32, the target's embedding attached; fit to the target checked on loading),
        loaded once."""
        if getattr(self, "_init", None) is None:
            from draftsmith.drafter import Drafter

            self._init = Drafter.from_pretrained(self.cfg.init_from, target=self.target, dtype=torch.float32)
        return self._init

    def _init_aux(self) -> list[int] | None:
        """The aux layers of `--init-from`'s drafter (online data follows them unless --aux-layers says otherwise)."""
        if not self.cfg.init_from:
            return None
        return list(self._init_drafter().config.aux_layer_ids or []) or None

    def _drafter_from_init(self):
        cfg, d = self.cfg, self._init_drafter()
        where = f"--init-from {cfg.init_from}"
        aux = list(self.source.aux_layers)
        if list(d.config.aux_layer_ids or []) != aux:
            raise DraftsmithError(
                f"{where}: field 'aux_layer_ids' is {d.config.aux_layer_ids} (layer-output ids) but the training data "
                f"has aux layers {aux}: train on data with the drafter's layers (online: drop --aux-layers; "
                "offline: a store captured with them)"
            )
        if cfg.draft_vocab_size and cfg.draft_vocab_size != d.config.draft_vocab_size:
            raise DraftsmithError(
                f"{where}: field 'draft_vocab_size' is {d.config.draft_vocab_size}, --draft-vocab-size "
                f"{cfg.draft_vocab_size}: the drafter's draft vocab is kept (drop the flag)"
            )
        if cfg.num_layers not in (1, d.config.num_hidden_layers):
            raise DraftsmithError(
                f"{where}: field 'num_hidden_layers' is {d.config.num_hidden_layers}, --num-layers {cfg.num_layers}: "
                "the drafter's layers are kept (drop the flag)"
            )
        if cfg.freeze_lm_head:
            d.lm_head.weight.requires_grad_(False)
        self.log(
            f"init: {cfg.init_from} ({d.config.num_hidden_layers} layer(s), V_d={d.config.draft_vocab_size}, aux "
            f"layers {aux}); a fresh optimizer and schedule"
        )
        return d

    def _build_drafter(self):
        from draftsmith.drafter import Drafter

        if self.cfg.init_from:
            return self._drafter_from_init()
        cfg, target, counts = self.cfg, self.target, self.source.token_counts
        V = target.vocab_size
        vd = cfg.draft_vocab_size or min(32000, V)
        if vd > V:
            raise DraftsmithError(f"--draft-vocab-size: {vd} is larger than the target vocab ({V} tokens)")
        if vd <= 0:
            raise DraftsmithError(f"--draft-vocab-size: must be positive, got {vd}")
        distinct = int((counts > 0).sum())
        if distinct == 0:
            raise DraftsmithError(f"{self.source.where}: no loss-masked tokens — nothing to train on")
        if vd > distinct:  # the rest would be filled by token id: columns no training target ever names
            given = f"--draft-vocab-size {vd}" if cfg.draft_vocab_size else f"the default draft vocab ({vd})"
            self.log(
                f"note: {given} is more than the {distinct} distinct loss-masked tokens of "
                f"{self.source.where}: the draft vocab is capped at {distinct}"
            )
            vd = distinct
        drafter = Drafter.from_target(
            target,
            token_counts=counts,
            dtype=torch.float32,
            aux_layer_ids=list(self.source.aux_layers),
            draft_vocab_size=vd,
            num_hidden_layers=cfg.num_layers,
        )
        if cfg.freeze_lm_head:
            drafter.lm_head.weight.requires_grad_(False)
        return drafter

    def _plan_data(self) -> DataPlan:
        cfg = self.cfg
        train_idx, eval_idx = split_train_eval(len(self.source), cfg.eval_fraction, cfg.seed)
        if not train_idx:
            raise DraftsmithError("training split is empty (too few samples for --eval-fraction)")
        G = self.world * cfg.grad_accum
        rows0 = epoch_rows(train_idx, self.source.lengths, cfg.batch_tokens, cfg.seed, 0)
        if len(rows0) < G:
            raise DraftsmithError(
                f"only {len(rows0)} packed micro-batches of {cfg.batch_tokens} tokens per epoch, "
                f"fewer than world_size*grad_accum = {G}: lower --batch-tokens or --grad-accum"
            )
        if cfg.steps is not None:
            total = int(cfg.steps)
        else:
            total = max(1, math.ceil((cfg.epochs if cfg.epochs is not None else 1.0) * (len(rows0) // G)))
        warmup = int(cfg.warmup * total) if cfg.warmup < 1 else int(cfg.warmup)
        eval_rows = (
            pack_rows(eval_idx, self.source.lengths, cfg.batch_tokens)[: cfg.eval_max_batches] if eval_idx else []
        )
        return DataPlan(train_idx, eval_rows, len(rows0), G, total, warmup)

    def _restore_model(self, path: Path, ck: dict) -> None:
        st = ck["state"]
        self._check_resume_config(st, path)
        missing = self.drafter.load_state_dict(ck["model"], strict=False)
        if missing.unexpected_keys or [k for k in missing.missing_keys if not k.startswith("embed_tokens")]:
            raise DraftsmithError(f"{path}/model.safetensors: does not match the drafter ({missing})")
        self.start_step = int(st["step"])
        self.data_pos = tuple(st["data_position"])

    def _restore_optimizer(self, path: Path, ck: dict) -> None:
        cfg = self.cfg
        osd = ckpt.optimizer_from_flat(ck["optim_tensors"], ck["optim_meta"], None if cfg.fsdp else self.param_names)
        if cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            osd = _prefix_optim(osd, "drafter.")
            set_optimizer_state_dict(self.wrapped, self.optimizer, osd, options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(osd)
        self.scheduler.load_state_dict(ck["state"]["scheduler"])
        ckpt.set_rng_state(ck["rng_tensors"], ck["state"]["rng"])
        self.log(f"resumed from {path} at step {self.start_step} (epoch {self.data_pos[0]}, row {self.data_pos[1]})")

    def _check_resume_config(self, state: dict, where) -> None:
        old = state.get("config", {})
        diffs = [k for k in RESUME_FIXED if k in old and old[k] != getattr(self.cfg, k)]
        if diffs:
            now = [getattr(self.cfg, k) for k in diffs]
            raise DraftsmithError(
                f"{where}/trainer_state.json: --resume with different settings {diffs} "
                f"(checkpoint: {[old[k] for k in diffs]}, now: {now}); resume with the checkpoint's "
                f"values or train into a new --out"
            )
        what = "--data" if self.cfg.online else "--store"
        was = old.get("data" if self.cfg.online else "store")
        now = self.cfg.data if self.cfg.online else self.cfg.store
        changed = (
            (state["data_fingerprint"] != self.source.fingerprint())
            if "data_fingerprint" in state
            else (was is not None and now is not None and was != now)
        )
        if changed:
            raise DraftsmithError(
                f"{where}/trainer_state.json: --resume with different data: the checkpoint was "
                f"trained on {what} {was}, now {now} (other samples or token counts); resume with "
                f"the same data or train into a new --out"
            )

    def _choose_step_path(self) -> None:
        """Which TTT unroll the steps run. `--compile` asks for the compiled unroll (`_use_compile`). On CUDA the fast
        path (the compiled unroll, or flex attention's compiled kernels) has to compile first -- a minute or more.
        With `--attn-backend auto` (the default) the steps do not wait: they run the chunked attention, which
        compiles nothing, while a separate process fills torch's compile caches with the same graphs; once it is
        done, the trainer compiles the fast path itself from the warm caches (seconds) and switches
        (`warmup.CacheWarmer`). `--attn-backend background` compiles in a thread instead (experimental); an explicit
        `--attn-backend flex` or `--compile unroll/step/on` compiles before step 1 (a run that does not depend on
        how long the compile took)."""
        model = self.model
        use_compile = self._use_compile(self.device)
        if use_compile:
            model.enable_compile(granularity="step" if self.cfg.compile == "step" else "unroll")
        self._compile_pending = model.compiled is not None  # a synchronous compile may still fail at step 1
        self._fast_path = None  # what the first steps run without: "compiled" (the unroll) or "flex"
        self._probe_model = None
        # the warm start (default): None (not used), "pending" (step 1 not run), "running" (the child compiles),
        # "done" (switched or given up); this rank's child's outcome, and all ranks' (agreed in `train_step`)
        self._warm = self._warm_local = self._warm_agreed = self._first_inputs = None
        self._switch_step = None
        mode = self._deferred_compile()
        if mode is None:
            return
        self._fast_path = "compiled" if use_compile else "flex"
        self._pending_compiled, model.compiled = model.compiled, None
        self._compile_pending = False
        if mode == "thread":
            embedding = getattr(self.drafter, "embed_tokens", None)
            self._probe_model = private_copy(model, [embedding.weight] if embedding is not None else [])
            self._probe_model.compiled = self._pending_compiled
            self._probe_model.backend = "flex"
        else:
            self._warm = "pending"
        model.backend = "chunked"

    def _deferred_compile(self) -> str | None:
        """ "process" (the default on CUDA), "thread" (`--attn-backend background`) or None (compile when first
        called, before step 1 for the compiled unroll)."""
        if self.device.type != "cuda" or self.cfg.compile not in ("auto", "off", False):
            return None
        # The thread is opt-in only: torch's FX tracer, which the compile runs, patches nn.Module.__call__ for every
        # thread while it traces, so a training step that calls a module at that moment can fail (seen once on the
        # GPU). The process shares nothing with the trainer but the cache directory.
        return {"auto": "process", "background": "thread"}.get(self.cfg.attn_backend)

    def _log_setup(self) -> None:
        cfg, plan = self.cfg, self.plan
        n_params = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        if self._fast_path is not None:
            what = "the TTT unroll" if self._fast_path == "compiled" else "flex attention"
            where = "in the background" if self._warm is None else "in a separate process (after step 1)"
            compiling = f"; the first steps run the chunked attention while {what} compiles {where}"
        elif self.model.compiled is not None:
            compiling = (
                "; the first step compiles the TTT unroll (minutes, once per sequence length; --compile off skips it)"
            )
        else:
            compiling = ""
        self.log(
            f"train: {len(plan.train_idx)} train / {len(self.source) - len(plan.train_idx)} eval samples, "
            f"{plan.rows_per_epoch} micro-batches of <= {cfg.batch_tokens} tokens per epoch, world {self.world} "
            f"x accum {cfg.grad_accum}, {plan.total_steps} steps (warmup {plan.warmup}), K={cfg.ttt_steps}, "
            f"V_d={self.drafter.config.draft_vocab_size}, aux layers {self.source.aux_layers} (layer-output "
            f"ids), {n_params / 1e6:.2f}M trainable params, device {self.device}{compiling}"
        )

    # ----------------------------------------------------------------------------------------- train
    def train(self) -> dict:
        """The loop: one `train_step` per optimizer step from the resume position on, then evaluation, metrics,
        checkpoints, `--max-time`; the final drafter at the end."""
        cfg = self.cfg
        tb = self._tensorboard()
        bar = self._progress(self.plan.total_steps, self.start_step)
        self.t0 = time.time()
        tok_window, time_window = 0, time.time()
        last: dict = {}
        total_steps = self.plan.total_steps
        self.wrapped.train()
        try:
            for step_index, epoch, next_off, batches in self._step_batches():
                self._advance_step_path(step_index, batches)
                metrics, over = self.train_step(batches)
                self.step = step = step_index + 1
                stop_early = over and step < total_steps  # any rank over --max-time: all stop together
                rec = {"step": step, "epoch": epoch, **metrics}
                tok_window += rec["tokens"]
                if self._eval_due(step, total_steps, stop_early):
                    rec.update(self._evaluate())
                    self.wrapped.train()
                now = time.time()
                rec["tokens_per_s"] = tok_window / max(now - time_window, 1e-9)
                rec["elapsed_s"] = now - self.t0
                if step - self.start_step <= 2 or step == self._switch_step:
                    self._log_first_steps(step, rec["elapsed_s"] if step == self.start_step + 1 else now - time_window)
                tok_window, time_window = 0, now
                last = rec
                if self.is_main and (step % cfg.log_every == 0 or step == total_steps or "eval_loss" in rec):
                    with open(self.metrics_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    if tb is not None:
                        self._tb_log(tb, rec)
                if bar is not None:
                    bar.set_postfix(
                        loss=f"{rec['loss']:.3f}",
                        acc0=f"{rec['acc'][0]:.3f}",
                        tau=f"{rec['tau_sim']:.2f}",
                        refresh=False,
                    )
                    bar.update(1)
                if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps or stop_early:
                    self._save(step, (epoch, next_off))
                if stop_early:
                    self.log(
                        f"--max-time {cfg.max_time:g}s reached: stopped after step {step} of {total_steps} "
                        f"(checkpoint saved; --resume continues the same schedule)"
                    )
                    total_steps = step
                    break
                kill_at = os.environ.get("DRAFTSMITH_TEST_KILL_AT_STEP")
                if kill_at and int(kill_at) == step:  # test hook: simulate `kill -9` right after this step
                    os.kill(os.getpid(), 9)
        finally:
            if bar is not None:
                bar.close()
            if tb is not None:
                tb.close()
        if (self.background is not None and not self.background.done()) or self._warm in ("pending", "running"):
            self.log("note: the run ended before the compile finished: every step ran the chunked attention")
        self._save_final(total_steps)
        if self.is_main and cfg.plot:
            try:
                plot_metrics(self.metrics_path, self.out / "training.png")
            except Exception as e:  # plotting is optional
                self.log(f"plot skipped: {e}")
        barrier(self.world)
        return last

    def _step_batches(self):
        """This rank's micro-batches from the resume position on, grouped by optimizer step:
        (step index, epoch, next row offset, [(row, host micro-batch)] * grad_accum).

        A step consumes `world_size * grad_accum` consecutive rows of the epoch's packing; rank r takes rows
        [r*A, (r+1)*A) of them. Micro-batches are built ahead in a thread (`--prefetch`)."""
        cfg, plan = self.cfg, self.plan
        G, A = plan.micro_batches_per_step, cfg.grad_accum

        def rows():
            epoch, off = self.data_pos
            cache: dict[int, list] = {}
            step = self.start_step
            while step < plan.total_steps:
                if epoch not in cache:
                    cache.clear()
                    cache[epoch] = epoch_rows(plan.train_idx, self.source.lengths, cfg.batch_tokens, cfg.seed, epoch)
                epoch_rows_ = cache[epoch]
                if off + G > len(epoch_rows_):
                    epoch, off = epoch + 1, 0
                    continue
                mine = epoch_rows_[off + self.rank * A : off + (self.rank + 1) * A]
                for j, row in enumerate(mine):
                    yield (step, j, epoch, off + G, row), row
                off += G
                step += 1

        build = self.source.build
        if cfg.prefetch > 0:
            self._prefetcher = items = Prefetcher(build, rows(), depth=cfg.prefetch)
        else:
            items = ((key, build(row)) for key, row in rows())
        group = []
        for (step, j, epoch, next_off, row), mb in items:
            group.append((row, mb))
            if j == A - 1:
                yield step, epoch, next_off, group
                group = []

    def train_step(self, batches: list[tuple[list[int], MicroBatch]]) -> tuple[dict, bool]:
        """One optimizer step over this rank's micro-batches ([(row, host micro-batch)] * grad_accum): forward and
        backward of each (gradients synchronised across ranks on the last), the step's statistics summed over
        ranks, a stop on a non-finite loss or gradient norm (before the weights change), clipping, AdamW and the LR
        schedule. Returns (the step's metrics, whether any rank is past --max-time)."""
        cfg, device = self.cfg, self.device
        acc_stats, losses, tokens = None, [], 0
        loss_acc = torch.zeros((), dtype=torch.float64, device=device)
        for j, (_, host_mb) in enumerate(batches):
            mb = self.source.to_device(host_mb, device)
            loss, stats = self._forward_backward(mb, sync=j == len(batches) - 1)
            acc_stats = stats if acc_stats is None else acc_stats + stats
            losses.append(loss.detach())
            loss_acc += losses[-1].double()
            tokens += mb.num_tokens
        over = float(cfg.max_time is not None and time.time() - self.t0 >= cfg.max_time)
        ready, failed = float(self._warm_local == "ready"), float(self._warm_local == "failed")
        red = torch.cat(
            [
                acc_stats.reshape(-1).double(),
                loss_acc.reshape(1),
                torch.tensor([float(tokens), over, ready, failed], dtype=torch.float64, device=device),
            ]
        )
        red = all_reduce(red.to(self._reduce_device), self.world).cpu()
        # the warm start switches every rank at the same step (all ready), or none (any failed)
        if float(red[-1]) > 0:
            self._warm_agreed = "failed"
        elif float(red[-2]) >= self.world:
            self._warm_agreed = "ready"
        red = red[:-2]
        st = TTTStats.from_tensor(red[:-3].view(5, -1))
        loss_mean = float(red[-3]) / self.plan.micro_batches_per_step
        if not math.isfinite(loss_mean):
            raise self._non_finite("loss", loss_mean, batches, losses)
        gnorm = torch.nn.utils.clip_grad_norm_(self.opt_params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
        if hasattr(gnorm, "full_tensor"):
            gnorm = gnorm.full_tensor()
        gnorm = float(gnorm)
        if not math.isfinite(gnorm):
            raise self._non_finite("gradient norm", gnorm, batches, losses)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss_mean, **st.metrics(), "lr": lr, "grad_norm": gnorm, "tokens": int(red[-2])}
        return metrics, bool(red[-1] > 0)

    def _forward_backward(self, mb: MicroBatch, sync: bool):
        """Loss and statistics of one micro-batch, its gradient accumulated (across ranks only when `sync`)."""

        seen = None
        if self._warm == "pending" and self._first_inputs is None:

            def seen(inputs):
                self._first_inputs = inputs

        def forward_backward():
            loss, stats = forward_micro_batch(self.wrapped, mb, self.target, *self.teacher_head, self.amp, seen)
            with contextlib.nullcontext() if sync else self._no_sync(self.wrapped):
                (loss / self.cfg.grad_accum).backward()
            return loss, stats

        try:
            out = forward_backward()
        except Exception as e:  # only the first compiled call, before any gradient of its step exists, may fall back
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            if self._compile_pending and self._warm is not None:  # the switch after the warm start: stay chunked
                self.log(
                    f"warning: compiling the TTT unroll from the warm caches failed ({_first_line(e)}); training on "
                    f"with the chunked attention"
                )
                self.model.disable_compile()
                self.model.backend = "chunked"
                if oom:
                    torch.cuda.empty_cache()
            elif not self._compile_pending or oom or self.cfg.compile != "auto":
                raise
            else:
                self.log(
                    f"warning: the compiled TTT unroll failed ({_first_line(e)}); training eagerly "
                    f"(--compile off hides this)"
                )
                self.model.disable_compile()
            self.optimizer.zero_grad(set_to_none=True)
            out = forward_backward()
        self._compile_pending = False
        return out

    def _non_finite(self, what: str, value: float, batches, losses) -> DraftsmithError:
        step = self.step + 1
        bad = [row for (row, _), loss in zip(batches, losses) if not torch.isfinite(loss)] or (
            [row for row, _ in batches] if what != "loss" else []
        )
        where = "; ".join(self.source.describe(row) for row in bad) if bad else "another rank's micro-batches"
        data = f"`draftsmith store verify {self.cfg.store}`" if self.cfg.store and not self.cfg.online else "the data"
        return DraftsmithError(
            f"step {step}: the training {what} is {value} (not finite), on {where}; check {data}"
            f" (the checkpoints written so far are intact)"
        )

    def _advance_step_path(self, step_index: int, batches) -> None:
        """Background compile (see `_choose_step_path`): start it on the first micro-batch; at each later step
        boundary, switch to the fast path once it is compiled (or say that it failed and stay eager). The warm start
        (`_advance_warm`) likewise, with a separate process."""
        if self._warm is not None:
            self._advance_warm(step_index)
            return
        if self._probe_model is not None:
            probe_model, self._probe_model = self._probe_model, None
            mb = self.source.to_device(batches[0][1], self.device)

            def probe():
                loss, _ = forward_micro_batch(probe_model, mb, self.target, *self.teacher_head, self.amp)
                loss.backward()

            self.background = BackgroundCompile(probe, self.device).start()
            return
        bg = self.background
        if bg is None or not bg.done():
            return
        self.background = None
        what = "TTT unroll" if self._fast_path == "compiled" else "flex attention"
        if bg.error is not None:
            self.log(
                f"warning: compiling the {what} in the background failed ({_first_line(bg.error)}); training "
                f"on with the chunked attention"
            )
            return
        self.model.compiled = self._pending_compiled
        self.model.backend = "flex"
        self.log(
            f"step {step_index + 1}: the compiled {what} is ready ({bg.seconds:.0f}s in the background); "
            f"the steps from here on use it"
        )

    def _advance_warm(self, step_index: int) -> None:
        """After step 1 (whose forward recorded the input shapes, and whose memory the allocator now holds), start
        the child that warms the compile caches; at later boundaries, poll it, and once every rank's child is done
        switch to the fast path (compiled here from the warm caches at the next step). A failure anywhere: one
        line, and the steps stay chunked. Under torchrun every rank starts its own child on its own GPU: the caches
        are per machine (nodes share none) and every rank compiles in-process anyway; switching all ranks at one
        step (agreed in `train_step`'s reduction) puts those in-process compiles side by side, so the other ranks
        do not wait at the gradient reduction for each in turn, and every step runs one attention on all ranks."""
        what = "TTT unroll" if self._fast_path == "compiled" else "flex attention"
        if self._warm == "pending":
            if self._first_inputs is not None:
                self._start_warmer()
            return
        if self._warm != "running":
            return
        if self.warmer is not None and self._warm_local is None:
            state = self.warmer.poll()
            if state == "failed":
                self._warm_local = "failed"
                self.log(
                    f"warning: compiling the {what} in a separate process failed ({self.warmer.error}); training on "
                    f"with the chunked attention"
                )
            elif state == "ready":
                self._warm_local = "ready"
        if self._warm_agreed == "failed":
            self._warm = "done"
            if self._warm_local != "failed":
                self.log(
                    f"warning: compiling the {what} failed on another rank; training on with the chunked attention"
                )
        elif self._warm_agreed == "ready":
            self._warm = "done"
            self.model.compiled = self._pending_compiled
            self.model.backend = "flex"
            self._compile_pending = self.model.compiled is not None
            self._switch_step = step_index + 1
            took = f"{self.warmer.seconds:.0f}s warming the caches in a separate process" if self.warmer else "here"
            self.log(
                f"step {step_index + 1}: the compiled {what} is ready ({took}); compiled here from the caches, "
                f"the steps from here on use it"
            )

    def _start_warmer(self) -> None:
        inputs, self._first_inputs = self._first_inputs, None
        self._warm = "running"
        try:
            free, total = torch.cuda.mem_get_info(self.device)
            spare = free - (2 << 30)  # the child's CUDA context and what the trainer's allocator may still grow
            if spare < (1 << 30):
                self.log("note: too little free GPU memory for a second process: compiling here at the next step")
                self._warm_local = "ready"
                return
            spec = warm_spec(
                self.model,
                inputs,
                self.amp,
                self.device,
                self._fast_path,
                "unroll",
                evaluate=bool(self.plan.eval_rows),
                mem_fraction=spare / total,
            )
            name = "compile_warmup.log" if self.world == 1 else f"compile_warmup.rank{self.rank}.log"
            self.out.mkdir(parents=True, exist_ok=True)
            self.warmer = CacheWarmer(spec, self.out / name)
        except Exception as e:  # noqa: BLE001 - never fail the run for its start-up speed
            self._warm_local = "failed"
            self.log(f"warning: could not start the compile process ({_first_line(e)}); training on chunked")

    def _eval_due(self, step: int, total_steps: int, stop_early: bool) -> bool:
        cfg = self.cfg
        return bool(self.plan.eval_rows) and bool(
            (cfg.eval_every and step % cfg.eval_every == 0)
            or (not cfg.eval_every and cfg.save_every and step % cfg.save_every == 0)
            or step == total_steps
            or stop_early
        )

    def _log_first_steps(self, step: int, seconds: float) -> None:
        """The first steps' times, with what torch.compile spent (flex attention compiles even without --compile)."""
        n_graphs, fwd_s, bwd_s = compile_seconds()
        compiling = ""
        if step == self._switch_step:
            what = "the TTT unroll" if self._fast_path == "compiled" else "flex attention"
            compiling = f" (includes compiling {what} from the warm caches)"
        elif self.model.compiled is not None and step == self.start_step + 1:
            compiling = " (includes compiling the TTT unroll)"
        so_far = f"; torch.compile so far: {n_graphs} graphs {fwd_s:.1f}s + backward {bwd_s:.1f}s" if n_graphs else ""
        self.log(f"step {step}: {seconds:.1f}s{compiling}{so_far}")

    # ----------------------------------------------------------------------------------------- pieces
    def _use_compile(self, device) -> bool:
        """--compile: auto = on for a single CUDA process with the flex backend (one graph per sequence length).
        Not yet auto under torchrun: a compile failure at the first step of one rank would leave DDP's reducer
        mid-iteration, and the multi-GPU runs have not measured it; `--compile on` forces it."""
        c, b = self.cfg.compile, self.cfg.attn_backend
        if isinstance(c, bool):  # YAML 1.1 reads `compile: on/off` as booleans
            c = self.cfg.compile = "on" if c else "off"
        if c not in ("auto", "on", "unroll", "step", "off"):
            raise DraftsmithError(f"--compile: unknown {c!r} (auto, unroll, step, on = unroll, off)")
        flex = b == "flex" or (b in ("auto", "background") and device.type == "cuda")
        if c in ("on", "unroll", "step"):
            if not flex or device.type != "cuda":
                raise DraftsmithError(
                    f"--compile {c}: needs a CUDA device and the flex attention backend "
                    "(flex attention has no CPU backward); use --compile off"
                )
            return True
        return c == "auto" and flex and device.type == "cuda" and not self.cfg.fsdp and self.world == 1

    @torch.no_grad()
    def _evaluate(self) -> dict:
        """The eval split's metrics (`eval_` keys), summed over ranks (rank r scores rows r, r+world, ...)."""
        self.wrapped.eval()
        rows = self.plan.eval_rows
        per = math.ceil(len(rows) / self.world)
        mine = [rows[i] if i < len(rows) else None for i in range(self.rank, per * self.world, self.world)]
        total, loss_sum, n = None, 0.0, 0
        for row in mine:
            mb = self.source.to_device(self.source.build(row if row is not None else rows[0]), self.device)
            loss, stats = forward_micro_batch(self.wrapped, mb, self.target, *self.teacher_head, self.amp)
            if row is not None:  # a padding row keeps every rank in step with the collectives
                total = stats if total is None else total + stats
                loss_sum += float(loss)
                n += 1
        if total is None:
            total = torch.zeros(5, self.cfg.ttt_steps, dtype=torch.float64, device=self.device)
        red = torch.cat([total.reshape(-1).double().cpu(), torch.tensor([loss_sum, float(n)], dtype=torch.float64)])
        red = all_reduce(red.to(self._reduce_device), self.world).cpu()
        m = TTTStats.from_tensor(red[:-2].view(5, -1)).metrics(prefix="eval_")
        m["eval_loss"] = float(red[-2]) / max(1.0, float(red[-1]))
        return m

    def _wrap(self, model: TTTModel):
        if self.world == 1 and not self.cfg.fsdp:
            return model
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            # The TTT unroll calls each drafter layer K times per step: resharding after every forward would
            # all-gather the layer K times forward and K times backward (FSDP2 ran at 0.64 of linear that way, DDP at
            # 0.91; docs/LOG.md). Keep the layer unsharded from its first forward to the end of backward: one gather.
            for layer in model.drafter.layers:
                fully_shard(layer, reshard_after_forward=False)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev_ids = [self.device.index] if self.device.type == "cuda" else None
        import warnings

        with warnings.catch_warnings():  # torch >= 2.13 renames the flag; the old one keeps init-only sync off
            warnings.simplefilter("ignore", FutureWarning)
            return DDP(model, device_ids=dev_ids, broadcast_buffers=False)

    def _no_sync(self, wrapped):
        if hasattr(wrapped, "no_sync"):
            return wrapped.no_sync()
        if hasattr(wrapped, "set_requires_gradient_sync"):

            @contextlib.contextmanager
            def ctx():
                wrapped.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    wrapped.set_requires_gradient_sync(True)

            return ctx()
        return contextlib.nullcontext()

    def _unwrapped_drafter(self):
        return self.wrapped.module.drafter if hasattr(self.wrapped, "module") else self.wrapped.drafter

    def _full_states(self, names):
        """(model_state, optim_tensors, optim_meta) — full (unsharded) on every rank."""
        wrapped, optimizer = self.wrapped, self.optimizer
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
            msd = get_model_state_dict(wrapped, options=opts)
            msd = {k[len("drafter.") :]: v.detach().cpu() for k, v in msd.items() if k.startswith("drafter.")}
            osd = get_optimizer_state_dict(wrapped, optimizer, options=opts)
            osd = _prefix_optim(osd, "drafter.", strip=True)
            ot, om = ckpt.optimizer_to_flat(osd, None)
            drafter = self._unwrapped_drafter()
            for b in ("d2t", "t2d"):
                msd[b] = getattr(drafter, b).detach().cpu()
            return msd, ot, om
        drafter = self._unwrapped_drafter()
        msd = {k: v.detach().cpu() for k, v in drafter.trainable_state_dict().items()}
        ot, om = ckpt.optimizer_to_flat(optimizer.state_dict(), names)
        return msd, ot, om

    def _save(self, step, data_pos):
        msd, ot, om = self._full_states(self.param_names)
        if self.is_main:
            state = {
                "step": step,
                "data_position": list(data_pos),
                "scheduler": self.scheduler.state_dict(),
                "config": self.cfg.to_dict(),
                "data_fingerprint": self.source.fingerprint(),
                "world_size": self.world,
                "global_micro_batches": self.plan.micro_batches_per_step,
                "drafter_config": self._unwrapped_drafter().config.to_dict(),
            }
            ckpt.save_checkpoint(self.ckpt_root, step, msd, ot, om, state, keep=self.cfg.keep_checkpoints)
        barrier(self.world)

    def _save_final(self, total_steps):
        from draftsmith.drafter import Drafter

        msd, _, _ = self._full_states(None if self.cfg.fsdp else self.param_names)
        if self.is_main:
            src = self._unwrapped_drafter()
            # (a drafter started from an export says where it came from in train.init_from; the file written here
            # is draftsmith's layout, so the loader's note of the source layout is not carried over)
            kept = {k: v for k, v in (src.config.extra or {}).items() if k != "source_format"}
            cfg = src.config.replace(
                extra={
                    **kept,
                    "train": {
                        "steps": total_steps,
                        "ttt_steps": self.cfg.ttt_steps,
                        "store": self.cfg.store,
                        "online": self.cfg.online,
                        "lr": self.cfg.lr,
                        "batch_tokens": self.cfg.batch_tokens,
                        "seed": self.cfg.seed,
                        **({"init_from": str(self.cfg.init_from)} if self.cfg.init_from else {}),
                    },
                }
            )
            d = Drafter(cfg)
            d.load_state_dict(msd, strict=False)
            dt = dtypes.parse_dtype(self.cfg.save_dtype, "--save-dtype", allow_auto=False)
            d.save_pretrained(self.out / "final", dtype=dt)
            self.log(f"final drafter: {self.out / 'final'}")
        barrier(self.world)

    def _truncate_metrics(self, path: Path, step: int) -> None:
        if not path.is_file():
            return
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut by kill -9
        atomic_write_bytes(path, ("\n".join(keep) + ("\n" if keep else "")).encode())

    def _tensorboard(self):
        if not (self.is_main and self.cfg.tensorboard):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:
            return None
        return SummaryWriter(str(self.out / "tensorboard"))

    def _tb_log(self, tb, rec):
        step = rec["step"]
        for k, v in rec.items():
            if k == "step":
                continue
            if isinstance(v, (int, float)):
                tb.add_scalar(k, v, step)
            elif isinstance(v, list) and k in ("acc", "cond_acc", "loss_k", "eval_acc", "eval_cond_acc", "eval_loss_k"):
                for i, x in enumerate(v):
                    tb.add_scalar(f"{k}/{i}", x, step)

    def _progress(self, total, start):
        if not (self.is_main and self.cfg.progress):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _prefix_optim(osd: dict, prefix: str, strip: bool = False) -> dict:
    def f(k):
        if strip:
            return k[len(prefix) :] if isinstance(k, str) and k.startswith(prefix) else k
        return prefix + k

    state = {f(k): v for k, v in osd["state"].items()}
    groups = [{**g, "params": [f(p) for p in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def plot_metrics(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(l) for l in Path(metrics_path).read_text().splitlines() if l.strip()]
    if not recs:
        return
    steps = [r["step"] for r in recs]
    K = len(recs[0]["acc"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k in range(K):
        a1.plot(steps, [r["acc"][k] for r in recs], label=f"acc_{k}")
    a1.set_xlabel("step")
    a1.set_ylabel("train accuracy per TTT step")
    a1.legend(fontsize=7)
    a2.plot(steps, [r["tau_sim"] for r in recs], label="train tau_sim")
    ev = [r for r in recs if "eval_tau_sim" in r]
    if ev:
        a2.plot([r["step"] for r in ev], [r["eval_tau_sim"] for r in ev], "o-", label="eval tau_sim")
    a2.set_xlabel("step")
    a2.set_ylabel("simulated acceptance length")
    a2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def train(cfg: TrainConfig, **kw) -> dict:
    """Run training; returns the last metrics record."""
    return Trainer(cfg, **kw).run()
