"""The training loop: TTT over packed micro-batches, AdamW + warmup/cosine, DDP/FSDP2, checkpoints, resume.

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
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from draftsmith.common.dist import all_reduce, barrier, dist_info
from draftsmith.common.errors import DraftsmithError
from draftsmith.train import checkpoint as ckpt
from draftsmith.train.batches import (
    MicroBatch,
    OnlineStates,
    Prefetcher,
    build_micro_batch,
    epoch_rows,
    pack_rows,
    source_lengths,
    split_train_eval,
    token_counts_from_samples,
)
from draftsmith.train.config import TrainConfig  # re-exported: TrainConfig lived here
from draftsmith.train.ttt import TTTStats, compute_teacher, ttt_unroll


# ---------------------------------------------------------------------------------------------------
# distributed helpers
# ---------------------------------------------------------------------------------------------------
class TTTModel(nn.Module):
    """Wraps the drafter so that one `forward` is the whole K-step unroll (what DDP/FSDP need)."""

    def __init__(self, drafter: nn.Module, cfg: TrainConfig):
        super().__init__()
        self.drafter = drafter
        self.ttt_steps = cfg.ttt_steps
        self.step_weight = cfg.step_weight
        self.backend = cfg.attn_backend
        self.chunk = cfg.attn_chunk
        self.loss_chunk = cfg.loss_chunk
        self.compiled = None  # set by `enable_compile`

    def enable_compile(self, backend: str = "inductor", granularity: str = "unroll", mode: str | None = None) -> None:
        """granularity "unroll": the K-step unroll as one graph (measured: 335k tok/s at 8k on an H200, 155 s to
        compile); "step": one graph per step kind, reused by every step >= 1 (~2.5x less compile time on CPU)."""
        from draftsmith.train.ttt import CompiledStepUnroll, CompiledUnroll

        # A recompile costs minutes (one at step 2 cost 54 s on the H200 until the drafter's RoPE cache was filled
        # before compiling, `ttt._warm_drafter_caches`): if another guard ever fails, the log says which.
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
            return self.compiled(self.drafter, input_ids, aux, doc_ids, position_ids, loss_mask,
                                 Teacher(t_probs, t_argmax, t_in_vocab), self.ttt_steps, self.step_weight,
                                 self.loss_chunk)
        loss, stats = ttt_unroll(
            self.drafter, input_ids, aux, doc_ids, loss_mask, Teacher(t_probs, t_argmax, t_in_vocab),
            ttt_steps=self.ttt_steps, step_weight=self.step_weight, backend=self.backend, chunk=self.chunk,
            position_ids=position_ids, loss_chunk=self.loss_chunk,
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

def forward_micro_batch(model, mb: MicroBatch, target, lm_w, d2t_ids, t2d, amp_dtype):
    """Teacher from the micro-batch's final states, then the TTT unroll under autocast -> (loss, stats).
    The one forward of training and of `evaluate_drafter` (so the evaluator reproduces the trainer's numbers)."""
    teacher = compute_teacher(mb.final_hidden, target.final_norm, lm_w, d2t_ids, t2d)
    aux = mb.aux_hidden.to(torch.float32) if amp_dtype is None else mb.aux_hidden
    ctx = torch.autocast(mb.input_ids.device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    with ctx:
        loss, stats = model(mb.input_ids, aux, mb.doc_ids, mb.position_ids, mb.loss_mask,
                            teacher.probs, teacher.argmax, teacher.in_vocab)
    return loss, stats.detach()


def amp_dtype(dtype: str, device: torch.device):
    """Autocast dtype for a --dtype value on a device (None = no autocast)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if dtype in ("fp32", "float32"):
        return None
    if dtype in ("bf16", "bfloat16"):
        return torch.bfloat16
    if dtype in ("fp16", "float16"):
        return torch.float16
    raise DraftsmithError(f"--dtype: unknown {dtype!r} (auto, fp32, bf16, fp16)")

class Trainer:
    def __init__(self, cfg: TrainConfig, *, target=None, source=None, log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.rank, self.world, self.local_rank = dist_info()
        self.is_main = self.rank == 0
        self._log = log or (lambda s: print(s, flush=True))
        self._target = target
        self._source = source
        self.out = Path(cfg.out)
        self.ckpt_root = self.out / "checkpoints"

    def log(self, msg: str) -> None:
        if self.is_main:
            self._log(msg)

    # ----------------------------------------------------------------------------------------- setup
    def _setup_dist(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                backend = "nccl" if torch.cuda.is_available() and self.cfg.device != "cpu" else "gloo"
                dist.init_process_group(backend=backend)

    def _resolve_device(self) -> torch.device:
        d = self.cfg.device
        if d == "auto":
            d = "cuda" if torch.cuda.is_available() else "cpu"
        if d == "cuda":
            d = f"cuda:{self.local_rank}"
            torch.cuda.set_device(d)
        return torch.device(d)

    def _load_target(self, device):
        if self._target is not None:
            return self._target
        from draftsmith.target_model import load_target

        if not self.cfg.target:
            raise DraftsmithError("--target: required (the HF model directory the drafter is trained for)")
        dt = self.cfg.target_dtype
        if dt == "auto":
            dt = "bf16" if device.type == "cuda" else "fp32"
        if not self.cfg.progress or not self.is_main:  # -q, and the other ranks: no "Loading weights" bars
            import transformers

            transformers.utils.logging.disable_progress_bar()
        return load_target(self.cfg.target, dtype=dt, device=device)

    def _open_source(self, target, device):
        """Returns (source, lengths, token_counts, aux_layers, is_online)."""
        cfg = self.cfg
        if cfg.online:
            if self._source is not None:
                samples = self._source
            else:
                if not cfg.data:
                    raise DraftsmithError("--online: needs --data FILE_OR_DIR (the training text/conversations)")
                from draftsmith.data import load_samples

                if target.tokenizer is None:
                    raise DraftsmithError(f"{cfg.target}: no tokenizer, needed by --online")
                # the capture's default cut (2048), never past the target's trained positions: online data must
                # look like a store captured with default settings (offline == online)
                max_len = cfg.max_length or min(cfg.batch_tokens, 2048, int(getattr(
                    target.config, "max_position_embeddings", None) or 2048))
                t_data = time.time()
                samples, report = load_samples(cfg.data, target.tokenizer, max_length=max_len,
                                               on_bad=cfg.on_bad, glob=cfg.glob)
                if hasattr(report, "summary"):
                    self.log(f"data: {report.summary()} ({time.time() - t_data:.1f}s)")
            if len(samples) == 0:
                raise DraftsmithError(f"{cfg.data}: no samples — nothing to train on")
            aux = list(cfg.aux_layers) if cfg.aux_layers else list(target.default_aux_layers)
            counts = token_counts_from_samples(samples, target.vocab_size)
            return samples, source_lengths(samples), counts, aux, True
        if self._source is not None:
            src = self._source
        else:
            if not cfg.store:
                raise DraftsmithError("--store: required (or --online --data FILE_OR_DIR)")
            from draftsmith.store import HiddenStateStore

            sdt = torch.float32 if device.type == "cpu" else torch.bfloat16
            src = HiddenStateStore.open(cfg.store, dtype=sdt)
            # fp8 rows cross to the GPU as fp8 (half the bytes) and dequantize there: on the host it is float
            # work per row, single-threaded under torchrun (OMP_NUM_THREADS=1), on the prefetch thread
            src.defer_dequantize = device.type == "cuda"
        man = getattr(src, "manifest", None)
        where = f"{cfg.store}/manifest.json" if cfg.store else "store"
        if len(src) == 0:
            raise DraftsmithError(f"{where}: the store is empty (num_samples 0) — nothing to train on")
        if man is not None:
            if hasattr(src, "check_target"):
                src.check_target(target)
            if int(man.get("hidden_size", target.hidden_size)) != target.hidden_size:
                raise DraftsmithError(f"{where}: field 'hidden_size' is {man['hidden_size']}, the target "
                                      f"{cfg.target} has {target.hidden_size}: the store is of another target")
            if int(man.get("vocab_size", target.vocab_size)) != target.vocab_size:
                raise DraftsmithError(f"{where}: field 'vocab_size' is {man['vocab_size']}, the target "
                                      f"{cfg.target} has {target.vocab_size}: the store is of another target")
            if not man.get("has_final", False):
                raise DraftsmithError(f"{where}: field 'has_final' is false — the store has no final hidden states, "
                                      f"which the teacher needs; recapture without --no-final")
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
            raise DraftsmithError(f"--aux-layers {cfg.aux_layers} differ from the store's aux_layers {aux} "
                                  f"(layer-output ids)")
        return src, source_lengths(src), counts, aux, False

    def _build_drafter(self, target, counts, aux):
        from draftsmith.drafter import Drafter

        cfg = self.cfg
        V = target.vocab_size
        vd = cfg.draft_vocab_size or min(32000, V)
        if vd > V:
            raise DraftsmithError(f"--draft-vocab-size: {vd} is larger than the target vocab ({V} tokens)")
        if vd <= 0:
            raise DraftsmithError(f"--draft-vocab-size: must be positive, got {vd}")
        drafter = Drafter.from_target(target, token_counts=counts, dtype=torch.float32, aux_layer_ids=list(aux),
                                      draft_vocab_size=vd, num_hidden_layers=cfg.num_layers)
        if cfg.freeze_lm_head:
            drafter.lm_head.weight.requires_grad_(False)
        return drafter

    # ----------------------------------------------------------------------------------------- run
    def run(self) -> dict:
        cfg = self.cfg
        if cfg.ttt_steps < 1:
            raise DraftsmithError(f"--ttt-steps: must be >= 1, got {cfg.ttt_steps}")
        if cfg.steps is not None and cfg.epochs is not None:
            raise DraftsmithError("--steps and --epochs: give one, not both")
        self._setup_dist()
        device = self._resolve_device()
        self.device = device
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % (2**32))

        resume_from = None
        if self.ckpt_root.is_dir() and ckpt.list_checkpoints(self.ckpt_root):
            if not cfg.resume:
                raise DraftsmithError(f"{self.out}: already holds checkpoints — pass --resume to continue, or a new --out")
            resume_from = ckpt.latest_checkpoint(self.ckpt_root)
        elif cfg.resume:
            self.log(f"--resume: no checkpoint in {self.ckpt_root}; starting from step 0")

        target = self._load_target(device)
        source, lengths, counts, aux_layers, online = self._open_source(target, device)
        if int(counts.numel()) != target.vocab_size:
            raise DraftsmithError(f"store token_counts has {counts.numel()} entries, the target vocab has "
                                  f"{target.vocab_size}: the store is of another target")
        drafter = self._build_drafter(target, counts, aux_layers).to(device)
        self.drafter = drafter

        # data
        train_idx, eval_idx = split_train_eval(len(source), cfg.eval_fraction, cfg.seed)
        if not train_idx:
            raise DraftsmithError("training split is empty (too few samples for --eval-fraction)")
        G = self.world * cfg.grad_accum
        rows0 = epoch_rows(train_idx, lengths, cfg.batch_tokens, cfg.seed, 0)
        if len(rows0) < G:
            raise DraftsmithError(f"only {len(rows0)} packed micro-batches of {cfg.batch_tokens} tokens per epoch, fewer "
                                  f"than world_size*grad_accum = {G}: lower --batch-tokens or --grad-accum")
        steps_per_epoch = len(rows0) // G
        if cfg.steps is not None:
            total_steps = int(cfg.steps)
        else:
            total_steps = max(1, math.ceil((cfg.epochs if cfg.epochs is not None else 1.0) * steps_per_epoch))
        warmup = int(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)
        eval_rows = pack_rows(eval_idx, lengths, cfg.batch_tokens)[: cfg.eval_max_batches] if eval_idx else []

        # model + optimizer
        model = TTTModel(drafter, cfg)
        names = [n for n, p in drafter.named_parameters() if p.requires_grad]
        params = [p for n, p in drafter.named_parameters() if p.requires_grad]
        start_step, data_pos, ck = 0, (0, 0), None
        if resume_from is not None:
            ck = ckpt.load_checkpoint(resume_from)
            st = ck["state"]
            self._check_resume_config(st.get("config", {}), resume_from)
            missing = drafter.load_state_dict(ck["model"], strict=False)
            if missing.unexpected_keys or [k for k in missing.missing_keys if not k.startswith("embed_tokens")]:
                raise DraftsmithError(f"{resume_from}/model.safetensors: does not match the drafter ({missing})")
            start_step = int(st["step"])
            data_pos = tuple(st["data_position"])
        if self._use_compile(device):
            model.enable_compile(granularity="step" if cfg.compile == "step" else "unroll")
        compile_pending = model.compiled is not None  # the first step may still fail to compile: then eager
        wrapped = self._wrap(model)
        opt_params = params if not cfg.fsdp else [p for n, p in wrapped.drafter.named_parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(opt_params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                                      weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_factory(total_steps, warmup, cfg.min_lr_ratio))
        if ck is not None:
            osd = ckpt.optimizer_from_flat(ck["optim_tensors"], ck["optim_meta"], None if cfg.fsdp else names)
            if cfg.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                osd = _prefix_optim(osd, "drafter.")
                set_optimizer_state_dict(wrapped, optimizer, osd, options=StateDictOptions(full_state_dict=True))
            else:
                optimizer.load_state_dict(osd)
            scheduler.load_state_dict(ck["state"]["scheduler"])
            ckpt.set_rng_state(ck["rng_tensors"], ck["state"]["rng"])
            self.log(f"resumed from {resume_from} at step {start_step} (epoch {data_pos[0]}, row {data_pos[1]})")
        self.optimizer, self.scheduler, self.wrapped = optimizer, scheduler, wrapped

        # run dir, logging
        metrics_path = self.out / "metrics.jsonl"
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self._truncate_metrics(metrics_path, start_step)
            from draftsmith.common.io import atomic_write_json

            atomic_write_json(self.out / "train_config.json", cfg.to_dict())
        tb = self._tensorboard()
        n_params = sum(p.numel() for p in params)
        self.log(f"train: {len(train_idx)} train / {len(eval_idx)} eval samples, {len(rows0)} micro-batches of "
                 f"<= {cfg.batch_tokens} tokens per epoch, world {self.world} x accum {cfg.grad_accum}, "
                 f"{total_steps} steps (warmup {warmup}), K={cfg.ttt_steps}, V_d={drafter.config.draft_vocab_size}, "
                 f"aux layers {aux_layers} (layer-output ids), {n_params / 1e6:.2f}M trainable params, device {device}"
                 f"{'; the first step compiles the TTT unroll (minutes, once per sequence length; --compile off skips it)' if model.compiled is not None else ''}")

        online_states = OnlineStates(target, aux_layers) if online else None
        lm_w = target.lm_head.weight
        d2t_ids = drafter.draft_target_ids.to(lm_w.device)
        t2d = drafter.t2d.to(lm_w.device)
        amp_dtype = self._amp_dtype(device)

        self._source_lock = threading.Lock()
        backend = cfg.attn_backend if cfg.attn_backend != "auto" else ("flex" if device.type == "cuda" else "chunked")
        pad = cfg.pad_to_budget if cfg.pad_to_budget is not None else backend == "flex"
        # static shapes (one compile of flex attention per TTT step), a multiple of flex's 128-token blocks
        self._pad_to = (-(-cfg.batch_tokens // 128) * 128) if pad else 1

        pin = device.type == "cuda"

        def build(row):
            with self._source_lock:
                mb = build_micro_batch(source, row, cfg.batch_tokens, with_states=not online, pad_to=self._pad_to)
            return mb.pin_memory() if pin else mb  # async host->device copy of the states

        def stream():
            epoch, off = data_pos
            cache: dict[int, list] = {}
            step = start_step
            while step < total_steps:
                if epoch not in cache:
                    cache.clear()
                    cache[epoch] = epoch_rows(train_idx, lengths, cfg.batch_tokens, cfg.seed, epoch)
                rows = cache[epoch]
                if off + G > len(rows):
                    epoch, off = epoch + 1, 0
                    continue
                mine = rows[off + self.rank * cfg.grad_accum: off + (self.rank + 1) * cfg.grad_accum]
                for j, row in enumerate(mine):
                    yield (step, j, epoch, off + G), row
                off += G
                step += 1

        pf = Prefetcher(build, stream(), depth=cfg.prefetch) if cfg.prefetch > 0 else ((k, build(r)) for k, r in stream())
        bar = self._progress(total_steps, start_step)
        t0 = time.time()
        tok_window, time_window = 0, time.time()
        last: dict = {}
        step = start_step
        acc_stats = None
        loss_acc = torch.zeros((), dtype=torch.float64, device=device)
        tokens = 0
        wrapped.train()
        for (s, j, epoch, next_off), mb in pf:
            mb = mb.to(device)
            if online_states is not None:
                mb = online_states.fill(mb, device)
                if cfg.online_state_dtype == "bf16":
                    mb.aux_hidden = mb.aux_hidden.to(torch.bfloat16)
                    mb.final_hidden = mb.final_hidden.to(torch.bfloat16)
            def forward_backward():
                loss, stats = forward_micro_batch(wrapped, mb, target, lm_w, d2t_ids, t2d, amp_dtype)
                with self._no_sync(wrapped) if j < cfg.grad_accum - 1 else contextlib.nullcontext():
                    (loss / cfg.grad_accum).backward()
                return loss, stats

            try:
                loss, stats = forward_backward()
            except Exception as e:  # only the very first step, before any gradient exists, may fall back
                if not compile_pending or isinstance(e, torch.cuda.OutOfMemoryError) or cfg.compile != "auto":
                    raise
                self.log(f"warning: the compiled TTT unroll failed ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); training eagerly "
                         f"(--compile off hides this)")
                model.disable_compile()
                optimizer.zero_grad(set_to_none=True)
                loss, stats = forward_backward()
            compile_pending = False
            acc_stats = stats if acc_stats is None else acc_stats + stats
            loss_acc += loss.detach().double()
            tokens += mb.num_tokens
            if j < cfg.grad_accum - 1:
                continue
            # optimizer step
            gnorm = torch.nn.utils.clip_grad_norm_(opt_params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            if hasattr(gnorm, "full_tensor"):
                gnorm = gnorm.full_tensor()
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step = s + 1
            over = float(cfg.max_time is not None and time.time() - t0 >= cfg.max_time)
            red = torch.cat([acc_stats.reshape(-1).double(), loss_acc.reshape(1),
                             torch.tensor([float(tokens), over], dtype=torch.float64, device=device)])
            red = all_reduce(red.to(device if self.world > 1 and device.type == "cuda" else "cpu"), self.world).cpu()
            st = TTTStats.from_tensor(red[:-3].view(5, -1))
            loss_mean = float(red[-3]) / G
            step_tokens = int(red[-2])
            stop_early = bool(red[-1] > 0) and step < total_steps  # any rank over --max-time: all stop together
            acc_stats, loss_acc, tokens = None, torch.zeros((), dtype=torch.float64, device=device), 0
            tok_window += step_tokens
            rec = {"step": step, "epoch": epoch, "loss": loss_mean, **st.metrics(), "lr": lr,
                   "grad_norm": float(gnorm), "tokens": step_tokens}
            do_eval = eval_rows and ((cfg.eval_every and step % cfg.eval_every == 0) or
                                     (not cfg.eval_every and cfg.save_every and step % cfg.save_every == 0) or
                                     step == total_steps or stop_early)
            if do_eval:
                rec.update(self._evaluate(wrapped, eval_rows, source, online_states, target, lm_w, d2t_ids, t2d,
                                          amp_dtype, online))
                wrapped.train()
            now = time.time()
            rec["tokens_per_s"] = tok_window / max(now - time_window, 1e-9)
            rec["elapsed_s"] = now - t0
            if step - start_step <= 2:  # compile (and any recompile) time, visible: flex attention compiles even
                from draftsmith.common.compiling import compile_seconds  # with --compile off (3 min on 2 H200s)

                n_fr, fwd_s, bwd_s = compile_seconds()
                self.log(f"step {step}: {rec['elapsed_s'] if step == start_step + 1 else now - time_window:.1f}s"
                         f"{' (includes compiling the TTT unroll)' if model.compiled is not None and step == start_step + 1 else ''}"
                         f"{f'; torch.compile so far: {n_fr} graphs {fwd_s:.1f}s + backward {bwd_s:.1f}s' if n_fr else ''}")
            tok_window, time_window = 0, now
            last = rec
            if self.is_main and (step % cfg.log_every == 0 or step == total_steps or do_eval):
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                if tb is not None:
                    self._tb_log(tb, rec)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_mean:.3f}", acc0=f"{rec['acc'][0]:.3f}", tau=f"{rec['tau_sim']:.2f}",
                                refresh=False)
                bar.update(1)
            if (cfg.save_every and step % cfg.save_every == 0) or step == total_steps or stop_early:
                self._save(step, (epoch, next_off), wrapped, optimizer, scheduler, names)
            if stop_early:
                self.log(f"--max-time {cfg.max_time:g}s reached: stopped after step {step} of {total_steps} "
                         f"(checkpoint saved; --resume continues the same schedule)")
                total_steps = step
                break
            kill_at = os.environ.get("DRAFTSMITH_TEST_KILL_AT_STEP")
            if kill_at and int(kill_at) == step:  # test hook: simulate `kill -9` right after this step
                os.kill(os.getpid(), 9)
        if hasattr(pf, "close"):
            pf.close()
        if bar is not None:
            bar.close()
        if tb is not None:
            tb.close()
        self._save_final(wrapped, aux_layers, total_steps)
        if self.is_main and cfg.plot:
            try:
                plot_metrics(metrics_path, self.out / "training.png")
            except Exception as e:  # plotting is optional
                self.log(f"plot skipped: {e}")
        barrier(self.world)
        return last

    # ----------------------------------------------------------------------------------------- pieces
    def _use_compile(self, device) -> bool:
        """--compile: auto = on for a single CUDA process with the flex backend (one graph per sequence length).
        Not yet auto under torchrun: a compile failure at the first step of one rank would leave DDP's reducer
        mid-iteration, and the multi-GPU runs (issue 5) have not measured it; `--compile on` forces it."""
        c, b = self.cfg.compile, self.cfg.attn_backend
        if isinstance(c, bool):  # YAML 1.1 reads `compile: on/off` as booleans
            c = self.cfg.compile = "on" if c else "off"
        if c not in ("auto", "on", "unroll", "step", "off"):
            raise DraftsmithError(f"--compile: unknown {c!r} (auto, unroll, step, on = unroll, off)")
        flex = b == "flex" or (b == "auto" and device.type == "cuda")
        if c in ("on", "unroll", "step"):
            if not flex or device.type != "cuda":
                raise DraftsmithError(f"--compile {c}: needs a CUDA device and the flex attention backend "
                                      "(flex attention has no CPU backward); use --compile off")
            return True
        return c == "auto" and flex and device.type == "cuda" and not self.cfg.fsdp and self.world == 1

    def _amp_dtype(self, device):
        return amp_dtype(self.cfg.dtype, device)

    @torch.no_grad()
    def _evaluate(self, wrapped, eval_rows, source, online_states, target, lm_w, d2t_ids, t2d, amp_dtype, online):
        wrapped.eval()
        per = math.ceil(len(eval_rows) / self.world)
        mine = [eval_rows[i] if i < len(eval_rows) else None for i in range(self.rank, per * self.world, self.world)]
        total, loss_sum, n = None, 0.0, 0
        for row in mine:
            real = row is not None
            with self._source_lock:
                mb = build_micro_batch(source, row if real else eval_rows[0], self.cfg.batch_tokens,
                                       with_states=not online, pad_to=self._pad_to)
            mb = mb.to(self.device)
            if online_states is not None:
                mb = online_states.fill(mb, self.device)
                if self.cfg.online_state_dtype == "bf16":
                    mb.aux_hidden, mb.final_hidden = mb.aux_hidden.to(torch.bfloat16), mb.final_hidden.to(torch.bfloat16)
            loss, stats = forward_micro_batch(wrapped, mb, target, lm_w, d2t_ids, t2d, amp_dtype)
            if real:
                total = stats if total is None else total + stats
                loss_sum += float(loss)
                n += 1
        if total is None:
            total = torch.zeros(5, self.cfg.ttt_steps, dtype=torch.float64, device=self.device)
        red = torch.cat([total.reshape(-1).double().cpu(), torch.tensor([loss_sum, float(n)], dtype=torch.float64)])
        red = all_reduce(red.to(self.device if self.world > 1 and self.device.type == "cuda" else "cpu"), self.world).cpu()
        st = TTTStats.from_tensor(red[:-2].view(5, -1))
        m = st.metrics(prefix="eval_")
        m["eval_loss"] = float(red[-2]) / max(1.0, float(red[-1]))
        return m

    def _wrap(self, model: TTTModel):
        if self.world == 1 and not self.cfg.fsdp:
            return model
        if self.cfg.fsdp:
            from torch.distributed.fsdp import fully_shard

            # The TTT unroll calls each drafter layer K times per step: resharding after every forward would
            # all-gather the layer K times forward and K times backward (measured: FSDP2 0.64 of linear vs DDP 0.91
            # on 2 H200s). Keep the layer unsharded from its first forward to the end of backward: one gather.
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

    def _unwrapped_drafter(self, wrapped):
        return wrapped.module.drafter if hasattr(wrapped, "module") else wrapped.drafter

    def _full_states(self, wrapped, optimizer, names):
        """(model_state, optim_tensors, optim_meta) — full (unsharded) on every rank."""
        if self.cfg.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
            msd = get_model_state_dict(wrapped, options=opts)
            msd = {k[len("drafter."):]: v.detach().cpu() for k, v in msd.items() if k.startswith("drafter.")}
            osd = get_optimizer_state_dict(wrapped, optimizer, options=opts)
            osd = _prefix_optim(osd, "drafter.", strip=True)
            ot, om = ckpt.optimizer_to_flat(osd, None)
            drafter = self._unwrapped_drafter(wrapped)
            for b in ("d2t", "t2d"):
                msd[b] = getattr(drafter, b).detach().cpu()
            return msd, ot, om
        drafter = self._unwrapped_drafter(wrapped)
        msd = {k: v.detach().cpu() for k, v in drafter.trainable_state_dict().items()}
        ot, om = ckpt.optimizer_to_flat(optimizer.state_dict(), names)
        return msd, ot, om

    def _save(self, step, data_pos, wrapped, optimizer, scheduler, names):
        msd, ot, om = self._full_states(wrapped, optimizer, names)
        if self.is_main:
            state = {
                "step": step,
                "data_position": list(data_pos),
                "scheduler": scheduler.state_dict(),
                "config": self.cfg.to_dict(),
                "world_size": self.world,
                "global_micro_batches": self.world * self.cfg.grad_accum,
                "drafter_config": self._unwrapped_drafter(wrapped).config.to_dict(),
            }
            ckpt.save_checkpoint(self.ckpt_root, step, msd, ot, om, state, keep=self.cfg.keep_checkpoints)
        barrier(self.world)

    def _save_final(self, wrapped, aux_layers, total_steps):
        from draftsmith.drafter import Drafter

        msd, _, _ = self._full_states(wrapped, self.optimizer, None if self.cfg.fsdp else
                                      [n for n, p in self._unwrapped_drafter(wrapped).named_parameters() if p.requires_grad])
        if self.is_main:
            src = self._unwrapped_drafter(wrapped)
            cfg = src.config.replace(extra={**(src.config.extra or {}), "train": {
                "steps": total_steps, "ttt_steps": self.cfg.ttt_steps, "store": self.cfg.store,
                "online": self.cfg.online, "lr": self.cfg.lr, "batch_tokens": self.cfg.batch_tokens,
                "seed": self.cfg.seed}})
            d = Drafter(cfg)
            d.load_state_dict(msd, strict=False)
            dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.save_dtype)
            d.save_pretrained(self.out / "final", dtype=dt)
            self.log(f"final drafter: {self.out / 'final'}")
        barrier(self.world)

    def _check_resume_config(self, old: dict, where) -> None:
        keys = ("ttt_steps", "batch_tokens", "seed", "eval_fraction", "draft_vocab_size", "step_weight", "online",
                "num_layers", "freeze_lm_head", "aux_layers")
        diffs = [k for k in keys if k in old and old[k] != getattr(self.cfg, k)]
        if diffs:
            raise DraftsmithError(f"{where}/trainer_state.json: --resume with different settings {diffs} "
                                  f"(checkpoint: {[old[k] for k in diffs]}, now: {[getattr(self.cfg, k) for k in diffs]})")

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
        from draftsmith.common.io import atomic_write_bytes

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


def _prefix_optim(osd: dict, prefix: str, strip: bool = False) -> dict:
    def f(k):
        if strip:
            return k[len(prefix):] if isinstance(k, str) and k.startswith(prefix) else k
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
