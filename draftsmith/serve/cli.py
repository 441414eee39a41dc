"""`draftsmith serve` (an OpenAI-compatible server on the speculative decoding engine) and `draftsmith
bench-endpoint` (streamed single-stream tokens/s, TTFT and inter-token latency of any OpenAI-compatible server)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from draftsmith.common.errors import DraftsmithError
from draftsmith.decode.config import EngineConfig, ModeConfig, settings


def _need_server_deps() -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise DraftsmithError(
            f"draftsmith serve needs {e.name}: pip install 'draftsmith[serve]' (or '.[serve]' in a checkout)"
        ) from None


def register(app: typer.Typer) -> None:
    # the engine and decode-mode options come from draftsmith/decode/config.py (shared with generate and eval)
    @app.command("serve")
    @settings(engine=EngineConfig, mode=ModeConfig)
    def serve(
        target: str = typer.Option(..., "--target", help="HF target model directory."),
        drafter: Optional[str] = typer.Option(
            None, "--drafter", help="EAGLE-3 drafter (draftsmith/SGLang/EAGLE layout). Without it: plain decoding."
        ),
        host: str = typer.Option(
            "127.0.0.1",
            "--host",
            help="Address to bind (loopback unless told otherwise; 0.0.0.0 exposes the server to the network).",
        ),
        port: int = typer.Option(8000, "--port", help="TCP port."),
        api_key: Optional[str] = typer.Option(
            None,
            "--api-key",
            envvar="DRAFTSMITH_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise).",
        ),
        max_queue: int = typer.Option(
            64, "--max-queue", help="Requests that may wait for the engine; one more -> 429."
        ),
        queue_timeout: float = typer.Option(
            600.0, "--queue-timeout", help="Seconds a request may wait for the engine before it is answered 429."
        ),
        max_model_len: Optional[int] = typer.Option(
            None,
            "--max-model-len",
            help="Prompt + max_tokens limit in "
            "tokens (the engine's cache). Default: the target's "
            "max_position_embeddings, at most 4096.",
        ),
        default_max_tokens: int = typer.Option(
            256, "--default-max-tokens", help="max_tokens of a request that gives none (capped by the context left)."
        ),
        served_model_name: Optional[str] = typer.Option(
            None,
            "--served-model-name",
            help="The model name of /v1/models and of responses (default: the target directory's name).",
        ),
        chat_template: Optional[Path] = typer.Option(
            None,
            "--chat-template",
            help="A Jinja chat template file for targets whose tokenizer has none (or to replace it).",
        ),
        capture_to: Optional[Path] = typer.Option(
            None,
            "--capture-to",
            help="Record every served request (prompt + response tokens but the last, with the target's aux and final "
            "pre-norm states from the forwards that served it) into this store. Prompts are stored: see README 'Serve'.",
        ),
        capture_max_tokens: Optional[int] = typer.Option(
            None, "--capture-max-tokens", help="Stop recording once the store holds this many tokens."
        ),
        capture_dtype: str = typer.Option("bf16", "--capture-dtype", help="Store dtype: bf16 | fp8."),
        capture_shard_tokens: int = typer.Option(65536, "--capture-shard-tokens", help="Tokens per store shard."),
        capture_flush_s: float = typer.Option(
            60.0,
            "--capture-flush-s",
            help="Write a shard once its oldest "
            "request is this old, even if not full (the store is complete after "
            "every write).",
        ),
        stream_interval_ms: float = typer.Option(
            10.0,
            "--stream-interval-ms",
            help="Streaming: tokens of rounds ending within this many ms of the last SSE chunk wait for the next "
            "one (the first token goes at once). 0 = a chunk per engine round: more event-loop wake-ups, which "
            "compete with the engine thread for Python (BENCHMARKS.md 'serve').",
        ),
        log_level: str = typer.Option("info", "--log-level", help="debug | info | warning | error."),
        *,
        engine: EngineConfig,
        mode: ModeConfig,
    ) -> None:
        """Serve the target (+ drafter) over OpenAI's HTTP API: /v1/completions, /v1/chat/completions (SSE or
        JSON), /v1/models, /health, /metrics. One sequence at a time on the engine; a bounded queue in front."""
        _need_server_deps()
        import uvicorn

        from draftsmith.serve.app import ServeSettings, create_app
        from draftsmith.serve.metrics import ServeMetrics
        from draftsmith.serve.worker import EngineWorker

        if max_queue < 1:
            raise DraftsmithError("--max-queue must be >= 1")
        if queue_timeout <= 0:
            raise DraftsmithError("--queue-timeout must be > 0")
        if stream_interval_ms < 0:
            raise DraftsmithError(f"--stream-interval-ms: must be >= 0, got {stream_interval_ms}")
        from draftsmith.decode.setup import mode_from

        mode_from(mode)  # the mode's shape, before the models load
        if not Path(target).is_dir():
            raise DraftsmithError(f"{target}: target not found (expected a Hugging Face model directory)")
        template = None
        if chat_template is not None:
            try:
                template = chat_template.read_text()
            except OSError as e:
                raise DraftsmithError(f"--chat-template: {chat_template}: {e.strerror}") from None
        logging.basicConfig(
            level=getattr(logging, log_level.upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        log = logging.getLogger("draftsmith.serve")
        built: dict = {}

        def build():
            from draftsmith.decode.engine import DecodeMode
            from draftsmith.decode.sampling import SamplingParams
            from draftsmith.decode.setup import engine_from, max_positions, mode_from, models_from

            t, d = models_from(target, drafter, engine)
            if template is not None:
                t.tokenizer.chat_template = template
            dm = mode_from(mode, d)
            limit = min(max_positions(t), 4096) if max_model_len is None else max_model_len
            if limit < 2:
                raise DraftsmithError(f"--max-model-len {limit}: must be >= 2")
            eng = engine_from(t, d, limit + dm.cache_need + 2, engine, modes=(dm,))
            if capture_to is not None:  # before the graphs are captured: the recording is part of every round
                try:
                    eng.set_state_recording(True)
                    log.info(
                        "capture: states from the served forwards (buffer %.1f MB)",
                        eng.states.numel() * eng.states.element_size() / 1e6,
                    )
                except ValueError as e:
                    log.warning("capture: %s; recording with one extra target forward per request instead", e)
            greedy = SamplingParams()
            eng.warmup(dm, greedy, prefill=True)  # the prompts' prefill graphs too: not on the first requests
            if dm.kind != "plain":
                eng.warmup(DecodeMode("plain"), greedy)  # generate's fallback near the end of the cache
            built.update(target=t, limit=limit, mode=dm)
            return eng, dm

        recorder_factory = None
        if capture_to is not None:
            from draftsmith.serve.recorder import ServeRecorder

            def recorder_factory(eng):
                return ServeRecorder(
                    capture_to,
                    built["target"],
                    eng.aux_layers,
                    dtype=capture_dtype,
                    max_tokens=capture_max_tokens,
                    shard_tokens=capture_shard_tokens,
                    flush_s=capture_flush_s,
                    engine=eng,
                )

        worker = EngineWorker(
            build,
            max_queue=max_queue,
            recorder_factory=recorder_factory,
            stream_interval_s=stream_interval_ms / 1000.0,
        )
        log.info("loading %s%s", target, f" + drafter {drafter}" if drafter else "")
        worker.start()
        from draftsmith.target_model.load import load_tokenizer

        t = built["target"]
        http_tokenizer = load_tokenizer(target)  # the event loop's own (fast tokenizers are not thread-safe)
        if template is not None:
            http_tokenizer.chat_template = template
        name = served_model_name or Path(target).resolve().name
        eng = worker.engine
        settings = ServeSettings(
            model_name=name,
            max_model_len=built["limit"],
            vocab_size=int(t.vocab_size),
            eos_ids=set(eng.eos_ids),
            api_key=api_key,
            queue_timeout=queue_timeout,
            default_max_tokens=default_max_tokens,
            aliases=(target,),
        )
        metrics = ServeMetrics()
        http_app = create_app(worker, http_tokenizer, settings, metrics)
        config = uvicorn.Config(
            http_app, host=host, port=port, log_level=log_level.lower(), access_log=False, timeout_graceful_shutdown=5
        )
        server = uvicorn.Server(config)
        log.info(
            "engine ready: %s, %s decoding, backend %s, cuda graphs %s, context %d tokens%s",
            eng.device,
            built["mode"].kind,
            eng.backend,
            eng.cuda_graphs,
            built["limit"],
            f", recording into {capture_to}" if capture_to else "",
        )
        print(f"draftsmith serve: http://{host}:{port}/v1 (model {name!r})", file=sys.stderr, flush=True)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handlers it found:
        # handlers that only note it let the engine and the capture writer finish below (the last shard is written)
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        try:
            server.run()
        finally:
            worker.stop()
            w = worker.timing
            print(
                f"draftsmith serve: engine thread: {w['requests']} requests, {w['tokens']} tokens in "
                f"{w['generate_s']:.3f} s of generate ({w['tokens'] / max(w['generate_s'], 1e-9):.1f} tok/s), "
                f"{w['record_s']:.3f} s recording",
                file=sys.stderr,
                flush=True,
            )
            if worker.recorder is not None:
                r = worker.recorder
                # (print: uvicorn's logging setup has replaced the handlers by now)
                how = "states from the served forwards" if r.served_states else "one extra target forward each"
                print(
                    f"draftsmith serve: capture: {r.recorded} requests recorded into {capture_to} ({how}; engine "
                    f"thread {r.engine_s:.3f} s in all)",
                    file=sys.stderr,
                    flush=True,
                )

    @app.command("bench-endpoint")
    def bench_endpoint(
        url: str = typer.Option(
            ...,
            "--url",
            help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (with or without /v1).",
        ),
        prompts: Path = typer.Option(
            ...,
            "--prompts",
            help="JSONL with prompt/text/messages/turns records, or a text file with one prompt per line.",
        ),
        model: Optional[str] = typer.Option(None, "--model", help="Model name (default: the first of /v1/models)."),
        max_tokens: int = typer.Option(256, "--max-tokens", help="max_tokens of every request."),
        concurrency: int = typer.Option(1, "--concurrency", help="Requests in flight at once (1 = single stream)."),
        requests: Optional[int] = typer.Option(
            None,
            "--requests",
            help="Requests to send in all (prompts repeat as needed); default: one per prompt. Never more are sent.",
        ),
        label: Optional[str] = typer.Option(None, "--label", help="Row name in the table (default: the URL)."),
        out: Path = typer.Option(Path("bench_endpoint"), "--out", help="Directory of results.jsonl and results.png."),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Bearer key."),
        temperature: float = typer.Option(0.0, "--temperature", help="Sampling temperature of every request."),
        chat: bool = typer.Option(
            False,
            "--chat",
            help="Send text prompts to /v1/chat/completions as one user "
            "message (records with messages always go there).",
        ),
        timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take."),
        json_out: bool = typer.Option(False, "--json", help="Also print this run's row as JSON."),
    ) -> None:
        """Benchmark an OpenAI-compatible endpoint: streamed single-stream tokens/s, TTFT, inter-token latency
        p50/p99, errors. Appends a row to OUT/results.jsonl, prints every row as one table, writes a bar chart."""
        from draftsmith.serve.bench_endpoint import run_bench

        if concurrency < 1:
            raise DraftsmithError("--concurrency must be >= 1")
        if requests is not None and requests < 1:
            raise DraftsmithError("--requests must be >= 1")
        if max_tokens < 1:
            raise DraftsmithError("--max-tokens must be >= 1")
        row = run_bench(
            url=url,
            prompts_path=prompts,
            model=model,
            max_tokens=max_tokens,
            concurrency=concurrency,
            num_requests=requests,
            label=label,
            out=out,
            api_key=api_key,
            temperature=temperature,
            chat=chat,
            timeout=timeout,
            progress=os.environ.get("DRAFTSMITH_NO_PROGRESS") is None,
        )
        if json_out:
            import json

            sys.stdout.write(json.dumps(row) + "\n")
