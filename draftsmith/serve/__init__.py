"""`draftsmith serve`: an OpenAI-compatible HTTP server on the speculative decoding engine, and
`draftsmith bench-endpoint`: a streamed single-stream benchmark of any OpenAI-compatible server.

Module map: worker.py (the one engine thread, batch size 1, and the bounded queue in front of it), app.py (the
FastAPI routes: OpenAI wire format, SSE, errors, auth), metrics.py (Prometheus), recorder.py (capture while
serving: served tokens + target states into a store), bench_endpoint.py, cli.py (both commands).
"""
