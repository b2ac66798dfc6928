"""OpenAI-compatible HTTP serving of DeepSeek-V4 with RedKnot document reuse (issue #8).

* `app.py`        Starlette routes, request validation, API keys -> tenants, SSE streaming
* `scheduler.py`  bounded queue + one model worker thread: continuous batching of plain
                  completions (Engine prefill/decode with per-slot active masks), document
                  requests through ReuseRuntime, artifact builds
* `documents.py`  tenant-scoped document registry (salted content ids, shared publication)
* `metrics.py`    Prometheus metrics (TTFT, inter-token, arms, ledgers, certification, queue)
* `tokenizer.py`  tokenizer.json via `tokenizers`, or the embedded model's byte fallback
* `state.py`      ServeConfig (frozen) and the server state built from it

Entry point: `python launch/serve.py` (see README "Serving").
"""
