"""HTTP layer: Starlette routes (OpenAI-compatible completions / chat, documents, models,
health, metrics), request validation, API keys -> tenants, server-sent events.

Why Starlette + uvicorn: the server needs exactly an ASGI router, streaming responses and
lifespan hooks; Starlette gives those with few dependencies and no implicit validation layer,
so every 4xx here is written out with the field it names (FastAPI would add pydantic's own
422 shapes on top). uvicorn is the standard ASGI server for it.

OpenAI extension fields (both completion endpoints):
* `documents`: ["<64-hex id>", ...] cites registered documents, laid out in order before the
  prompt: Request([Segment(doc tokens, artifact), ...] + [Segment(prompt tokens)]);
* `arm`: "auto" (default: the arm the server's break-even table, `--break-even`, says reaches
  the first token sooner for this length and where its documents are; "redknot" without a
  table), "redknot", "prefix" (what a prefix cache gives: the first document's artifact is an
  exact prefix computed in no layer, every later row native; falls back to recomputation,
  counted, when its artifact cannot be a prefix), or "recompute" (the Recomputed arm: the same
  token ids run natively through the batched engine, no artifacts);
* `ignore_eos` (vLLM's extension): true keeps generating past the end-of-sequence token until
  `max_tokens` (stop strings still apply), so a benchmark gets a fixed output length.
`POST /tokenize` (vLLM's shape): {"prompt": str} -> {"tokens": [...], "count", "max_model_len"},
the ids the completion endpoints would see for that text.
Start-up: the socket opens while the model worker warms up (`Scheduler.warmup`): `GET
/healthz` answers 503 `{"status": "warming", ...}` with Retry-After until the warm-up ends, then
200 (`"failed"` with the error, 503, if it failed). Routes that need the model worker
(completions, chat, document registration) answer 503 meanwhile (code `warming_up`, with
Retry-After; `warmup_failed` without one): a Kubernetes readiness probe on /healthz keeps
traffic away until it is ready, and a request that still arrives is told when to retry rather
than held through minutes of compiling. Everything else (models, tokenize, documents read /
delete, metrics) answers at once.
Responses carry a `redknot` object (arm that ran, fallback reason, generated token ids, cached
rows, ledgers; `arm_choice`: the table's tier and estimates when it chose the arm; `ttft_s`: the
server's time from the request's submission to its first token, queue wait included) and
`usage.prompt_tokens_details.cached_tokens` = prompt rows not computed: the exact prefix's rows
and the relocated documents' rows restored from artifacts (candidate rows not protected).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from redknot_jax.server import documents as docmod
from redknot_jax.server.jobs import Job, Sampling
from redknot_jax.server.scheduler import QueueFull, ShuttingDown
from redknot_jax.server.warmup import WARMING_RETRY_AFTER_S, NotReady
from redknot_jax.server.tokenizer import chat_prompt

log = logging.getLogger("redknot.server")
ANON = "anonymous"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "code": self.code,
                                       "param": self.param}}, status_code=self.status, headers=self.headers)


def not_ready_error(e: NotReady) -> ApiError:
    if e.retry_after is None:
        return ApiError(503, str(e), "server_error", "warmup_failed")
    return ApiError(503, str(e), "server_error", "warming_up", headers={"Retry-After": str(e.retry_after)})


def require_ready(state) -> None:
    """503 (see the module docstring) unless the model worker's warm-up has finished well."""
    try:
        state.scheduler.check_ready()
    except NotReady as e:
        raise not_ready_error(e)


def bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", code=code, param=param)


# ---------------------------------------------------------------------------------- keys
def load_api_keys(path: str | None, env: str | None) -> dict[str, str]:
    """key -> tenant. File: one `KEY [TENANT]` per line (# comments); env: `KEY[:TENANT],...`.
    A key without a tenant name is its own tenant ("key-<n>")."""
    pairs = []
    if path:
        with open(path) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    pairs.append(line.split(None, 1))
    if env:
        pairs += [p.strip().split(":", 1) for p in env.split(",") if p.strip()]
    keys = {}
    for n, p in enumerate(pairs):
        keys[p[0]] = p[1].strip() if len(p) > 1 else f"key-{n}"
    return keys


def tenant_of(state, request: HTTPRequest) -> str:
    if not state.keys:
        return ANON
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "missing bearer token (Authorization: Bearer <key>)", "authentication_error",
                       "invalid_api_key")
    found = None
    for key, tenant in state.keys.items():  # every key compared: timing does not reveal which matched
        if hmac.compare_digest(key.encode(), token.strip().encode()):
            found = tenant
    if found is None:
        raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key")
    return found


# ---------------------------------------------------------------------------------- parsing
async def read_json(state, request: HTTPRequest) -> dict:
    limit = state.cfg.max_body_bytes
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"request body of {cl} bytes exceeds the limit of {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        obj = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json")
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json")
    if not isinstance(obj, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(obj).__name__}", code="invalid_json")
    where = lone_surrogate(obj)
    if where is not None:
        raise bad(where, "holds a lone UTF-16 surrogate (an escape such as \\udfff that is not valid Unicode)")
    return obj


def lone_surrogate(obj) -> str | None:
    """The path (`prompt`, `messages[0].content`) of the first key or string holding a lone
    UTF-16 surrogate, which JSON's \\u escapes can spell but no tokenizer reads; None if none.
    Iterative: the body's nesting depth is the client's choice."""
    stack = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                sub = f"{path}.{k}" if path else k
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                stack.append((sub, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# Accepted OpenAI fields. Fields that change results but are not implemented are accepted only
# at their neutral value (rejected otherwise, never silently ignored); anything unknown is a 400.
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed", "stop",
          "user", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "documents", "arm",
          "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls"}
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": (None, False), "top_logprobs": None, "suffix": None,
           "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": (None, {}),
           "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
           "parallel_tool_calls": (None, True, False)}


@dataclasses.dataclass
class Parsed:
    prompt_tokens: list[int]
    docs: list
    sampling: Sampling
    stream: bool
    include_usage: bool
    arm: str
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


def check_served(state, model) -> None:
    if model != state.model_name:
        raise ApiError(404, f"model: '{model}' is not served here; available: ['{state.model_name}']",
                       code="model_not_found", param="model")


def parse_common(state, body: dict, allowed: set, tenant: str, prompt_tokens: list[int]) -> Parsed:
    cfg = state.cfg
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], f"unknown field (accepted: {sorted(allowed)})", "unknown_field")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("model", f"expected a string, got {model!r}")
    check_served(state, model)
    for k, want in NEUTRAL.items():
        if k in body:
            wants = want if isinstance(want, tuple) else (want,)
            if body[k] not in wants:
                raise bad(k, f"only {wants[0]!r} is supported, got {body[k]!r}", "unsupported_value")
    mt = body.get("max_completion_tokens", body.get("max_tokens", 16))
    mt_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if mt is None:
        mt = 16
    if not _is_int(mt) or mt < 1 or mt > cfg.max_tokens_limit:
        raise bad(mt_name, f"expected an integer in [1, {cfg.max_tokens_limit}], got {mt!r}")
    temp = body.get("temperature", 0.0)
    temp = 0.0 if temp is None else temp
    if not _is_num(temp) or not 0 <= temp <= 2:
        raise bad("temperature", f"expected a number in [0, 2], got {temp!r}")
    top_p = body.get("top_p", 1.0)
    top_p = 1.0 if top_p is None else top_p
    if not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", f"expected a number in (0, 1], got {top_p!r}")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise bad("seed", f"expected a non-negative integer, got {seed!r}")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"expected a boolean, got {stream!r}")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise bad("stream_options", f"expected {{'include_usage': bool}}, got {so!r}")
    if "user" in body and not isinstance(body["user"], (str, type(None))):
        raise bad("user", f"expected a string, got {body['user']!r}")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and 0 < len(x) <= 64 for x in stop):
        raise bad("stop", f"expected a string or a list of up to 4 non-empty strings of <= 64 characters, "
                          f"got {body.get('stop')!r}")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos", f"expected a boolean, got {ignore_eos!r}")
    arm = body.get("arm", "auto")
    if arm not in ("auto", "redknot", "prefix", "recompute"):
        raise bad("arm", f"expected 'auto', 'redknot', 'prefix' or 'recompute', got {arm!r}")
    if arm == "auto" and state.scheduler.break_even is None:  # nothing to choose by: RedKnot
        arm = "redknot"
    ids = body.get("documents") or []
    if not isinstance(ids, list):
        raise bad("documents", f"expected a list of document ids, got {type(ids).__name__}")
    docs = []
    for i, did in enumerate(ids):
        if not isinstance(did, str) or not docmod.valid_id(did):
            raise bad(f"documents[{i}]", f"expected a document id of 64 lowercase hex characters, got {did!r}",
                      "invalid_document_id")
        doc = state.registry.get(tenant, did)
        if doc is None:
            raise ApiError(404, f"documents[{i}]: document '{did}' not found", code="document_not_found",
                           param=f"documents[{i}]")
        docs.append(doc)
    if not prompt_tokens:
        raise bad("prompt", "empty after tokenization")
    total = sum(len(d.tokens) for d in docs) + len(prompt_tokens)
    if total + mt > state.capacity:
        raise bad("prompt" if not docs else "documents",
                  f"{total} prompt tokens (documents included) + {mt} max_tokens exceed the context limit "
                  f"{state.capacity}", "context_length_exceeded")
    return Parsed(prompt_tokens, docs, Sampling(float(temp), float(top_p), int(mt), seed), stream,
                  bool(so.get("include_usage", False)), arm, tuple(stop), ignore_eos)


def parse_prompt(state, body: dict) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return state.tokenizer.encode(p)
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        v = state.vocab_size
        badt = [t for t in p if not 0 <= t < v]
        if badt:
            raise bad("prompt", f"token ids {badt[:5]} outside [0, {v})")
        return list(p)
    raise bad("prompt", "expected a string, a list of token ids, or a list of one of those (batched prompts "
                        f"are not supported), got {type(p).__name__}")


def parse_messages(state, body: dict) -> str:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "expected a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise bad(f"messages[{i}].role", f"expected system, developer, user or assistant, got "
                                             f"{m.get('role') if isinstance(m, dict) else m!r}")
        if set(m) - {"role", "content", "name"}:
            raise bad(f"messages[{i}]", f"unknown keys {sorted(set(m) - {'role', 'content', 'name'})}",
                      "unknown_field")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise bad(f"messages[{i}].content", f"expected a string, got {type(c).__name__}")
        out.append({"role": m["role"], "content": c})
    return chat_prompt(out, state.chat_template)


# ---------------------------------------------------------------------------------- running
QUEUE_RETRY_AFTER_S = 1  # what a 429 (queue full) tells the client: the queue drains in about a request's time


def submit(state, job: Job) -> None:
    try:
        state.scheduler.submit(job)
    except QueueFull as e:
        raise ApiError(429, str(e), "rate_limit_error", "queue_full", headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
    except ShuttingDown as e:
        raise ApiError(503, str(e), "server_error", "shutting_down")
    except NotReady as e:
        raise not_ready_error(e)


def make_job(state, p: Parsed) -> Job:
    loop = asyncio.get_running_loop()
    stop = frozenset() if p.ignore_eos else frozenset({state.eos_id})
    if p.docs and p.arm in ("auto", "redknot", "prefix"):  # "auto": the scheduler's break-even table decides
        return Job("reuse", loop, tokens=p.prompt_tokens, docs=p.docs, sampling=p.sampling, arm=p.arm,
                   stop_ids=stop)
    toks = [t for d in p.docs for t in d.tokens.tolist()] + p.prompt_tokens
    return Job("plain", loop, tokens=toks, sampling=p.sampling, arm="recompute" if p.docs else "engine",
               stop_ids=stop)


async def next_event(request: HTTPRequest, job: Job):
    """The job's next event; sets `cancelled` and returns None if the client went away."""
    while True:
        try:
            return await asyncio.wait_for(job.out.get(), 0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancelled.set()
                return None


class StopText:
    """Detokenises incrementally and applies `stop` strings: text is cut before the first stop
    string and the generation is stopped; while streaming, the last (longest stop - 1)
    characters are held back so a stop string split over tokens is never emitted."""

    def __init__(self, tok, stops: tuple[str, ...]):
        self.tok, self.stops = tok, stops
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.ids, self.text, self.sent, self.stopped = [], "", 0, False

    def add(self, tid: int) -> str:
        """Record a token; return the text now safe to emit."""
        self.ids.append(tid)
        self.text = self.tok.decode(self.ids)
        cuts = [i for i in (self.text.find(x) for x in self.stops) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True
            return self.flush()
        upto = len(self.text) - self.hold
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def stop_job(job: Job) -> None:
    job.by_stop = True  # not a client disconnect: not counted as cancelled
    job.cancelled.set()


def usage(p: Parsed, n_completion: int, cached: int) -> dict:
    n_prompt = sum(len(d.tokens) for d in p.docs) + len(p.prompt_tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def run_completion(state, request: HTTPRequest, p: Parsed, chat: bool, endpoint: str):
    job = make_job(state, p)
    submit(state, job)
    state.metrics.requests.labels(endpoint, job.arm).inc()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    tok = state.tokenizer

    def extension(ids, info):
        return {"arm": info.get("arm", job.arm), "fallback": info.get("fallback"),
                "fallback_detail": info.get("fallback_detail", ""), "token_ids": ids,
                "cached_tokens": info.get("cached_tokens", 0), "ledgers": info.get("ledgers"),
                "arm_choice": info.get("arm_choice"), "documents": [d.id for d in p.docs], "ttft_s": job.ttft_s}

    st = StopText(tok, p.stop)
    early = {"arm": job.arm}  # the reuse job's info event (arm, cached rows, ledgers) comes first
    if not p.stream:
        try:
            while True:
                ev = await next_event(request, job)
                if ev is None:
                    return Response(status_code=499)
                if ev[0] == "info":
                    early = ev[1]
                elif ev[0] == "token":
                    st.add(ev[1])
                    if st.stopped:
                        stop_job(job)
                        fin, info = "stop", early
                        break
                elif ev[0] == "error":
                    raise ApiError(ev[1], ev[2], "server_error", "worker_error")
                else:
                    fin, info = ev[1], {**early, **ev[2]}
                    break
        finally:
            job.cancelled.set()  # no-op when finished; stops the worker if this task was cancelled
        ids, text = st.ids, st.text
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin,
                   "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": fin, "logprobs": None})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                             "choices": [choice], "usage": usage(p, len(ids), info.get("cached_tokens", 0)),
                             "redknot": extension(ids, info)})

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, fin=None, role=False, extra=None):
        if chat:
            d = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            c = {"index": 0, "delta": d, "finish_reason": fin, "logprobs": None}
        else:
            c = {"index": 0, "text": delta or "", "finish_reason": fin, "logprobs": None}
        out = {"id": rid, "object": chunk_obj, "created": created, "model": state.model_name, "choices": [c]}
        if extra:
            out.update(extra)
        return f"data: {json.dumps(out)}\n\n"

    async def events():
        nonlocal early
        ids = st.ids
        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                ev = await job.out.get()
                if ev[0] == "info":
                    early = ev[1]
                    continue
                if ev[0] == "token":
                    delta = st.add(ev[1])
                    if delta:
                        yield chunk(delta)
                    if not st.stopped:
                        continue
                    stop_job(job)
                    ev = ("done", "stop", early)
                if ev[0] == "error":
                    err = {"error": {"message": ev[2], "type": "server_error", "code": "worker_error", "param": None}}
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                else:
                    fin, info = ev[1], {**early, **ev[2]}
                    rest = st.flush()
                    if rest:
                        yield chunk(rest)
                    yield chunk(None if chat else "", fin=fin, extra={"redknot": extension(ids, info)})
                    if p.include_usage:
                        u = {"id": rid, "object": chunk_obj, "created": created, "model": state.model_name,
                             "choices": [], "usage": usage(p, len(ids), info.get("cached_tokens", 0))}
                        yield f"data: {json.dumps(u)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # client gone (generator closed / cancelled) or finished: stop the worker for it
            job.cancelled.set()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---------------------------------------------------------------------------------- routes
def endpoint(fn):
    async def wrapped(request: HTTPRequest):
        state = request.app.state.server
        try:
            resp = await fn(state, request)
        except ApiError as e:
            resp = e.response()
        state.metrics.responses.labels(str(resp.status_code)).inc()
        return resp

    return wrapped


@endpoint
async def completions(state, request):
    tenant = tenant_of(state, request)
    require_ready(state)
    body = await read_json(state, request)
    p = parse_common(state, body, COMPLETION_FIELDS, tenant, parse_prompt(state, body))
    return await run_completion(state, request, p, chat=False, endpoint="completions")


@endpoint
async def chat_completions(state, request):
    tenant = tenant_of(state, request)
    require_ready(state)
    body = await read_json(state, request)
    toks = state.tokenizer.encode(parse_messages(state, body))
    p = parse_common(state, body, CHAT_FIELDS, tenant, toks)
    return await run_completion(state, request, p, chat=True, endpoint="chat")


@endpoint
async def tokenize(state, request):
    tenant_of(state, request)
    body = await read_json(state, request)
    unknown = sorted(set(body) - {"model", "prompt"})
    if unknown:
        raise bad(unknown[0], "unknown field (accepted: model, prompt)", "unknown_field")
    if "model" in body:
        check_served(state, body["model"])
    if not isinstance(body.get("prompt"), str):
        raise bad("prompt", f"expected a string, got {type(body.get('prompt')).__name__}")
    toks = [int(t) for t in state.tokenizer.encode(body["prompt"])]
    return JSONResponse({"tokens": toks, "count": len(toks), "max_model_len": state.capacity})


@endpoint
async def create_document(state, request):
    tenant = tenant_of(state, request)
    require_ready(state)
    body = await read_json(state, request)
    unknown = sorted(set(body) - {"text", "token_ids", "shared"})
    if unknown:
        raise bad(unknown[0], "unknown field (accepted: text, token_ids, shared)", "unknown_field")
    if ("text" in body) == ("token_ids" in body):
        raise bad("text", "give exactly one of 'text' or 'token_ids'")
    if "text" in body:
        if not isinstance(body["text"], str):
            raise bad("text", f"expected a string, got {type(body['text']).__name__}")
        toks = state.tokenizer.encode(body["text"])
    else:
        toks = body["token_ids"]
        if not isinstance(toks, list) or not all(_is_int(t) for t in toks):
            raise bad("token_ids", "expected a list of integers")
        badt = [t for t in toks if not 0 <= t < state.vocab_size]
        if badt:
            raise bad("token_ids", f"token ids {badt[:5]} outside [0, {state.vocab_size})")
    shared = body.get("shared", False)
    if not isinstance(shared, bool):
        raise bad("shared", f"expected a boolean, got {shared!r}")
    if not toks:
        raise bad("text" if "text" in body else "token_ids", "empty document")
    if len(toks) > state.capacity - 1:
        raise bad("text" if "text" in body else "token_ids",
                  f"document of {len(toks)} tokens exceeds the limit {state.capacity - 1}", "context_length_exceeded")
    doc, created = state.registry.add(tenant, toks, shared)
    if doc.artifact is None:  # build now, so a citing request never waits on it
        job = Job("build", asyncio.get_running_loop(), doc=doc)
        submit(state, job)
        ev = await job.out.get()
        if ev[0] == "error":
            raise ApiError(ev[1], f"artifact build failed: {ev[2]}", "server_error", "artifact_build_failed")
    state.metrics.documents.set(len(state.registry))
    return JSONResponse(doc.describe(), status_code=201 if created else 200)


def _doc_id(request) -> str:
    """The {doc_id:path} route sends path-shaped ids (`../x`, `a/b`) here, to a 400, not to a 404."""
    did = request.path_params["doc_id"]
    if not docmod.valid_id(did):
        raise bad("id", f"expected a document id of 64 lowercase hex characters, got {did!r}", "invalid_document_id")
    return did


@endpoint
async def get_document(state, request):
    tenant = tenant_of(state, request)
    did = _doc_id(request)
    doc = state.registry.get(tenant, did)
    if doc is None:
        raise ApiError(404, f"document '{did}' not found", code="document_not_found", param="id")
    return JSONResponse(doc.describe())


@endpoint
async def delete_document(state, request):
    tenant = tenant_of(state, request)
    did = _doc_id(request)
    doc = state.registry.get(tenant, did)
    if not state.registry.delete(tenant, did):
        raise ApiError(404, f"document '{did}' not found", code="document_not_found", param="id")
    arena = state.scheduler.arena
    if arena is not None and doc is not None and doc.artifact is not None:
        arena.evict([doc.artifact])  # its device rows freed now (unless a request in flight reads them)
    prefixes = state.scheduler.rt.prefix_cache if state.scheduler.rt is not None else None
    if prefixes is not None and doc is not None and doc.artifact is not None:
        prefixes.drop(doc.artifact)  # and its hot prefix state
    state.metrics.documents.set(len(state.registry))
    return JSONResponse({"id": did, "object": "document", "deleted": True})


@endpoint
async def list_documents(state, request):
    tenant = tenant_of(state, request)
    return JSONResponse({"object": "list", "data": [d.describe() for d in state.registry.list(tenant)]})


@endpoint
async def models(state, request):
    tenant_of(state, request)
    return JSONResponse({"object": "list", "data": [{"id": state.model_name, "object": "model",
                                                     "created": state.created, "owned_by": "redknot-jax"}]})


async def healthz(request):
    """200 {"status": "ok"} once the warm-up has finished and the model worker runs; else 503:
    "warming" (with Retry-After), "failed" (the warm-up's error), "unavailable" (worker gone).
    Every answer carries the warm-up's progress (`warmup`: lengths, done, programs, seconds)."""
    state = request.app.state.server
    sched = state.scheduler
    body = {"model": state.model_name, "warmup": sched.warmup_status()}
    if sched.phase == "warming":
        return JSONResponse({"status": "warming", **body}, status_code=503,
                            headers={"Retry-After": str(WARMING_RETRY_AFTER_S)})
    if sched.phase == "failed":
        return JSONResponse({"status": "failed", "error": sched.warmup_error, **body}, status_code=503)
    ok = sched.alive
    return JSONResponse({"status": "ok" if ok else "unavailable", **body}, status_code=200 if ok else 503)


async def metrics(request):
    state = request.app.state.server
    state.metrics.documents.set(len(state.registry))
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def http_error(request, exc: HTTPException):
    state = request.app.state.server
    state.metrics.responses.labels(str(exc.status_code)).inc()
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                    code="not_found" if exc.status_code == 404 else "http_error").response()


async def server_error(request, exc: Exception):
    state = request.app.state.server
    state.metrics.responses.labels("500").inc()
    log.exception("unhandled error")
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error", "internal_error").response()


def create_app(state) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not state.scheduler.alive:
            state.scheduler.start()
        yield
        # uvicorn has already drained connections (timeout_graceful_shutdown); whatever is left
        # in the worker is finished within the grace period or failed explicitly.
        await asyncio.to_thread(state.scheduler.stop, state.cfg.shutdown_grace_s)
        log.warning("redknot server stopped: model worker joined, no job left behind")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/documents", create_document, methods=["POST"]),
        Route("/v1/documents", list_documents, methods=["GET"]),
        Route("/v1/documents/{doc_id:path}", get_document, methods=["GET"]),
        Route("/v1/documents/{doc_id:path}", delete_document, methods=["DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = state
    return app
