"""Regenerate the assistant turns of ShareGPT / OpenAI-messages JSONL with the target's own answers.

Per record, every assistant turn i is replaced by the target's answer to the conversation before it, in which the
earlier assistant turns are already the target's own (what the target would have said in that conversation).
System, user and tool turns keep their exact strings, and so do assistant turns that carry tool calls (their
calls and the tool results after them belong together); every other field of the record is kept; a
`provenance` object is added (target, its config hash, sampling settings, draftsmith version, source FILE:LINE).

Generation is batched: B records at a time, turn by turn, through `transformers` `generate()` with left padding
(on a GPU B=32..128 keeps the target busy; batch 1 is launch-bound). Sampling follows --temperature/--top-p
(0 = greedy).

Resume: the output is append-only, one complete JSON line per record, flushed and fsynced after each batch;
`OUT.progress.json` (written atomically after each batch) holds the settings and how many input records were
consumed. After a kill -9 the output is cut back to the last line the progress file vouches for and generation
continues from the next input record: no record is repeated or lost. A rerun with other settings is refused,
naming the setting.

Bad records follow the capture rules: `--on-bad error` stops at `FILE:LINE: reason`, `--on-bad skip` counts them.

Text data (`--continue-text`, for base/completion targets such as code models): the input is read like training
text (`draftsmith.data.load_samples`: {"text"} JSONL records or a directory of source files, long files cut into
windows of --max-length tokens); each sample becomes one record {"text": prefix + the target's continuation} whose
prefix is a slice of the sample of --prefix-tokens MIN:MAX tokens at a seeded random offset (a seed per sample, so a
resumed run draws the same prefixes). A drafter trained on these learns what the target itself writes after such
prompts — the text it will see when serving greedy completions — instead of the corpus's text.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from draftsmith import __version__
from draftsmith.common.errors import BadRecordError, DraftsmithError
from draftsmith.common.io import atomic_write_json, read_json
from draftsmith.data import load_samples
from draftsmith.data import records as R
from draftsmith.data.chat import render_checked
from draftsmith.target_model import load_target

# Settings that must match for a resume (others, like batch size, only change speed).
RESUME_KEYS = (
    "target",
    "target_config_hash",
    "data",
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "max_samples",
    "on_bad",
    "chat_template_kwargs",
    "continue_text",
    "prefix_tokens",
    "glob",
    "max_length",
)


@dataclass
class RegenerateConfig:
    target: str
    data: str
    out: str
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    batch_size: int = 32
    max_samples: Optional[int] = None
    on_bad: str = "error"
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    # auto = static on CUDA (transformers then compiles the decode step: ~8x the dynamic cache's tokens/s at batch 64
    # on the demo target, BENCHMARKS.md), dynamic on CPU (no compile there)
    cache: str = "auto"
    chat_template_kwargs: dict = field(default_factory=dict)
    # text mode (see the module docstring)
    continue_text: bool = False
    prefix_tokens: str = "16:256"
    glob: Optional[str] = None
    max_length: int = 2048

    def prefix_range(self) -> tuple[int, int]:
        try:
            lo, hi = (int(x) for x in str(self.prefix_tokens).split(":"))
        except ValueError:
            raise DraftsmithError(
                f"--prefix-tokens: expected MIN:MAX (e.g. 16:256), got {self.prefix_tokens!r}"
            ) from None
        if not 1 <= lo <= hi:
            raise DraftsmithError(f"--prefix-tokens: need 1 <= MIN <= MAX, got {self.prefix_tokens!r}")
        return lo, hi

    def validate(self) -> None:
        if self.on_bad not in ("error", "skip"):
            raise DraftsmithError(f"--on-bad: expected 'error' or 'skip', got {self.on_bad!r}")
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens: must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise DraftsmithError(f"--batch-size: must be >= 1, got {self.batch_size}")
        if self.temperature < 0:
            raise DraftsmithError(f"--temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DraftsmithError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.max_samples is not None and self.max_samples < 1:
            raise DraftsmithError(f"--max-samples: must be >= 1, got {self.max_samples}")
        if self.cache not in ("auto", "dynamic", "static"):
            raise DraftsmithError(f"--cache: expected 'auto', 'dynamic' or 'static', got {self.cache!r}")
        if self.continue_text:
            self.prefix_range()
            if self.max_length < 2:
                raise DraftsmithError(f"--max-length: must be >= 2, got {self.max_length}")
            if not Path(self.data).exists():
                raise DraftsmithError(f"{self.data}: --data not found (text JSONL or a directory of source files)")
        elif not Path(self.data).is_file():
            raise DraftsmithError(f"{self.data}: --data file not found (JSONL with conversations/messages)")
        if Path(self.out).resolve() == Path(self.data).resolve():
            raise DraftsmithError(f"{self.out}: --out must differ from --data")


def progress_path(out: str | os.PathLike) -> Path:
    return Path(str(out) + ".progress.json")


@dataclass
class _Item:
    where: str
    obj: dict  # the input record as decoded (edited in place)
    key: str  # "conversations" | "messages"
    content_keys: list  # per message: the key holding its text ("value" / "content")
    messages: list  # normalized messages (role, content, pass-through fields)
    turns: list  # indices of the assistant messages still to regenerate
    truncated: int = 0
    prompt: Optional[list] = None  # text mode: the prefix's token ids (BOS included when the data has one)
    extra: dict = field(default_factory=dict)  # more provenance (text mode: prefix offset and length)


def _prepare(where: str, obj, on_bad: str) -> _Item:
    """Validate one decoded record as a conversation (BadRecordError otherwise)."""
    if isinstance(obj, BadRecordError):
        raise obj
    rec = R.parse_record(obj, where, mode="chat")
    if rec.kind != "chat":
        raise R.bad(where, R.UNKNOWN_FORMAT, "regenerate needs 'conversations' or 'messages' records")
    key = "conversations" if "conversations" in obj else "messages"
    ckeys = []
    default = "value" if key == "conversations" else "content"
    for m in obj[key]:
        ckeys.append(
            default if default in m else ("content" if "content" in m else "value" if "value" in m else default)
        )
    # an assistant turn that calls tools is kept as the dataset has it: its tool calls and the tool results after
    # it belong together, and a regenerated text would not match them
    turns = [i for i, m in enumerate(rec.messages) if m["role"] == "assistant" and not m.get("tool_calls")]
    return _Item(where, obj, key, ckeys, rec.messages, turns)


def _records(cfg: RegenerateConfig, report: dict, log, start: int = 0):
    """Yield (index, _Item) for every input record from `start` on; bad ones raise or are counted (yielded as
    None: the index still advances)."""
    n = 0
    for where, obj in R.iter_jsonl(Path(cfg.data), cfg.data):
        if cfg.max_samples is not None and n >= cfg.max_samples:
            return
        idx = n
        n += 1
        if idx < start:
            continue
        try:
            yield idx, _prepare(where, obj, cfg.on_bad)
        except BadRecordError as e:
            if cfg.on_bad == "error":
                raise
            kind = R.kind_of(e)
            report["skipped"][kind] = report["skipped"].get(kind, 0) + 1
            if sum(report["skipped"].values()) <= 5:
                log(f"skipping {e}")
            yield idx, None


def _text_records(cfg: RegenerateConfig, tok, report: dict, log, start: int):
    """Text mode: yield (index, _Item) per sample from `start` on, each with a seeded random prefix."""
    samples, rep = load_samples(
        cfg.data,
        tok,
        max_length=cfg.max_length,
        on_bad=cfg.on_bad,
        mode="text",
        glob=cfg.glob,
        max_samples=cfg.max_samples,
    )
    report["skipped"] = dict(rep.skipped)
    log(f"data: {rep.summary()}")
    lo, hi = cfg.prefix_range()
    for idx in range(start, len(samples)):
        s = samples[idx]
        ids = [int(t) for t in s.input_ids]
        head = ids[:1] if len(ids) and not bool(s.loss_mask[0]) else []  # the BOS the loader prepended
        body = ids[len(head) :]
        if len(body) < 2:
            continue
        rng = random.Random(f"{cfg.seed}:{idx}")
        n = min(rng.randint(lo, hi), len(body) - 1)
        off = rng.randint(0, len(body) - n)
        yield (
            idx,
            _Item(
                where=s.source,
                obj={},
                key="text",
                content_keys=[],
                messages=[],
                turns=[],
                prompt=head + body[off : off + n],
                extra={"prefix_offset": off, "prefix_tokens": n},
            ),
        )


def _continue_batch(gen: _Generator, items: list[_Item]) -> int:
    """Text mode: each item's text = its prefix + the target's continuation. Returns new tokens generated."""
    outs = gen.generate([it.prompt for it in items])
    new_tokens = 0
    for it, (toks, cut) in zip(items, outs):
        n_head = len(it.prompt) - it.extra["prefix_tokens"]
        it.obj["text"] = gen.tok.decode(it.prompt[n_head:] + toks, skip_special_tokens=True)
        it.truncated = int(cut)
        new_tokens += len(toks)
    return new_tokens


def _settings(cfg: RegenerateConfig, target) -> dict:
    return {
        "target": cfg.target,
        "target_config_hash": target.config_hash,
        "data": str(Path(cfg.data).resolve()),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "seed": cfg.seed,
        "max_samples": cfg.max_samples,
        "on_bad": cfg.on_bad,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "continue_text": cfg.continue_text,
        "prefix_tokens": cfg.prefix_tokens if cfg.continue_text else None,
        "glob": cfg.glob if cfg.continue_text else None,
        "max_length": cfg.max_length if cfg.continue_text else None,
        "draftsmith_version": __version__,
    }


def _resume_point(cfg: RegenerateConfig, settings: dict) -> tuple[int, int, dict]:
    """(input records consumed, output bytes vouched for, skipped counts) from OUT.progress.json; the output is cut
    back to those bytes (a kill -9 can leave a partial batch after them)."""
    pp = progress_path(cfg.out)
    out = Path(cfg.out)
    if not pp.is_file():
        if out.exists() and out.stat().st_size > 0:
            raise DraftsmithError(
                f"{cfg.out}: exists without {pp.name} (not a regenerate output): remove it or choose another --out"
            )
        return 0, 0, {}

    prog = read_json(pp, "regenerate progress file")
    old = prog.get("settings", {})
    for k in RESUME_KEYS:
        if old.get(k) != settings.get(k):
            raise DraftsmithError(
                f"{cfg.out}: was written with {k}={old.get(k)!r}, this run has "
                f"{k}={settings.get(k)!r}: use another --out or the same settings"
            )
    consumed, nbytes = int(prog["consumed"]), int(prog["bytes"])
    size = out.stat().st_size if out.exists() else 0
    if size < nbytes:
        raise DraftsmithError(
            f"{cfg.out}: shorter ({size} bytes) than {pp.name} records ({nbytes}): the output "
            "was edited; remove both files to start over"
        )
    if size > nbytes:
        with open(out, "r+b") as f:
            f.truncate(nbytes)
            f.flush()
            os.fsync(f.fileno())
    return consumed, nbytes, dict(prog.get("skipped", {}))


def _prompt_ids(tok, messages, tkw) -> list[int]:
    text = render_checked(tok, messages, True, "prompt", tkw)
    return list(tok(text, add_special_tokens=False)["input_ids"])


class _Generator:
    """Batched generation through `transformers` `generate()` (left padding)."""

    def __init__(self, target, cfg: RegenerateConfig):
        self.torch = torch
        self.model = target.model
        self.tok = target.tokenizer
        self.cfg = cfg
        gc = getattr(self.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None:
            eos = self.tok.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
        # template end-of-turn tokens the template closes assistant turns with (e.g. <|eot_id|>, <|im_end|>)
        for name in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"):
            tid = self.tok.convert_tokens_to_ids(name) if name in self.tok.get_vocab() else None
            if isinstance(tid, int):
                self.eos.add(tid)
        pad = self.tok.pad_token_id
        self.pad = pad if pad is not None else (min(self.eos) if self.eos else 0)
        self.device = next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
        """New tokens per prompt (eos excluded) and whether the answer was cut at max_new_tokens."""
        torch = self.torch
        cfg = self.cfg
        n = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), n), self.pad, dtype=torch.long)
        att = torch.zeros((len(prompts), n), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, n - len(p) :] = torch.tensor(p)
            att[i, n - len(p) :] = 1
        kw = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=self.pad, eos_token_id=sorted(self.eos) or None)
        if cfg.temperature > 0:
            kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if cfg.cache == "static" or (cfg.cache == "auto" and self.device.type == "cuda"):
            kw["cache_implementation"] = "static"
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device), **kw)
        res = []
        for row in out[:, n:].tolist():
            toks, ended = [], False
            for t in row:
                if t in self.eos:
                    ended = True
                    break
                toks.append(t)
            res.append((toks, not ended))
        return res


def _regenerate_batch(gen: _Generator, items: list[_Item], tkw: dict) -> int:
    """Fill every assistant turn of the batch, turn by turn across records. Returns new tokens generated."""
    new_tokens = 0
    while True:
        todo = [it for it in items if it.turns]
        if not todo:
            return new_tokens
        prompts = []
        for it in todo:
            i = it.turns[0]
            prompts.append(_prompt_ids(gen.tok, [_for_template(m) for m in it.messages[:i]], tkw))
        outs = gen.generate(prompts)
        for it, (toks, cut) in zip(todo, outs):
            i = it.turns.pop(0)
            text = gen.tok.decode(toks, skip_special_tokens=True)
            new_tokens += len(toks)
            it.truncated += int(cut)
            it.messages[i]["content"] = text
            it.obj[it.key][i][it.content_keys[i]] = text


def _for_template(m: dict) -> dict:
    # the answer is regenerated, so a stale chain of thought of the dataset's model must not be fed back
    return {k: v for k, v in m.items() if k not in ("reasoning_content", "thinking")}


def run_regenerate(cfg: RegenerateConfig, log: Callable[[str], None] = print, progress: bool = True) -> dict:
    """Regenerate cfg.data into cfg.out (resumable). Returns a report dict (records, tokens, tokens/s, skipped)."""
    cfg.validate()

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")
    target = load_target(cfg.target, dtype=dtype, device=device)
    if not cfg.continue_text and not getattr(target.tokenizer, "chat_template", None):
        raise DraftsmithError(
            f"{cfg.target}: the tokenizer has no chat template; regenerate answers chat turns "
            "(text data: --continue-text has the target continue prefixes of it)"
        )
    target.model.eval()
    settings = _settings(cfg, target)
    consumed, nbytes, skipped = _resume_point(cfg, settings)
    report = {"skipped": skipped, "records": 0, "resumed_from": consumed, "new_tokens": 0, "truncated_turns": 0}
    if consumed:
        log(f"resuming {cfg.out}: {consumed} input records already done")
    torch.manual_seed(cfg.seed)
    gen = _Generator(target, cfg)
    prov_base = {
        "target": cfg.target,
        "target_config_hash": target.config_hash,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "draftsmith_version": settings["draftsmith_version"],
    }
    Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen_s = 0.0
    batch: list[tuple[int, Optional[_Item]]] = []

    def flush(f) -> None:
        nonlocal consumed, nbytes, gen_s
        items = [it for _, it in batch if it is not None]
        if items:
            tg = time.perf_counter()
            if cfg.continue_text:
                report["new_tokens"] += _continue_batch(gen, items)
            else:
                report["new_tokens"] += _regenerate_batch(gen, items, cfg.chat_template_kwargs)
            gen_s += time.perf_counter() - tg
        for it in items:
            it.obj["provenance"] = {**prov_base, "source": it.where, "truncated_turns": it.truncated, **it.extra}
            report["truncated_turns"] += it.truncated
            line = (json.dumps(it.obj, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            nbytes += len(line)
            report["records"] += 1
        f.flush()
        os.fsync(f.fileno())
        consumed = batch[-1][0] + 1
        atomic_write_json(
            progress_path(cfg.out),
            {"settings": settings, "consumed": consumed, "bytes": nbytes, "skipped": report["skipped"]},
        )
        batch.clear()
        if progress:
            rate = report["new_tokens"] / gen_s if gen_s else 0.0
            log(
                f"regenerate: {consumed} records read, {report['records']} written, "
                f"{report['new_tokens']} new tokens, {rate:.0f} tok/s"
            )

    items = _text_records(cfg, target.tokenizer, report, log, consumed) if cfg.continue_text else None
    with open(cfg.out, "ab") as f:
        for idx, item in items if items is not None else _records(cfg, report, log, start=consumed):
            batch.append((idx, item))
            if sum(1 for _, it in batch if it is not None) >= cfg.batch_size:
                flush(f)
        if batch:
            flush(f)
    report["wall_s"] = time.perf_counter() - t0
    report["generate_s"] = gen_s
    report["tokens_per_s"] = report["new_tokens"] / gen_s if gen_s else None
    report["consumed"] = consumed
    if not progress_path(cfg.out).is_file():  # nothing to write at all: still leave a finished progress file
        atomic_write_json(
            progress_path(cfg.out),
            {"settings": settings, "consumed": consumed, "bytes": nbytes, "skipped": report["skipped"]},
        )
    return report
