"""Reading input records: JSONL lines and source files -> normalized records (no tokenization here).

A record is one of
* ``chat``: a conversation (ShareGPT ``conversations`` or OpenAI ``messages``), normalized to a list of
  ``{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}`` messages;
* ``prompt``: a prompts-only conversation (EAGLE eval-question ``{"turns": [...]}``; the first turn only);
* ``text``: plain text (``{"text": ...}`` or a source file).

Every problem with a record raises `BadRecordError` whose message is ``FILE:LINE: <kind>: <detail>``;
``err.kind`` is the short reason used to count skipped records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from draftsmith.common.errors import BadRecordError

# Reason kinds (the keys of DataReport.skipped).
MALFORMED_JSON = "malformed JSON"
NOT_AN_OBJECT = "not an object"
UNKNOWN_FORMAT = "unknown format"
UNKNOWN_ROLE = "unknown role"
EMPTY_CONVERSATION = "empty conversation"
BAD_MESSAGE = "bad message"
BAD_CONTENT = "bad content"
INVALID_UTF8 = "invalid UTF-8"
NO_ASSISTANT = "no assistant turn"
EMPTY_TEXT = "empty text"
EMPTY_FILE = "empty file"
NO_CHAT_TEMPLATE = "no chat template"
TEMPLATE_ERROR = "chat template error"
UNREADABLE = "unreadable file"
TOKENIZER_ERROR = "tokenizer error"

# Accepted speaker names (case-insensitive) -> the role handed to the chat template.
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}

# Extra message fields passed through to the chat template (everything else is dropped).
PASS_THROUGH = ("tool_calls", "tool_call_id", "name", "reasoning_content", "thinking")

HUMANEVAL_INSTRUCTION = "Complete the code I provided."


def bad(where: str, kind: str, detail: str | None = None) -> BadRecordError:
    """A BadRecordError with message 'WHERE: KIND: DETAIL' and `.kind` set (the skip-count key)."""
    err = BadRecordError(where, f"{kind}: {detail}" if detail else kind)
    err.kind = kind  # type: ignore[attr-defined]
    return err


def kind_of(err: BadRecordError) -> str:
    return getattr(err, "kind", None) or str(err.reason).split(":", 1)[0]


@dataclass
class Record:
    where: str
    kind: str  # "chat" | "prompt" | "text"
    text: str | None = None
    messages: list | None = None

    def joined_text(self) -> str:
        """The record as plain text (text mode): message contents joined by blank lines."""
        if self.text is not None:
            return self.text
        return "\n\n".join(m["content"] for m in self.messages if m["content"])


def _type(v) -> str:
    return (
        "null"
        if v is None
        else {dict: "object", list: "list", str: "string", bool: "bool"}.get(type(v), type(v).__name__)
    )


def check_utf8(s: str, where: str, field: str) -> str:
    """JSON escapes can smuggle lone surrogates ('\\ud800') into a str that no tokenizer can encode."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(where, INVALID_UTF8, f"{field} has a lone surrogate {s[e.start]!r} at index {e.start}") from None
    return s


def _content(m: dict, key: str, ckey: str, j: int, where: str, role: str) -> str:
    c = m.get(ckey)
    if isinstance(c, str):
        return c
    if c is None and role == "assistant" and m.get("tool_calls"):
        return ""
    if isinstance(c, list) and c:  # OpenAI content parts: text-only parts are joined
        parts = []
        for p in c:
            if isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise bad(where, BAD_CONTENT, f"{key}[{j}].{ckey} has a non-text part ({_type(p)})")
        return "".join(parts)
    if ckey not in m:
        raise bad(where, BAD_CONTENT, f"{key}[{j}].{ckey} is missing")
    raise bad(where, BAD_CONTENT, f"{key}[{j}].{ckey} is {_type(c)}, not a string")


def normalize_messages(obj: dict, key: str, where: str) -> list[dict]:
    conv = obj[key]
    if not isinstance(conv, list):
        raise bad(where, BAD_MESSAGE, f"{key} is {_type(conv)}, not a list")
    if not conv:
        raise bad(where, EMPTY_CONVERSATION, f"{key} is empty")
    role_default, content_default = ("from", "value") if key == "conversations" else ("role", "content")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise bad(where, BAD_MESSAGE, f"{key}[{j}] is {_type(m)}, not an object")
        rkey = role_default if role_default in m else ("role" if "role" in m else "from" if "from" in m else None)
        if rkey is None:
            raise bad(where, UNKNOWN_ROLE, f"{key}[{j}].{role_default} is missing")
        r = m[rkey]
        role = ROLE_ALIASES.get(r.strip().lower()) if isinstance(r, str) else None
        if role is None:
            raise bad(where, UNKNOWN_ROLE, f"{key}[{j}].{rkey}={r!r}")
        ckey = (
            content_default
            if content_default in m
            else ("content" if "content" in m else "value" if "value" in m else content_default)
        )
        content = check_utf8(_content(m, key, ckey, j, where, role), where, f"{key}[{j}].{ckey}")
        msg = {"role": role, "content": content}
        for k in PASS_THROUGH:
            if k in m and m[k] is not None:
                msg[k] = m[k]
        out.append(msg)
    return out


def parse_record(obj, where: str, mode: str = "auto") -> Record:
    """Classify and validate one decoded JSON value. Raises BadRecordError."""
    if not isinstance(obj, dict):
        raise bad(where, NOT_AN_OBJECT, f"record is a JSON {_type(obj)}, not an object")
    for key in ("conversations", "messages"):
        if key in obj:
            msgs = normalize_messages(obj, key, where)
            if mode != "text" and not any(m["role"] == "assistant" for m in msgs):
                raise bad(where, NO_ASSISTANT, f"{key} has no assistant/gpt message")
            rec = Record(where, "chat", messages=msgs)
            if mode == "text":
                rec = Record(where, "text", text=rec.joined_text())
                if not rec.text.strip():
                    raise bad(where, EMPTY_TEXT, f"{key} joined is empty")
            return rec
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise bad(
                where,
                EMPTY_CONVERSATION if turns == [] else BAD_MESSAGE,
                "turns is empty" if turns == [] else f"turns is {_type(turns)}, not a list",
            )
        if not isinstance(turns[0], str):
            raise bad(where, BAD_CONTENT, f"turns[0] is {_type(turns[0])}, not a string")
        if not turns[0].strip():
            raise bad(where, EMPTY_TEXT, "turns[0] is empty")
        check_utf8(turns[0], where, "turns[0]")
        return Record(where, "prompt", messages=[{"role": "user", "content": turns[0]}])
    if "text" in obj:
        t = obj["text"]
        if not isinstance(t, str):
            raise bad(where, BAD_CONTENT, f"text is {_type(t)}, not a string")
        if not t.strip():
            raise bad(where, EMPTY_TEXT, "text is empty")
        check_utf8(t, where, "text")
        if mode == "chat":
            raise bad(where, UNKNOWN_FORMAT, "a 'text' record, but mode='chat' needs 'conversations' or 'messages'")
        return Record(where, "text", text=t)
    keys = ", ".join(sorted(map(str, obj))[:6]) or "none"
    raise bad(where, UNKNOWN_FORMAT, f"no 'conversations', 'messages', 'text' or 'turns' field (keys: {keys})")


def _json_array_file(path: Path) -> bool:
    """A '.json' file holding one JSON array (the original ShareGPT layout) rather than JSON lines."""
    if not path.name.lower().endswith(".json"):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return False
    return head.startswith(b"[")


def _iter_json_array(path: Path, name: str) -> Iterator[tuple[str, object]]:
    try:
        data = path.read_bytes()
    except OSError as e:
        yield name, bad(name, UNREADABLE, e.strerror or str(e))
        return
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        where = f"{name}:{line}"
        yield where, bad(where, INVALID_UTF8, f"byte 0x{data[e.start]:02x}")
        return
    try:
        arr = json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{name}:{e.lineno}"
        yield where, bad(where, MALFORMED_JSON, f"{e.msg} at column {e.colno}")
        return
    except RecursionError:
        yield name, bad(name, MALFORMED_JSON, "nested too deeply")
        return
    for idx, obj in enumerate(arr):
        yield f"{name}[{idx}]", obj


def iter_jsonl(path: Path, name: str | None = None) -> Iterator[tuple[str, object]]:
    """Yield (where, decoded JSON or BadRecordError) per non-blank line. Decodes UTF-8 per line.
    A '.json' file that holds a single JSON array yields its elements, where = 'FILE[INDEX]'."""
    name = name or str(path)
    if _json_array_file(path):
        yield from _iter_json_array(path, name)
        return
    try:
        f = open(path, "rb")
    except OSError as e:
        yield name, bad(name, UNREADABLE, e.strerror or str(e))
        return
    with f:
        for lineno, raw in enumerate(f, 1):
            where = f"{name}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, bad(where, INVALID_UTF8, f"byte 0x{raw[e.start]:02x} at column {e.start + 1}")
                continue
            if lineno == 1 and line.startswith("\ufeff"):
                line = line[1:]
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, bad(where, MALFORMED_JSON, f"{e.msg} at column {e.colno}")
            except RecursionError:
                yield where, bad(where, MALFORMED_JSON, "nested too deeply")


def read_text_file(path: Path, name: str) -> str:
    """A source file as text (UTF-8, BOM stripped). Raises BadRecordError."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise bad(name, UNREADABLE, e.strerror or str(e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise bad(name, INVALID_UTF8, f"byte 0x{data[e.start]:02x} on line {line}") from None
    return text[1:] if text.startswith("\ufeff") else text


def strip_humaneval_instruction(text: str) -> str:
    """Drop EAGLE's HumanEval instruction line ('Complete the code I provided.') and blank lines after it."""
    if text.startswith(HUMANEVAL_INSTRUCTION):
        rest = text.split("\n", 1)[1] if "\n" in text else ""
        return rest.lstrip("\r\n")
    return text
