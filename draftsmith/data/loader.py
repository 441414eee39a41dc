"""load_samples / load_prompts: user data -> tokenized samples with loss masks."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftsmith.common.errors import BadRecordError, DraftsmithError
from draftsmith.data import records as R
from draftsmith.data.chat import ChatPlan, render_checked, special_and_ws_ids

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_BATCH_CHARS = 4_000_000  # characters tokenized per batch call
_BATCH_ITEMS = 1024


@dataclass(eq=False)
class Sample:
    """One training sample. loss_mask[t] is True when token t is a training target (assistant/text token)."""

    input_ids: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # bool [L]
    source: str  # "FILE:LINE" (JSONL) or FILE (a source file; every window of a split file)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DataReport:
    total: int = 0  # records read (JSONL lines that are not blank, source files)
    kept: int = 0  # records that produced samples
    skipped: dict = field(default_factory=dict)  # reason -> count
    truncated: int = 0  # samples cut at max_length
    split: int = 0  # records split into several max_length windows
    samples: int = 0  # samples produced (>= kept when splitting)
    tokens: int = 0
    masked_tokens: int = 0
    files: int = 0  # files read
    mask_fallbacks: int = 0  # assistant turns located by character offsets (template re-renders history)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        s = f"{self.total} records read, {self.kept} kept"
        if self.samples != self.kept:
            s += f" ({self.samples} samples)"
        if self.skipped:
            s += (
                f", {self.num_skipped} skipped ("
                + ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])))
                + ")"
            )
        if self.truncated:
            s += f", {self.truncated} truncated"
        if self.split:
            s += f", {self.split} split into windows"
        pct = 100.0 * self.masked_tokens / self.tokens if self.tokens else 0.0
        s += f"; {self.tokens:,} tokens, {self.masked_tokens:,} loss-masked ({pct:.1f}%)"
        return s

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "truncated": self.truncated,
            "split": self.split,
            "samples": self.samples,
            "tokens": self.tokens,
            "masked_tokens": self.masked_tokens,
            "files": self.files,
            "mask_fallbacks": self.mask_fallbacks,
        }


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _encode(tokenizer, texts: list[str], *, offsets=False, as_text=False):
    """Batch-encode without the tokenizer's own special tokens. as_text: special-token strings in the text
    stay text (split_special_tokens), as a code file that mentions '<|endoftext|>' must not end a document."""
    kw = {"add_special_tokens": False, "return_attention_mask": False, "return_token_type_ids": False, "verbose": False}
    if offsets and getattr(tokenizer, "is_fast", False):
        kw["return_offsets_mapping"] = True
    if as_text:
        kw["split_special_tokens"] = True
    enc = tokenizer(texts, **kw)
    return enc["input_ids"], enc.get("offset_mapping") if offsets else None


# ------------------------------------------------------------------------------------------------
# Text tokenization in worker processes (large source-code corpora)
# ------------------------------------------------------------------------------------------------
# Why: on the 16-core GPU machine 390 MB of Python took ~70 s to tokenize (~5.5 MB/s), no faster than on
# 2 cores: the per-text Python work around the Rust tokenizer (encodings -> lists -> arrays) is serial.
# Worker processes take whole texts, so the result is identical to the serial path (tested). Opt-in
# (DRAFTSMITH_TOKENIZE_WORKERS=N) until measured on a many-core machine: on 2 cores it is slower than the
# tokenizer's own threads (15 s vs 10 s for 54 MB).
_POOL_TOKENIZER = None


def tokenize_workers() -> int:
    """Worker processes for text tokenization: $DRAFTSMITH_TOKENIZE_WORKERS ('auto' = the usable cores), else 1
    (= in this process, the tokenizer's own threads)."""
    env = os.environ.get("DRAFTSMITH_TOKENIZE_WORKERS", "").strip()
    if not env:
        return 1
    if env == "auto":
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1
    try:
        return max(1, int(env))
    except ValueError:
        raise DraftsmithError(f"DRAFTSMITH_TOKENIZE_WORKERS={env!r}: expected an integer or 'auto'") from None


def _pool_init(tokenizer):
    global _POOL_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _POOL_TOKENIZER = tokenizer


def _pool_encode(texts):
    ids, _ = _encode(_POOL_TOKENIZER, texts, as_text=True)
    return [np.asarray(x, dtype=np.int32) for x in ids]


class _TextPool:
    """A fork pool holding the tokenizer (fork: unlike spawn/forkserver it never re-imports the caller's
    __main__, so a user script without an `if __name__ == "__main__"` guard is safe; the workers only tokenize)."""

    def __init__(self, tokenizer, workers: int):
        self.workers = workers
        with warnings.catch_warnings():  # Python 3.12 warns on fork() of a multi-threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            self.ex = ProcessPoolExecutor(
                workers, mp_context=mp.get_context("fork"), initializer=_pool_init, initargs=(tokenizer,)
            )

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        # ~4 chunks per worker, balanced by characters; map keeps the order
        target = max(1, sum(len(t) for t in texts) // (4 * self.workers))
        chunks, cur, size = [], [], 0
        for t in texts:
            cur.append(t)
            size += len(t)
            if size >= target:
                chunks.append(cur)
                cur, size = [], 0
        if cur:
            chunks.append(cur)
        return [a for part in self.ex.map(_pool_encode, chunks) for a in part]

    def close(self):
        self.ex.shutdown(wait=True, cancel_futures=True)


def _encode_safe(tokenizer, texts, wheres, on_error, pool: _TextPool | None = None, **kw):
    """_encode, but a text the tokenizer rejects becomes a bad record (on_error(BadRecordError)) and None."""
    try:
        if pool is not None and kw.get("as_text") and not kw.get("offsets"):
            return pool.encode(texts), None
        return _encode(tokenizer, texts, **kw)
    except Exception:  # noqa: BLE001 - find the culprit(s) one by one
        ids, offs = [], []
        for t, w in zip(texts, wheres):
            try:
                a, o = _encode(tokenizer, [t], **kw)
                ids.append(a[0])
                offs.append(o[0] if o is not None else None)
            except Exception as e:  # noqa: BLE001
                on_error(R.bad(w, R.TOKENIZER_ERROR, " ".join(str(e).split())[:200] or type(e).__name__))
                ids.append(None)
                offs.append(None)
        return ids, (offs if kw.get("offsets") else None)


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether the tokenizer's own encoding (add_special_tokens=True, as `generate` and transformers feed a prompt)
    starts a text with its BOS token. Many tokenizers name a bos_token they never add (GPT-2 style code models,
    SmolLM2's `<|im_start|>`): text samples must not get one then."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode a probe adds nothing we can see
        return False
    return len(with_special) > len(plain) and with_special[0] == bos and (not plain or plain[0] != bos)


def _bos_id(tokenizer, add_bos) -> int | None:
    """The BOS to prepend to text samples: None = the tokenizer's own rule (`tokenizer_adds_bos`); True = always
    (an error without a BOS token); False = never."""
    if add_bos is False:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos is True:
        if bos is None:
            raise DraftsmithError("add_bos=True, but the tokenizer has no BOS token")
        return bos
    return bos if tokenizer_adds_bos(tokenizer) else None


class _Loader:
    def __init__(self, tokenizer, max_length, on_bad, mode, add_bos, split_long, template_kwargs=None, limit=None):
        if on_bad not in ("error", "skip"):
            raise DraftsmithError(f"on_bad={on_bad!r}: choose 'error' or 'skip'")
        if mode not in ("auto", "chat", "text"):
            raise DraftsmithError(f"mode={mode!r}: choose 'auto', 'chat' or 'text'")
        if max_length is not None and (not isinstance(max_length, (int, np.integer)) or max_length < 1):
            raise DraftsmithError(f"max_length={max_length!r}: must be a positive integer")
        if mode == "chat" and not _has_template(tokenizer):
            raise DraftsmithError("mode='chat' needs a tokenizer with a chat template (this one has none)")
        self.tok = tokenizer
        self.max_length = int(max_length) if max_length is not None else None
        self.on_bad = on_bad
        self.mode = mode
        self.add_bos = add_bos
        self.bos = _bos_id(tokenizer, add_bos)
        self.split_long = split_long
        self.report = DataReport()
        self.samples: list[Sample] = []
        self.has_template = _has_template(tokenizer)
        self.tkw = dict(template_kwargs or {})
        self.pool: _TextPool | None = None
        self._text_batches = 0
        self.limit = limit  # stop reading once this many samples are kept (None: read everything)

    # -- bad records ---------------------------------------------------------------------------
    def bad(self, err: BadRecordError):
        if self.on_bad == "error" and not getattr(err, "always_skip", False):
            raise err
        k = R.kind_of(err)
        self.report.skipped[k] = self.report.skipped.get(k, 0) + 1

    # -- records -> items ----------------------------------------------------------------------
    def classify(self, rec: R.Record):
        """-> ("text", text, full_mask) | ("chat", ChatPlan). Raises BadRecordError."""
        if rec.kind == "text":
            return ("text", rec.text, True)
        if rec.kind == "prompt":
            if self.mode == "text" or not self.has_template:
                return ("text", rec.messages[0]["content"], False)
            plan = ChatPlan(self.tok, rec.messages, rec.where, prompt_only=True, template_kwargs=self.tkw)
            R.check_utf8(plan.full, rec.where, "the rendered conversation")
            return ("chat", plan)
        # chat
        if not self.has_template:
            raise R.bad(
                rec.where,
                R.NO_CHAT_TEMPLATE,
                "a conversation record, but the tokenizer has no chat template "
                "(use mode='text' to train on the joined text)",
            )
        plan = ChatPlan(self.tok, rec.messages, rec.where, template_kwargs=self.tkw)
        R.check_utf8(plan.full, rec.where, "the rendered conversation")
        return ("chat", plan)

    def run(self, items: Iterable[tuple[str, Callable]], split_default: bool):
        """items: (where, thunk) pairs; thunk() -> Record or raises BadRecordError."""
        split = self.split_long if self.split_long is not None else split_default
        batch, chars = [], 0
        try:
            for where, thunk in items:
                if self.limit is not None and len(self.samples) >= self.limit:
                    break
                self.report.total += 1
                try:
                    item = self.classify(thunk())
                except BadRecordError as e:
                    self.bad(e)
                    continue
                batch.append((where, item))
                chars += len(item[1]) if item[0] == "text" else len(item[1].full)
                if len(batch) >= _BATCH_ITEMS or chars >= _BATCH_CHARS:
                    self.flush(batch, split)
                    batch, chars = [], 0
            if batch:
                self.flush(batch, split)
            if self.limit is not None and len(self.samples) > self.limit:
                dropped = self.samples[self.limit :]
                del self.samples[self.limit :]
                self.report.samples = len(self.samples)
                self.report.tokens -= sum(len(d.input_ids) for d in dropped)
                self.report.masked_tokens -= sum(int(d.loss_mask.sum()) for d in dropped)
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool = None

    def _text_pool(self):
        """Worker pool for the text path, started at the second full batch (small data never pays for it)."""
        self._text_batches += 1
        if self.pool is None and self._text_batches >= 2:
            n = tokenize_workers()
            if n > 1:
                self.pool = _TextPool(self.tok, n)
        return self.pool

    def flush(self, batch, split):
        texts = [(i, it) for i, (_, it) in enumerate(batch) if it[0] == "text"]
        chats = [(i, it) for i, (_, it) in enumerate(batch) if it[0] == "chat"]
        out: list = [None] * len(batch)
        if texts:
            ids_list, _ = _encode_safe(
                self.tok,
                [it[1] for _, it in texts],
                [batch[i][0] for i, _ in texts],
                self.bad,
                pool=self._text_pool(),
                as_text=True,
            )
            for (i, it), ids in zip(texts, ids_list):
                if ids is None:
                    continue
                arr = np.asarray(ids, dtype=np.int32)
                mask = np.full(len(arr), bool(it[2]), dtype=np.bool_)
                bos = self.bos
                if bos is not None and (len(arr) == 0 or arr[0] != bos):
                    arr = np.concatenate([np.array([bos], np.int32), arr])
                    mask = np.concatenate([np.zeros(1, np.bool_), mask])
                    out[i] = (arr, mask, True)
                else:
                    out[i] = (arr, mask, False)
        if chats:
            special, ws = special_and_ws_ids(self.tok)
            fulls = [it[1].full for _, it in chats]
            ids_list, offs_list = _encode_safe(self.tok, fulls, [batch[i][0] for i, _ in chats], self.bad, offsets=True)
            if offs_list is not None and any(o is None for o, ids in zip(offs_list, ids_list) if ids is not None):
                offs_list = None
            extra = sorted(
                {
                    s
                    for (_, it), ids in zip(chats, ids_list)
                    if ids is not None
                    for s in it[1].strings(offs_list is not None)
                }
            )
            enc_of = {}
            if extra:
                enc_of = dict(zip(extra, _encode_safe(self.tok, extra, [""] * len(extra), lambda e: None)[0]))
            for k, ((i, it), ids) in enumerate(zip(chats, ids_list)):
                if ids is None:
                    continue
                plan = it[1]
                try:
                    mask = plan.mask(
                        self.tok, list(ids), offs_list[k] if offs_list is not None else None, enc_of, special, ws
                    )
                    self.report.mask_fallbacks += plan.fallbacks
                except BadRecordError as e:
                    self.bad(e)
                    continue
                arr = np.asarray(ids, dtype=np.int32)
                if self.add_bos is True and self.bos is not None and (len(arr) == 0 or arr[0] != self.bos):
                    arr = np.concatenate([np.array([self.bos], np.int32), arr])
                    mask = np.concatenate([np.zeros(1, np.bool_), mask])
                out[i] = (arr, mask, False)
        for (where, _), res in zip(batch, out):
            if res is None:
                continue
            self.emit(where, *res, split)

    def emit(self, where, ids, mask, bos_prepended, split):
        rep = self.report
        L = self.max_length
        if L is not None and len(ids) > L:
            if split:
                pieces = []
                if bos_prepended and L >= 2:
                    body_ids, body_mask, step = ids[1:], mask[1:], L - 1
                    head_id, head_mask = ids[:1], mask[:1]
                    for s in range(0, len(body_ids), step):
                        pieces.append(
                            (
                                np.concatenate([head_id, body_ids[s : s + step]]),
                                np.concatenate([head_mask, body_mask[s : s + step]]),
                            )
                        )
                else:
                    for s in range(0, len(ids), L):
                        pieces.append((ids[s : s + L].copy(), mask[s : s + L].copy()))
                rep.split += 1
            else:
                pieces = [(ids[:L].copy(), mask[:L].copy())]
                rep.truncated += 1
        else:
            pieces = [(ids, mask)]
        rep.kept += 1
        for a, m in pieces:
            self.samples.append(Sample(a, m, where))
            rep.samples += 1
            rep.tokens += len(a)
            rep.masked_tokens += int(m.sum())


# ------------------------------------------------------------------------------------------------
def _jsonl_items(path: Path, name: str, mode: str) -> Iterator[tuple[str, Callable]]:
    for where, obj in R.iter_jsonl(path, name):
        if isinstance(obj, BadRecordError):
            yield where, _raiser(obj)
        else:
            yield where, (lambda o=obj, w=where: R.parse_record(o, w, mode))


def _raiser(err):
    def f():
        raise err

    return f


def _file_items(files: list[tuple[Path, str]], rep: DataReport, mode: str):
    for p, name in files:
        rep.files += 1
        if p.name.lower().endswith(JSONL_SUFFIXES):
            yield from _jsonl_items(p, name, mode)
            continue

        def thunk(p=p, name=name):
            text = R.read_text_file(p, name)
            if not text.strip():
                err = R.bad(name, R.EMPTY_FILE, "file is empty")
                err.always_skip = True  # empty __init__.py files are normal in a code corpus
                raise err
            return R.Record(name, "text", text=text)

        yield name, thunk


def _list_dir(root: Path, pattern: str, follow_symlinks: bool = False) -> tuple[list[tuple[Path, str]], int]:
    """The files under `root` matching `pattern`, sorted by relative path, and how many were left out because a
    symlink (to the file or to a directory above it) leads outside `root` (read only with follow_symlinks)."""
    out, outside = [], 0
    root_real = os.path.realpath(root)
    for p in root.glob(pattern):
        try:
            if not p.is_file():
                continue
            if not follow_symlinks:
                real = os.path.realpath(p)
                if os.path.commonpath([real, root_real]) != root_real:
                    outside += 1
                    continue
            out.append((p, p.relative_to(root).as_posix()))
        except (OSError, ValueError):
            continue
    out.sort(key=lambda x: x[1])
    return [(p, str(root / rel)) for p, rel in out], outside


SYMLINK_OUTSIDE = "symlink outside the data directory"


def load_samples(
    path,
    tokenizer,
    max_length=None,
    on_bad="error",
    mode="auto",
    add_bos=None,
    split_long=None,
    glob=None,
    chat_template_kwargs=None,
    follow_symlinks=False,
    max_samples=None,
):
    """Read user data and return (list[Sample], DataReport).

    path: a JSONL file (.jsonl/.json/.ndjson; one record per line; a .json file may instead hold one JSON
      array of records), another single file (one text
      sample), or a directory: every file matching `glob` (default '**/*.py'), sorted by relative path,
      each one text sample (files named *.jsonl among them are read as JSONL); a directory with no
      matching files reads its '**/*.jsonl' files in sorted order.
    Records (mode='auto' detects per record): ShareGPT {"conversations": [{"from", "value"}]}, OpenAI
      {"messages": [{"role", "content"}]} -> chat template + assistant-only loss mask; {"text": ...} -> full
      mask; EAGLE eval questions {"turns": [...]} -> the first turn as a user prompt with the generation
      prompt, mask all zeros. mode='text': conversations are joined (contents separated by blank lines)
      and trained on in full; mode='chat': text records are bad records.
    Tokenizers without a chat template: conversation records are bad records ('no chat template') unless
      mode='text'; 'turns' prompts become raw text.
    add_bos: None = follow the tokenizer: prepend its BOS to text samples (that do not start with it) only
      when the tokenizer's own encoding adds one (`tokenizer_adds_bos`; chat samples keep what the template
      renders); True = prepend it to text and chat samples; False = never. The BOS is never a loss target
      (mask 0). Special-token strings inside text (e.g. '<|endoftext|>' in a source file) are
      tokenized as plain text.
    max_length: longer samples are truncated (report.truncated) or, with split_long (default True for
      directories of source files, False for JSONL), cut into consecutive windows of at most max_length
      tokens; each window of a text sample starts with the BOS (when one was prepended).
    on_bad: 'error' raises BadRecordError ('FILE:LINE: reason: detail'); 'skip' counts skipped records by
      reason in report.skipped (total == kept + sum(skipped)). Empty (whitespace-only) source files are
      always skipped, counted as 'empty file', never an error.
    chat_template_kwargs: extra variables for the chat template (e.g. {"enable_thinking": False}).
    follow_symlinks: in a directory, files reached through a symlink that leads outside it are skipped (counted in
      report.skipped as 'symlink outside the data directory') unless this is True.
    max_samples: keep the first N samples (windows count one each) and stop reading there: a cap on a large
      directory costs only what it reads (report.total counts the records read).
    Sample.source is 'FILE:LINE' for JSONL, 'FILE[INDEX]' for a .json file holding one JSON array (the
    original ShareGPT layout), FILE for a source file (every window of a split file).
    """
    p = Path(path)
    if not p.exists():
        raise DraftsmithError(f"{path}: no such file or directory")
    if max_samples is not None and (not isinstance(max_samples, (int, np.integer)) or max_samples < 1):
        raise DraftsmithError(f"max_samples={max_samples!r}: must be a positive integer")
    ld = _Loader(tokenizer, max_length, on_bad, mode, add_bos, split_long, chat_template_kwargs, limit=max_samples)
    if p.is_dir():
        files, outside = _list_dir(p, glob or "**/*.py", follow_symlinks)
        if not files and glob is None:
            files, more_outside = _list_dir(p, "**/*.jsonl", follow_symlinks)
            outside += more_outside
        if outside:
            ld.report.skipped[SYMLINK_OUTSIDE] = outside
            ld.report.total += outside
        if not files:
            more = f" ({outside} symlinked file(s) outside it skipped)" if outside else ""
            raise DraftsmithError(f"{path}: no files match {glob or '**/*.py'!r} (and no *.jsonl files){more}")
        all_jsonl = all(f[0].name.lower().endswith(JSONL_SUFFIXES) for f in files)
        ld.run(_file_items(files, ld.report, mode), split_default=not all_jsonl)
    elif p.name.lower().endswith(JSONL_SUFFIXES):
        ld.report.files = 1
        ld.run(_jsonl_items(p, str(path), mode), split_default=False)
    else:
        ld.run(_file_items([(p, str(path))], ld.report, mode), split_default=True)
    return ld.samples, ld.report


def load_prompts(
    path, tokenizer, raw=False, return_text=False, add_bos=None, on_bad="error", limit=None, chat_template_kwargs=None
):
    """Prompts for evaluation/generation from a JSONL file: list of int32 token-id arrays (or, with
    return_text=True, the strings that are tokenized).

    Per record: {"turns": [...]} -> the first turn; conversations/messages -> the messages before the
    first assistant message; {"text": ...} -> the text. With a chat template and raw=False the prompt is
    rendered with add_generation_prompt=True (the template supplies BOS and special tokens). With
    raw=True, or a tokenizer without a chat template, the prompt is the raw text (message contents
    joined by blank lines) with EAGLE's HumanEval instruction line ('Complete the code I provided.')
    dropped, tokenized as plain text with the BOS rule of load_samples.
    """
    p = Path(path)
    if not p.is_file():
        raise DraftsmithError(f"{path}: no such file")
    use_template = not raw and _has_template(tokenizer)
    bos = _bos_id(tokenizer, add_bos)
    texts = []
    for where, obj in R.iter_jsonl(p, str(path)):
        if limit is not None and len(texts) >= limit:
            break
        try:
            if isinstance(obj, BadRecordError):
                raise obj
            if isinstance(obj, dict) and "turns" not in obj and "text" not in obj:
                for key in ("conversations", "messages"):
                    if key in obj:
                        msgs = R.normalize_messages(obj, key, where)
                        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
                        msgs = msgs[:first]
                        if not msgs:
                            raise R.bad(
                                where, R.EMPTY_CONVERSATION, f"{key} has no message before the first assistant message"
                            )
                        rec = R.Record(where, "prompt", messages=msgs)
                        break
                else:
                    rec = R.parse_record(obj, where)
            else:
                rec = R.parse_record(obj, where)
                if rec.kind == "text":
                    rec = R.Record(where, "prompt", messages=[{"role": "user", "content": rec.text}])
            if use_template:
                texts.append((render_checked(tokenizer, rec.messages, True, where, chat_template_kwargs), False))
            else:
                texts.append((R.strip_humaneval_instruction(rec.joined_text()), True))
        except BadRecordError:
            if on_bad == "error":
                raise
    if return_text:
        return [t for t, _ in texts]
    out = []
    if texts:
        ids_list, _ = (
            _encode(tokenizer, [t for t, raw_t in texts if raw_t], as_text=True)
            if any(r for _, r in texts)
            else ([], None)
        )
        tmpl_ids, _ = (
            _encode(tokenizer, [t for t, raw_t in texts if not raw_t]) if any(not r for _, r in texts) else ([], None)
        )
        it_raw, it_tmpl = iter(ids_list), iter(tmpl_ids)
        for _, raw_t in texts:
            ids = np.asarray(next(it_raw) if raw_t else next(it_tmpl), dtype=np.int32)
            if bos is not None and (raw_t or add_bos is True) and (len(ids) == 0 or ids[0] != bos):
                ids = np.concatenate([np.array([bos], np.int32), ids])
            out.append(ids)
    return out


def token_counts_from_samples(samples, vocab_size: int):
    """int64 [vocab_size]: loss-masked token counts of samples (`Sample`s or dicts with input_ids / loss_mask) —
    what `HiddenStateStore.token_counts()` stores, what online training picks its draft vocab by, and what
    `draftsmith prune-vocab --data` ranks a draft vocab by."""
    import torch  # torch-free --help (the data package is on the CLI's import path)

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        get = s.get if isinstance(s, dict) else lambda k, s=s: getattr(s, k, None)
        ids = torch.as_tensor(np.asarray(get("input_ids")), dtype=torch.long)
        m = torch.as_tensor(np.asarray(get("loss_mask")), dtype=torch.bool)
        sel = ids[m]
        if sel.numel():
            counts += torch.bincount(sel, minlength=vocab_size)[:vocab_size]
    return counts
