"""Assistant-only loss masks derived from the tokenizer's own chat template (works for any template).

For a conversation M with full rendering S = render(M):
* for each assistant message i, A_i = render(M[:i], add_generation_prompt=True) (the prompt the model
  sees before it writes turn i) and B_i = render(M[:i+1]) (the conversation through turn i);
* fast path: when A_i and B_i are prefixes of S, turn i is the characters [len(A_i), len(B_i)) of S,
  mapped to the tokens of S (tokenized once) through the offset mapping; a token that straddles a
  boundary counts. (Tokenizers without offset mappings: tok(A_i) and tok(B_i) must be token-prefixes of
  tok(S), and the turn is tokens [len(tok(A_i)), len(tok(B_i))).)
* fallback (templates that re-render earlier turns when more turns follow, e.g. Qwen3 dropping <think>
  from earlier answers and adding an empty think block to the last one): locate the turn in S — the
  content is found by rendering S again with that message's content replaced by sentinels (the
  differing region), the start is len(A_i) when A_i is a prefix of S (else the content start minus
  the lead-in the template adds inside the assistant turn, e.g. '<think>\\n\\n</think>\\n\\n'), the
  end is the content end plus the trailer B_i puts after the content (e.g. '<|im_end|>\\n'); the
  character span is mapped to tokens with the offsets of S's tokenization.
Finally whitespace-only tokens that follow a special end-of-turn token at the end of a turn (the
'\\n' after ChatML's '<|im_end|>') are unmasked: the model never generates them.
"""

from __future__ import annotations

import bisect

import numpy as np

from draftsmith.data import records as R

# One sentinel whose first/last character (U+2063, invisible separator: not whitespace, so `trim` keeps
# it) no real content starts or ends with makes the common prefix/suffix exact in one render; content
# holding U+2063 falls back to two sentinels with different first and last letters.
_SENTINEL = "\u2063DraftsmithSentinel\u2063"
_SENTINELS = ("Zq9xDraftsmithSentinelq9xZ", "Jw4kDraftsmithSentinelw4kJ")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, template_kwargs=None) -> str:
    out = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(template_kwargs or {})
    )
    if isinstance(out, list) and len(out) == 1:  # some versions return a batch of one
        out = out[0]
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}")
    return out


def _try_render(tokenizer, messages, gen, tkw=None):
    if not messages:
        return None
    try:
        return render(tokenizer, messages, gen, tkw)
    except Exception:  # noqa: BLE001 - any template failure just disables the fast path
        return None


def render_checked(tokenizer, messages, gen, where, tkw=None) -> str:
    try:
        return render(tokenizer, messages, gen, tkw)
    except Exception as e:  # noqa: BLE001 - a template rejecting a conversation is a bad record
        msg = " ".join(str(e).split()) or type(e).__name__
        raise R.bad(where, R.TEMPLATE_ERROR, msg[:300]) from None


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the common prefix length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _lcs(a: str, b: str) -> int:
    return _lcp(a[::-1], b[::-1])


def _content_region(tokenizer, messages, i, base: str, gen: bool, tkw=None):
    """(start, end) of message i's content inside `base` (= render(messages, gen)), via sentinels."""
    p = e = None
    sentinels = (_SENTINEL,) if "\u2063" not in messages[i]["content"] else _SENTINELS
    for s in sentinels:
        alt = [dict(m) for m in messages]
        alt[i]["content"] = s
        alt[i].pop("reasoning_content", None)
        other = _try_render(tokenizer, alt, gen, tkw)
        if other is None or other == base:
            return None
        lp = _lcp(base, other)
        ls = min(_lcs(base, other), len(base) - lp, len(other) - lp)
        p = lp if p is None else min(p, lp)
        end = len(base) - ls
        e = end if e is None else max(e, end)
    return p, e


class ChatPlan:
    """The renderings needed to mask one conversation (strings are tokenized by the caller in a batch)."""

    __slots__ = ("where", "messages", "full", "turns", "prompt_only", "fallbacks", "tkw")

    def __init__(self, tokenizer, messages, where, prompt_only=False, template_kwargs=None):
        self.tkw = tkw = template_kwargs or None
        self.where = where
        self.messages = messages
        self.prompt_only = prompt_only
        self.fallbacks = 0
        if prompt_only:
            self.full = render_checked(tokenizer, messages, True, where, tkw)
            self.turns = []
            return
        self.full = render_checked(tokenizer, messages, False, where, tkw)
        self.turns = []  # [i, A, B] with A/B None when not a string prefix of full (or unrenderable)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            a = _try_render(tokenizer, messages[:i], True, tkw)
            b = _try_render(tokenizer, messages[: i + 1], False, tkw)
            ok = (
                a is not None
                and b is not None
                and len(b) > len(a)
                and self.full.startswith(a)
                and self.full.startswith(b)
            )
            self.turns.append((i, a, b, ok))

    def strings(self, have_offsets: bool) -> list[str]:
        """Strings the caller must tokenize for mask(): none with offsets, else A_i and B_i (token-prefix
        path for tokenizers without offset mappings)."""
        out = []
        if not have_offsets:
            for _, a, b, ok in self.turns:
                if ok:
                    out += [a, b]
        return out

    def char_span(self, tokenizer, i, a, b):
        """Fallback: the character span of assistant turn i in the full rendering (or None)."""
        full = self.full
        reg = _content_region(tokenizer, self.messages, i, full, False, self.tkw)
        if reg is None:
            return None
        p, e = reg
        breg = None
        if b is not None:
            breg = _content_region(tokenizer, self.messages[: i + 1], i, b, False, self.tkw)
        if a is not None and full.startswith(a) and len(a) <= p:
            start = len(a)
        else:
            start = p
            if breg is not None and a is not None and b.startswith(a) and breg[0] >= len(a):
                lead = b[len(a) : breg[0]]
                if lead and full[:p].endswith(lead):
                    start = p - len(lead)
        end = e
        if breg is not None:
            end = e + _lcp(full[e:], b[breg[1] :])
        return start, end

    def mask(self, tokenizer, ids: list[int], offsets, enc_of: dict, special_ids, ws_ids) -> np.ndarray:
        n = len(ids)
        mask = np.zeros(n, dtype=np.bool_)
        if not self.turns:
            return mask
        bounds = None
        if offsets is not None:
            bounds = ([o[0] for o in offsets], [o[1] for o in offsets])
        for i, a, b, ok in self.turns:
            span = None
            if ok and bounds is not None:
                span = _chars_to_tokens((len(a), len(b)), bounds, n)
            elif ok:
                ia, ib = enc_of.get(a), enc_of.get(b)
                if ia is not None and ib is not None and len(ib) <= n and ids[: len(ib)] == ib and ids[: len(ia)] == ia:
                    span = (len(ia), len(ib))
            if span is None:
                self.fallbacks += 1
                cs = self.char_span(tokenizer, i, a, b)
                if cs is None:
                    raise R.bad(
                        self.where,
                        R.TEMPLATE_ERROR,
                        f"cannot locate assistant message {i} in the rendered conversation",
                    )
                if bounds is not None:
                    span = _chars_to_tokens(cs, bounds, n)
                else:  # no offsets (slow tokenizer): boundaries from decoded prefix lengths
                    span = _chars_to_tokens_by_decode(tokenizer, ids, cs)
            s, t = span
            # Unmask whitespace tokens after a special end-of-turn token (e.g. '\n' after '<|im_end|>').
            k = t
            while k > s and ids[k - 1] in ws_ids:
                k -= 1
            if s < k < t and ids[k - 1] in special_ids:
                t = k
            mask[s:t] = True
        return mask


def _chars_to_tokens(span, bounds, n):
    """Token range overlapping the character span [a, b) of the rendering (a token that straddles a
    boundary, e.g. BPE merging across the end of the generation prompt, counts)."""
    a, b = span
    if b <= a:
        return (0, 0)
    starts, ends = bounds
    s = bisect.bisect_right(ends, a)  # first token ending after a
    t = bisect.bisect_left(starts, b)  # first token starting at or after b
    s, t = min(s, n), min(max(t, s), n)
    return (s, t)


def _chars_to_tokens_by_decode(tokenizer, ids, span):
    """Like _chars_to_tokens for tokenizers without offsets: bisect on len(decode(ids[:k]))."""
    cache = {}

    def dlen(k):
        if k not in cache:
            cache[k] = len(tokenizer.decode(ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        return cache[k]

    a, b = span
    n = len(ids)
    if b <= a:
        return (0, 0)
    lo, hi = 0, n  # s = max k with dlen(k) <= a
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if dlen(mid) <= a:
            lo = mid
        else:
            hi = mid - 1
    s = lo
    lo, hi = s, n  # t = min k with dlen(k) >= b
    while lo < hi:
        mid = (lo + hi) // 2
        if dlen(mid) >= b:
            hi = mid
        else:
            lo = mid + 1
    return (s, max(lo, s))


def special_and_ws_ids(tokenizer):
    """(ids of special tokens, ids of non-special whitespace-only tokens), cached on the tokenizer."""
    cache = getattr(tokenizer, "_draftsmith_tok_sets", None)
    if cache is not None and cache[0] == len(tokenizer):
        return cache[1], cache[2]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        for k, v in tokenizer.added_tokens_decoder.items():
            if getattr(v, "special", False):
                special.add(int(k))
    except Exception:  # noqa: BLE001
        pass
    ws = set()
    try:
        vocab = tokenizer.get_vocab()
        cand = [i for t, i in vocab.items() if i not in special and _maybe_ws(t)]
        for i in cand:
            if tokenizer.decode([i]).strip() == "" and tokenizer.decode([i]) != "":
                ws.add(i)
    except Exception:  # noqa: BLE001
        pass
    try:
        tokenizer._draftsmith_tok_sets = (len(tokenizer), special, ws)
    except Exception:  # noqa: BLE001
        pass
    return special, ws


def _maybe_ws(tok: str) -> bool:
    # Byte-level BPE spells '\n' as 'Ċ', ' ' as 'Ġ', '\t' as 'ĉ', '\r' as 'č'; SentencePiece ' ' as '▁'.
    return (
        tok != "" and all(c.isspace() or c in "ĊĠĉč▁" for c in tok) or tok in ("<0x0A>", "<0x09>", "<0x0D>", "<0x20>")
    )
