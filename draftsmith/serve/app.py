"""The HTTP side of `draftsmith serve`: OpenAI's /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models,
plus /health and /metrics.

Requests are parsed here, on the event loop (JSON, fields, tokenization, the context check), and become `Job`s for
the engine worker. Every error is OpenAI's error object with one line naming the field or limit: 400 (bad JSON,
bad field, over the context), 401 (API key), 404 (unknown model), 429 (queue full or waited too long), 500 (the
engine failed; the traceback goes to the server log, never to the client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftsmith.serve.metrics import ServeMetrics
from draftsmith.serve.worker import EngineWorker, Job

log = logging.getLogger("draftsmith.serve")

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cache": "length", "cancelled": "abort"}


@dataclass
class ServeSettings:
    model_name: str
    max_model_len: int  # prompt + max_tokens may not exceed this (the engine's cache holds it plus one round)
    vocab_size: int
    eos_ids: set
    api_key: str | None = None
    queue_timeout: float = 600.0
    default_max_tokens: int = 256
    aliases: tuple = ()  # other names accepted in `model` (the target path)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict] = None
    logprobs: Optional[Union[bool, int]] = None
    echo: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[_TextPart], None] = None


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            429: "rate_limit_error",
        }.get(status, "server_error")


def _error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": None}}, status_code=e.status
    )


def _validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first problem as one line naming the field: "field 'messages.0.role': Field required"."""
    errors = err.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    # pydantic names union members in the location (prompt.str, prompt.list[int]); the field is what matters
    loc = [
        x
        for x in loc
        if not (
            x in ("str", "int", "float", "bool", "dict", "list")
            or x.startswith(("list[", "dict[", "function-", "literal[", "union["))
        )
    ]
    field = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"field '{field}': {msg}{more}" if field else f"{msg}{more}"), (loc[0] if loc else None)


class Detokenizer:
    """Incremental text of a growing token list (only a short window is re-decoded per update)."""

    def __init__(self, tokenizer, eos_ids: set):
        self.tok = tokenizer
        self.eos_ids = eos_ids
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(i for i in new_ids if i not in self.eos_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=False)
        full = self.tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=False)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self.text


def final_text(tokenizer, token_ids: list[int], eos_ids: set, stop: list[str]) -> str:
    """The response text: the generated tokens without a trailing EOS, cut before the first stop string (OpenAI)."""
    ids = list(token_ids)
    if ids and ids[-1] in eos_ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return _cut_at_stop(text, stop)


def _cut_at_stop(text: str, stop: list[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that may be the start of a stop string (not sent yet)."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def create_app(
    worker: EngineWorker, tokenizer, settings: ServeSettings, metrics: ServeMetrics | None = None
) -> FastAPI:
    """`tokenizer` is used on the event loop only (the engine thread has its own: fast tokenizers are not safe
    to share between threads)."""
    app = FastAPI(title="draftsmith serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = metrics or ServeMetrics()
    app.state.metrics = metrics
    app.state.worker = worker
    created = int(time.time())

    def count(endpoint: str, status: int) -> None:
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        count(request.url.path, 400)
        return _error_response(ApiError(400, msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        count(request.url.path, exc.status_code)
        return _error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        count(request.url.path, 500)
        return _error_response(ApiError(500, f"internal error: {type(exc).__name__}"))

    def check_auth(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() != settings.api_key:
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY', the server's --api-key)")

    async def parse(request: Request, model_cls):
        body = await request.body()
        try:
            obj = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "request body must be a JSON object")
        try:
            req = model_cls.model_validate(obj)
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise ApiError(400, msg, param) from None
        if req.n != 1:
            raise ApiError(400, f"field 'n': only n=1 is supported (got {req.n})", "n")
        for name in ("logprobs", "echo"):  # refused rather than silently ignored: a client would read wrong numbers
            if getattr(req, name):
                raise ApiError(400, f"field '{name}': not supported by draftsmith serve", name)
        if req.model is not None and req.model not in (settings.model_name, *settings.aliases):
            raise ApiError(
                404,
                f"field 'model': {req.model!r} is not served here (this server serves "
                f"{settings.model_name!r}; see /v1/models)",
                "model",
            )
        return req

    def prompt_ids(req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        elif isinstance(p, list) and p and not isinstance(p[0], int):
            raise ApiError(
                400, "field 'prompt': one prompt per request (a batch of prompts is not supported)", "prompt"
            )
        if isinstance(p, str):
            ids = list(tokenizer(p)["input_ids"])
        else:
            ids = [int(x) for x in p]
            bad = next((x for x in ids if not 0 <= x < settings.vocab_size), None)
            if bad is not None:
                raise ApiError(
                    400,
                    f"field 'prompt': token id {bad} is outside the vocabulary (0..{settings.vocab_size - 1})",
                    "prompt",
                )
        return ids

    def chat_ids(req: ChatRequest) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                400,
                "field 'messages': the target's tokenizer has no chat template (start the server "
                "with --chat-template FILE, or use /v1/completions)",
                "messages",
            )
        msgs = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            msgs.append({"role": m.role, "content": content or ""})
        try:
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # a template that refuses the roles (e.g. no system role)
            raise ApiError(400, f"field 'messages': the chat template failed: {e}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def make_job(req: _Sampling, ids: list[int], max_tokens: int | None) -> Job:
        from draftsmith.decode.sampling import SamplingParams

        n = len(ids)
        limit = settings.max_model_len
        if n < 1:
            raise ApiError(400, "the prompt is empty (0 tokens)", "prompt")
        if max_tokens is None:
            max_tokens = min(settings.default_max_tokens, limit - n)
            if max_tokens < 1:
                raise ApiError(
                    400, f"the prompt has {n} tokens; the context limit is {limit} tokens (--max-model-len)", "prompt"
                )
        elif n + max_tokens > limit:
            raise ApiError(
                400,
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
                f"context limit of {limit} tokens (--max-model-len)",
                "max_tokens",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop = [s for s in stop if s]
        sp = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0))
        return Job(
            prompt_ids=ids,
            max_tokens=max_tokens,
            sampling=sp,
            seed=req.seed,
            stop=stop,
            loop=asyncio.get_running_loop(),
        )

    async def wait_start(job: Job, endpoint: str) -> float:
        """Wait until the engine starts the job; 429 when the queue is full or the wait passes --queue-timeout."""
        if not worker.submit(job):
            raise ApiError(429, f"server busy: {worker.max_queue} requests already waiting (--max-queue); retry later")
        metrics.waiting.set(worker.waiting)
        deadline = job.enqueued_at + settings.queue_timeout
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), max(0.0, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                if worker.expire(job):
                    metrics.waiting.set(worker.waiting)
                    raise ApiError(
                        429,
                        f"waited {settings.queue_timeout:g} s in the queue without reaching the "
                        "engine (--queue-timeout); retry later",
                    ) from None
                deadline = float("inf")  # it started meanwhile: its "start" event is on the way
                continue
            if kind == "start":
                metrics.waiting.set(worker.waiting)
                metrics.queue_wait.observe(payload - job.enqueued_at)
                return payload
            if kind == "error":
                raise ApiError(500, f"generation failed: {payload}")

    def usage(res) -> dict:
        n_out = len(res.token_ids)
        return {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": res.prompt_tokens + n_out,
        }

    async def run(request: Request, endpoint: str, chat: bool):
        t_arrival = time.perf_counter()
        try:
            check_auth(request)
            req = await parse(request, ChatRequest if chat else CompletionRequest)
            if chat:
                ids = chat_ids(req)
                max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                ids = prompt_ids(req)
                max_tokens = req.max_tokens
            job = make_job(req, ids, max_tokens)
            await wait_start(job, endpoint)
        except ApiError as e:
            count(endpoint, e.status)
            return _error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            count(endpoint, 200)
            return StreamingResponse(
                stream(job, rid, chat, include_usage, t_arrival),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            first = True
            while True:
                kind, payload = await job.events.get()
                if kind == "tokens" and first:
                    metrics.ttft.observe(time.perf_counter() - t_arrival)
                    first = False
                elif kind == "error":
                    e = ApiError(500, f"generation failed: {payload}")
                    count(endpoint, 500)
                    return _error_response(e)
                elif kind == "done":
                    res = payload
                    break
        finally:
            watcher.cancel()
        metrics.latency.observe(time.perf_counter() - t_arrival)
        metrics.observe_result(res)
        text = final_text(tokenizer, res.token_ids, settings.eos_ids, job.stop)
        finish = _FINISH.get(res.finish_reason, "stop")
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        count(endpoint, 200)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": settings.model_name,
                "choices": [choice],
                "usage": usage(res),
            }
        )

    async def stream(job: Job, rid: str, chat: bool, include_usage: bool, t_arrival: float):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created_at = int(time.time())

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created_at, "model": settings.model_name, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        detok = Detokenizer(tokenizer, settings.eos_ids)
        sent = ""
        first = True
        done = False
        try:
            if chat:
                yield chunk("", None, role=True)
            held = None
            while True:
                kind, payload = held or await job.events.get()
                held = None
                if kind == "tokens":
                    # rounds that finished while this loop was busy go out as one chunk (less work per token)
                    while held is None and not job.events.empty():
                        event = job.events.get_nowait()
                        if event[0] == "tokens":
                            payload = payload + event[1]
                        else:
                            held = event
                    if first:
                        metrics.ttft.observe(time.perf_counter() - t_arrival)
                        first = False
                    text = detok.add(payload)
                    safe = _cut_at_stop(text, job.stop)
                    if job.stop and len(safe) == len(text):
                        safe = safe[: len(safe) - _held_back(safe, job.stop)]
                    if len(safe) > len(sent) and safe.startswith(sent):
                        yield chunk(safe[len(sent) :], None)
                        sent = safe
                elif kind == "error":
                    err = {
                        "error": {
                            "message": f"generation failed: {payload}",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                    yield f"data: {json.dumps(err)}\n\n"
                    done = True
                    break
                elif kind == "done":
                    res = payload
                    text = final_text(tokenizer, res.token_ids, settings.eos_ids, job.stop)
                    if len(text) > len(sent):
                        yield chunk(text[len(sent) :], None)
                    metrics.latency.observe(time.perf_counter() - t_arrival)
                    metrics.observe_result(res)
                    yield chunk(None if chat else "", _FINISH.get(res.finish_reason, "stop"))
                    if include_usage:
                        body = {
                            "id": rid,
                            "object": obj,
                            "created": created_at,
                            "model": settings.model_name,
                            "choices": [],
                            "usage": usage(res),
                        }
                        yield f"data: {json.dumps(body)}\n\n"
                    yield "data: [DONE]\n\n"
                    done = True
                    break
        finally:
            if not done:  # the client went away (the generator was closed or cancelled): free the engine
                job.cancelled.set()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_auth(request)
        except ApiError as e:
            count("/v1/models", e.status)
            return _error_response(e)
        count("/v1/models", 200)
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "draftsmith",
                    "max_model_len": settings.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        ok = worker.alive
        return JSONResponse(
            {
                "status": "ok" if ok else "engine stopped",
                "model": settings.model_name,
                "waiting": worker.waiting,
                "running": int(worker.busy),
                "served": worker.served,
            },
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        metrics.waiting.set(worker.waiting)
        metrics.running.set(int(worker.busy))
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    """A non-streaming request's client that disconnects cancels its job (the body is read: the next ASGI message
    is the disconnect)."""
    try:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                job.cancelled.set()
                return
    except Exception:  # the response finished first
        return
