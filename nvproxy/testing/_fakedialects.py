# -*- test-case-name: tests.test_fakeengine -*-
"""
What the fake engines answer, as pure functions: no I/O, no clock reads.

Each dialect is a route table (path -> L{Route}); a route's handler turns a
L{Call} (the parsed request plus the knobs of the scripted behaviour) into a
L{Reply}: a status, a content type and the body as a tuple of parts.  A
streaming reply's parts are written one by one (one HTTP chunk each) by
L{nvproxy.testing.fakeengine}; a plain reply has exactly one part.

Shapes follow the public APIs of Ollama, OpenAI-compatible servers (LM Studio,
vLLM) and llama.cpp's C{llama-server}, trimmed to what clients parse.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from attrs import frozen

Json = Mapping[str, Any]

WORDS = ("Hello", " from", " the", " fake", " engine", ".")


@frozen
class Call:
    """
    One parsed request as a handler sees it.

    @ivar models: the engine's live model list (C{/api/pull} appends to it).
    @ivar tokens: how many tokens to generate (L{Behaviour.chunks}); the
        llama.cpp dialect caps it at the request's token limit.
    @ivar usage: whether usage / eval counts are reported.
    @ivar force_usage: send the OpenAI usage chunk even if not asked for.
    """

    method: str
    path: str
    body: Json
    form: Mapping[str, str]
    models: list[str]
    now: float
    seq: int
    tokens: int
    usage: bool
    force_usage: bool


@frozen
class Reply:
    status: int
    content_type: str
    parts: tuple[bytes, ...]
    streaming: bool = False


@frozen
class Route:
    handler: Callable[[Call], Reply]
    methods: frozenset[str]
    inference: bool
    family: str  # which error dialect: "ollama" | "openai" | "llamacpp"


# -- helpers -----------------------------------------------------------------


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def _json(obj: object, status: int = 200) -> Reply:
    return Reply(status, "application/json", (dumps(obj),))


def _ndjson(objs: Sequence[object]) -> Reply:
    parts = tuple(dumps(o) + b"\n" for o in objs)
    return Reply(200, "application/x-ndjson", parts, streaming=True)


def _sse(objs: Sequence[object], done: bool) -> Reply:
    parts = [b"data: " + dumps(o) + b"\n\n" for o in objs]
    if done:
        parts.append(b"data: [DONE]\n\n")
    return Reply(200, "text/event-stream", tuple(parts), streaming=True)


def iso(seconds: float) -> str:
    stamp = datetime.fromtimestamp(seconds, tz=UTC).isoformat()
    return stamp.replace("+00:00", "Z")


def tokens(n: int) -> list[str]:
    return [WORDS[i % len(WORDS)] for i in range(n)]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _vector(text: str, dim: int = 8) -> list[float]:
    raw = hashlib.sha256(text.encode("utf-8")).digest()
    return [round(b / 127.5 - 1.0, 6) for b in raw[:dim]]


def _texts(value: object) -> list[str]:
    if isinstance(value, list):
        return [v if isinstance(v, str) else json.dumps(v) for v in value]
    return [value if isinstance(value, str) else json.dumps(value)]


def _prompt_text(body: Json) -> str:
    """The text a request asks about, for counting prompt tokens."""
    pieces: list[str] = []
    for message in body.get("messages") or []:
        if isinstance(message, Mapping):
            content = message.get("content")
            pieces.append(content if isinstance(content, str) else json.dumps(content))
    for key in ("prompt", "input", "query", "input_prefix", "input_suffix"):
        if key in body:
            pieces.extend(_texts(body[key]))
    return " ".join(pieces)


def _count(text: str) -> int:
    return max(1, len(text.split()))


def model_of(body: Json, form: Mapping[str, str]) -> str | None:
    for source in (body, form):
        for key in ("model", "name"):
            value = source.get(key)
            if isinstance(value, str):
                return value
    return None


def _ollama_model(models: Sequence[str], name: str) -> str | None:
    if name in models:
        return name
    if ":" not in name and f"{name}:latest" in models:
        return f"{name}:latest"
    return None


# -- errors ------------------------------------------------------------------

_OAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: ("invalid_request_error"),
    429: "rate_limit_error",
}
_LLAMA_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


def error_reply(
    family: str, status: int, message: str, code: str | None = None
) -> Reply:
    """A non-2xx answer in the error shape of C{family}."""
    body: object
    if family == "ollama":
        body = {"error": message}
    elif family == "llamacpp":
        kind = _LLAMA_TYPES.get(status, "server_error")
        body = {"error": {"code": status, "message": message, "type": kind}}
    else:
        kind = _OAI_TYPES.get(status, "server_error")
        body = {
            "error": {"message": message, "type": kind, "param": None, "code": code}
        }
    return _json(body, status)


def bad_json(family: str, error: ValueError) -> Reply:
    """
    A request body that is not JSON: a 400, but C{llama-server}'s parser
    throws and the server answers a 500 C{server_error}.
    """
    if family != "llamacpp":
        return error_reply(family, 400, f"invalid JSON body: {error}")
    if isinstance(error, json.JSONDecodeError):
        where = f"line {error.lineno}, column {error.colno}"
        detail = f"{where}: syntax error while parsing value - {error.msg}"
    else:
        detail = f"line 1, column 1: {error}"
    return error_reply(
        family, 500, f"[json.exception.parse_error.101] parse error at {detail}"
    )


def unknown_route(dialect: str, method: str, path: str) -> Reply:
    if dialect == "ollama":
        return Reply(404, "text/plain", (b"404 page not found",))
    if dialect == "llamacpp":
        return error_reply("llamacpp", 404, "File Not Found")
    return _json({"detail": "Not Found"}, 404)


def _missing_model(family: str, name: str) -> Reply:
    if family == "ollama":
        return error_reply(
            family, 404, f'model "{name}" not found, try pulling it first'
        )
    if family == "openai":
        return error_reply(
            family, 404, f"The model `{name}` does not exist.", code="model_not_found"
        )
    return error_reply(family, 404, f"model {name} not found")


# -- OpenAI shape (all three dialects serve it) -------------------------------


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _oai_generate(call: Call, model: str, chat: bool, extra: Json) -> Reply:
    toks = tokens(call.tokens)
    prompt_n = _count(_prompt_text(call.body))
    created = int(call.now)
    if chat:
        ident, kind = f"chatcmpl-fake{call.seq}", "chat.completion"
    else:
        ident, kind = f"cmpl-fake{call.seq}", "text_completion"
    head = {"id": ident, "created": created, "model": model}
    usage = _usage(prompt_n, len(toks))
    if not call.body.get("stream", False):
        text = "".join(toks)
        choice: dict[str, object] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop",
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj: dict[str, object] = {**head, "object": kind, "choices": [choice]}
        if call.usage:
            obj["usage"] = usage
        obj.update(extra)
        return _json(obj)
    kind += ".chunk" if chat else ""

    def chunk(
        text: str | None, finish: str | None, first: bool = False
    ) -> dict[str, object]:
        piece: dict[str, object] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish,
        }
        if chat:
            delta: dict[str, str] = {} if text is None else {"content": text}
            if first:
                delta = {"role": "assistant", **delta}
            piece["delta"] = delta
        else:
            piece["text"] = text or ""
        return {**head, "object": kind, "choices": [piece]}

    events: list[object] = [chunk(t, None, i == 0) for i, t in enumerate(toks)]
    events.append(chunk(None, "stop"))
    options = call.body.get("stream_options")
    asked = isinstance(options, Mapping) and bool(options.get("include_usage"))
    if call.usage and (asked or call.force_usage):
        events.append({**head, "object": kind, "choices": [], "usage": usage})
    return _sse(events, done=True)


def _oai_embeddings(call: Call, model: str) -> Reply:
    texts = _texts(call.body.get("input", ""))
    data = [
        {"object": "embedding", "index": i, "embedding": _vector(t)}
        for i, t in enumerate(texts)
    ]
    obj: dict[str, object] = {"object": "list", "data": data, "model": model}
    if call.usage:
        n = sum(_count(t) for t in texts)
        obj["usage"] = {"prompt_tokens": n, "total_tokens": n}
    return _json(obj)


def _oai_model_list(ids: Sequence[str], owner: str, created: int) -> list[Json]:
    return [
        {"id": m, "object": "model", "created": created, "owned_by": owner} for m in ids
    ]


# -- Ollama ------------------------------------------------------------------

_OLLAMA_DETAILS = {
    "parent_model": "",
    "format": "gguf",
    "family": "llama",
    "families": ["llama"],
    "parameter_size": "8.0B",
    "quantization_level": "Q4_0",
}
_SIZE = 4_661_224_676


def _ollama_entry(name: str, now: float) -> dict[str, object]:
    return {
        "name": name,
        "model": name,
        "modified_at": iso(now),
        "size": _SIZE,
        "digest": _digest(name),
        "details": dict(_OLLAMA_DETAILS),
    }


def _ollama_counts(prompt_n: int, eval_n: int) -> dict[str, int]:
    prompt_ns, eval_ns, load_ns = prompt_n * 1_000_000, eval_n * 10_000_000, 1_000_000
    return {
        "total_duration": prompt_ns + eval_ns + load_ns,
        "load_duration": load_ns,
        "prompt_eval_count": prompt_n,
        "prompt_eval_duration": prompt_ns,
        "eval_count": eval_n,
        "eval_duration": eval_ns,
    }


def _require_model(call: Call) -> tuple[str, Reply | None]:
    name = model_of(call.body, call.form)
    if name is None:
        return "", error_reply("ollama", 400, "model is required")
    if _ollama_model(call.models, name) is None:
        return name, _missing_model("ollama", name)
    return name, None


def _ollama_generate(call: Call) -> Reply:
    name, error = _require_model(call)
    if error is not None:
        return error
    chat = call.path == "/api/chat"
    toks = tokens(call.tokens)
    stamp = iso(call.now)

    def line(text: str, done: bool) -> dict[str, object]:
        obj: dict[str, object] = {"model": name, "created_at": stamp}
        if chat:
            obj["message"] = {"role": "assistant", "content": text}
        else:
            obj["response"] = text
        obj["done"] = done
        if done:
            obj["done_reason"] = "stop"
            if not chat:
                obj["context"] = list(range(1, len(toks) + 2))
            if call.usage:
                obj.update(_ollama_counts(_count(_prompt_text(call.body)), len(toks)))
        return obj

    if not call.body.get("stream", True):
        return _json(line("".join(toks), True))
    return _ndjson([*(line(t, False) for t in toks), line("", True)])


def _ollama_embed(call: Call) -> Reply:
    name, error = _require_model(call)
    if error is not None:
        return error
    if call.path == "/api/embeddings":
        return _json({"embedding": _vector(str(call.body.get("prompt", "")))})
    texts = _texts(call.body.get("input", ""))
    obj: dict[str, object] = {"model": name, "embeddings": [_vector(t) for t in texts]}
    if call.usage:
        obj.update(
            {
                "total_duration": 2_000_000,
                "load_duration": 1_000_000,
                "prompt_eval_count": sum(_count(t) for t in texts),
            }
        )
    return _json(obj)


def _ollama_pull(call: Call) -> Reply:
    name = model_of(call.body, call.form)
    if name is None:
        return error_reply("ollama", 400, "model is required")
    canonical = name if ":" in name else f"{name}:latest"
    if _ollama_model(call.models, canonical) is None:
        call.models.append(canonical)
    if not call.body.get("stream", True):
        return _json({"status": "success"})
    digest = "sha256:" + _digest(canonical)
    return _ndjson(
        [
            {"status": "pulling manifest"},
            {
                "status": f"pulling {digest[7:19]}",
                "digest": digest,
                "total": _SIZE,
                "completed": _SIZE,
            },
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ]
    )


def _ollama_show(call: Call) -> Reply:
    name = model_of(call.body, call.form) or ""
    if _ollama_model(call.models, name) is None:
        return error_reply("ollama", 404, f"model '{name}' not found")
    return _json(
        {
            "license": "",
            "modelfile": f"# fake\nFROM {name}\n",
            "parameters": 'stop "<|eot_id|>"',
            "template": "{{ .Prompt }}",
            "details": dict(_OLLAMA_DETAILS),
            "modified_at": iso(call.now),
            "model_info": {
                "general.architecture": "llama",
                "general.parameter_count": 8_030_261_248,
                "llama.context_length": 8192,
            },
            "capabilities": ["completion"],
        }
    )


def _ollama_ps(call: Call) -> Reply:
    models = []
    for name in call.models:
        entry = _ollama_entry(name, call.now)
        entry.update(
            {
                "expires_at": iso(call.now + 300),
                "size_vram": _SIZE,
                "context_length": 4096,
            }
        )
        models.append(entry)
    return _json({"models": models})


def _ollama_v1(call: Call) -> Reply:
    name = model_of(call.body, call.form)
    if name is None:
        return error_reply("openai", 400, "model is required")
    if _ollama_model(call.models, name) is None:
        return error_reply(
            "openai",
            404,
            f'model "{name}" not found, try pulling it first',
            code="model_not_found",
        )
    if call.path == "/v1/embeddings":
        return _oai_embeddings(call, name)
    return _oai_generate(call, name, call.path == "/v1/chat/completions", {})


# -- OpenAI-style (LM Studio, vLLM) -------------------------------------------


def _openai_model(call: Call) -> tuple[str, Reply | None]:
    name = model_of(call.body, call.form)
    if name is None:
        if not call.models:
            return "", error_reply("openai", 400, "No models loaded")
        return call.models[0], None
    if name not in call.models:
        return name, _missing_model("openai", name)
    return name, None


def _openai_infer(call: Call) -> Reply:
    name, error = _openai_model(call)
    if error is not None:
        return error
    path = call.path.removeprefix("/api/v0").removeprefix("/v1")
    if path == "/embeddings":
        return _oai_embeddings(call, name)
    if path == "/audio/transcriptions":
        return _json({"text": "".join(tokens(call.tokens))})
    extra: dict[str, object] = {}
    if call.path.startswith("/api/v0/"):
        extra = {
            "stats": {
                "tokens_per_second": 100.0,
                "time_to_first_token": 0.01,
                "generation_time": call.tokens / 100.0,
                "stop_reason": "eosFound",
            },
            "model_info": {
                "arch": "llama",
                "quant": "Q4_K_M",
                "format": "gguf",
                "context_length": 4096,
            },
            "runtime": {
                "name": "llama.cpp-fake",
                "version": "0.0.0",
                "supported_formats": ["gguf"],
            },
        }
    return _oai_generate(call, name, path == "/chat/completions", extra)


def _lmstudio_models(call: Call) -> Reply:
    data = [
        {
            "id": m,
            "object": "model",
            "type": "llm",
            "publisher": "fake",
            "arch": "llama",
            "compatibility_type": "gguf",
            "quantization": "Q4_K_M",
            "state": "loaded",
            "max_context_length": 4096,
        }
        for m in call.models
    ]
    return _json({"object": "list", "data": data})


# -- llama.cpp -----------------------------------------------------------------


def _llama_name(call: Call) -> str:
    """
    The model an answer names: C{llama-server} echoes its own alias whatever
    the request asked for (a fake serving several models echoes the one asked
    for when it has it).
    """
    name = model_of(call.body, call.form)
    if name is not None and name in call.models:
        return name
    return call.models[0] if call.models else "model.gguf"


@frozen
class Gen:
    """The generated pieces, and whether the token limit cut them short."""

    pieces: list[str]
    limited: bool

    @property
    def n(self) -> int:
        return len(self.pieces)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


_LLAMA_LIMIT_KEYS = ("n_predict", "max_tokens", "max_completion_tokens")


def _llama_generated(call: Call, keys: Sequence[str] = _LLAMA_LIMIT_KEYS) -> Gen:
    """
    How much the model writes: L{Call.tokens} (the model stops by itself
    after that many), capped by the request's token limit -- the first of
    C{keys} present; a negative one means no limit, as in C{llama-server}.
    """
    for key in keys:
        if key in call.body:
            value = call.body[key]
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                if value <= call.tokens:
                    return Gen(tokens(value), True)
            break
    return Gen(tokens(call.tokens), False)


def _llama_timings(prompt_n: int, eval_n: int) -> dict[str, float]:
    return {
        "cache_n": 0,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_n * 1.0,
        "prompt_per_token_ms": 1.0,
        "prompt_per_second": 1000.0,
        "predicted_n": eval_n,
        "predicted_ms": eval_n * 10.0,
        "predicted_per_token_ms": 10.0,
        "predicted_per_second": 100.0,
    }


def _llama_native(call: Call) -> Reply:
    name = _llama_name(call)
    gen = _llama_generated(call)
    prompt_n = _count(_prompt_text(call.body))

    def event(text: str, done: bool, predicted: int) -> dict[str, object]:
        obj: dict[str, object] = {
            "index": 0,
            "content": text,
            "tokens": [],
            "stop": done,
            "id_slot": 0,
        }
        if done:
            obj.update(
                {
                    "model": name,
                    "stop_type": "limit" if gen.limited else "eos",
                    "stopping_word": "",
                    "truncated": False,
                    "tokens_cached": prompt_n + predicted,
                }
            )
        if call.usage:
            obj["tokens_predicted"] = predicted
            obj["tokens_evaluated"] = prompt_n
            if done:
                obj["timings"] = _llama_timings(prompt_n, predicted)
        return obj

    if not call.body.get("stream", False):
        return _json(event(gen.text, True, gen.n))
    events = [event(t, False, i + 1) for i, t in enumerate(gen.pieces)]
    return _sse([*events, event("", True, gen.n)], done=False)


_LLAMA_FINGERPRINT = "b0000-fake"


def _llama_usage(prompt_n: int, completion_n: int) -> dict[str, object]:
    return {
        **_usage(prompt_n, completion_n),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _llama_generate(call: Call, name: str, chat: bool) -> Reply:
    """
    C{/v1/chat/completions} and C{/v1/completions} as C{llama-server} answers
    them: C{timings} next to C{usage} in a plain answer; a chat stream opens
    with a role-only chunk (C{content: null}) and puts the C{timings} on its
    finishing chunk, or on the usage chunk when C{stream_options} asks for
    one; a completion stream's finishing chunk always carries both.
    """
    gen = _llama_generated(call)
    prompt_n = _count(_prompt_text(call.body))
    finish = "length" if gen.limited else "stop"
    kind = "chat.completion" if chat else "text_completion"
    head: dict[str, object] = {
        "created": int(call.now),
        "model": name,
        "system_fingerprint": _LLAMA_FINGERPRINT,
    }
    ident = {"id": f"chatcmpl-fake{call.seq}"}
    report: dict[str, object] = {}
    if call.usage:
        report = {
            "usage": _llama_usage(prompt_n, gen.n),
            "timings": _llama_timings(prompt_n, gen.n),
        }

    def choice(text: str | None, reason: str | None) -> dict[str, object]:
        if chat:
            return {"finish_reason": reason, "index": 0}
        return {
            "text": text or "",
            "index": 0,
            "logprobs": None,
            "finish_reason": reason,
        }

    if not call.body.get("stream", False):
        piece = choice(gen.text, finish)
        if chat:
            piece["message"] = {"role": "assistant", "content": gen.text}
        return _json({"choices": [piece], **head, "object": kind, **ident, **report})

    def chunk(
        text: str | None, reason: str | None, **delta: object
    ) -> dict[str, object]:
        piece = choice(text, reason)
        if chat:
            piece["delta"] = delta
        obj: dict[str, object] = {"choices": [piece], **head}
        if chat:
            return {**obj, **ident, "object": kind + ".chunk"}
        return {**obj, "object": kind, **ident}

    if not chat:
        events: list[object] = [chunk(t, None) for t in gen.pieces]
        events.append({**chunk("", finish), **report})
        return _sse(events, done=True)
    events = [chunk(None, None, role="assistant", content=None)]
    events.extend(chunk(None, None, content=t) for t in gen.pieces)
    options = call.body.get("stream_options")
    asked = isinstance(options, Mapping) and bool(options.get("include_usage"))
    last = chunk(None, finish)
    if call.usage and (asked or call.force_usage):
        events.append(last)
        usage_chunk = {"choices": [], **head, **ident, "object": kind + ".chunk"}
        events.append({**usage_chunk, **report})
    else:
        timings = {"timings": report["timings"]} if report else {}
        events.append({**last, **timings})
    return _sse(events, done=True)


def _llama_oai(call: Call) -> Reply:
    name = _llama_name(call)
    if call.path == "/v1/embeddings":
        return _oai_embeddings(call, name)
    return _llama_generate(call, name, call.path.endswith("/chat/completions"))


def _sse_named(events: Sequence[tuple[str, Json]]) -> Reply:
    """Named SSE events; each payload also states its name as C{type}."""
    parts = tuple(
        b"event: %s\ndata: %s\n\n"
        % (name.encode("ascii"), dumps({"type": name, **obj}))
        for name, obj in events
    )
    return Reply(200, "text/event-stream", parts, streaming=True)


def _llama_responses(call: Call) -> Reply:
    """OpenAI's Responses API as C{llama-server} serves it (text only)."""
    name = _llama_name(call)
    gen = _llama_generated(call, ("max_output_tokens", "max_tokens"))
    prompt_n = _count(_prompt_text(call.body))
    created = int(call.now)
    ident, item = f"resp_fake{call.seq}", f"msg_fake{call.seq}"
    text_part = {
        "type": "output_text",
        "annotations": [],
        "logprobs": [],
        "text": gen.text,
    }
    message = {
        "content": [text_part],
        "id": item,
        "role": "assistant",
        "status": "completed",
        "type": "message",
    }
    usage: dict[str, object] = {}
    if call.usage:
        usage = {
            "usage": {
                "input_tokens": prompt_n,
                "output_tokens": gen.n,
                "total_tokens": prompt_n + gen.n,
                "input_tokens_details": {"cached_tokens": 0},
            }
        }
    if not call.body.get("stream", False):
        return _json(
            {
                "completed_at": created,
                "created_at": created,
                "id": ident,
                "model": name,
                "object": "response",
                "output": [message],
                "status": "completed",
                **usage,
            }
        )
    started = {"id": ident, "object": "response", "status": "in_progress"}
    events: list[tuple[str, Json]] = [
        ("response.created", {"response": started}),
        ("response.in_progress", {"response": started}),
        (
            "response.output_item.added",
            {"item": {**message, "content": [], "status": "in_progress"}},
        ),
        (
            "response.content_part.added",
            {"item_id": item, "part": {"type": "output_text", "text": ""}},
        ),
        *(
            ("response.output_text.delta", {"item_id": item, "delta": t})
            for t in gen.pieces
        ),
        ("response.output_text.done", {"item_id": item, "text": gen.text}),
        ("response.content_part.done", {"item_id": item, "part": text_part}),
        ("response.output_item.done", {"item": message}),
    ]
    completed: dict[str, object] = {
        "response": {
            **started,
            "created_at": created,
            "status": "completed",
            "model": name,
            "output": [message],
            **usage,
        }
    }
    if call.usage:
        completed["timings"] = _llama_timings(prompt_n, gen.n)
    events.append(("response.completed", completed))
    return _sse_named(events)


def _llama_messages(call: Call) -> Reply:
    """Anthropic's Messages API as C{llama-server} serves it (text only)."""
    name = _llama_name(call)
    gen = _llama_generated(call, ("max_tokens",))
    prompt_n = _count(_prompt_text(call.body))
    stop = "max_tokens" if gen.limited else "end_turn"
    ident = f"chatcmpl-fake{call.seq}"

    def usage(output: int) -> dict[str, object]:
        if not call.usage:
            return {}
        counts = {"cache_read_input_tokens": 0, "input_tokens": prompt_n}
        return {"usage": {**counts, "output_tokens": output}}

    message: dict[str, object] = {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": gen.text}],
        "model": name,
        "stop_reason": stop,
        "stop_sequence": None,
    }
    if not call.body.get("stream", False):
        return _json({**message, **usage(gen.n)})
    start = {**message, "content": [], "stop_reason": None, **usage(0)}
    final: dict[str, object] = {"delta": {"stop_reason": stop, "stop_sequence": None}}
    if call.usage:
        final["usage"] = {"output_tokens": gen.n}
    events: list[tuple[str, Json]] = [
        ("message_start", {"message": start}),
        (
            "content_block_start",
            {"index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        *(
            (
                "content_block_delta",
                {"index": 0, "delta": {"type": "text_delta", "text": t}},
            )
            for t in gen.pieces
        ),
        ("content_block_stop", {"index": 0}),
        ("message_delta", final),
        ("message_stop", {}),
    ]
    return _sse_named(events)


def _llama_count_tokens(call: Call) -> Reply:
    return _json({"input_tokens": _count(_prompt_text(call.body))})


def _llama_embedding(call: Call) -> Reply:
    texts = _texts(call.body.get("content", call.body.get("input", "")))
    return _json([{"index": i, "embedding": [_vector(t)]} for i, t in enumerate(texts)])


def _llama_rerank(call: Call) -> Reply:
    query = str(call.body.get("query", ""))
    documents = _texts(call.body.get("documents", []))
    results = []
    for i, doc in enumerate(documents):
        score = int(_digest(query + "\0" + doc)[:8], 16) / 0xFFFFFFFF * 2 - 1
        results.append({"index": i, "relevance_score": round(score, 6)})
    obj: dict[str, object] = {
        "model": _llama_name(call),
        "object": "list",
        "results": results,
    }
    if call.usage:
        n = _count(query) + sum(_count(d) for d in documents)
        obj["usage"] = {"prompt_tokens": n, "total_tokens": n}
    return _json(obj)


def _llama_models(call: Call) -> Reply:
    meta = {
        "vocab_type": 2,
        "n_vocab": 128256,
        "n_ctx_train": 8192,
        "n_embd": 4096,
        "n_params": 8_030_261_248,
        "size": _SIZE,
    }
    data = [
        {
            "id": m,
            "object": "model",
            "created": int(call.now),
            "owned_by": "llamacpp",
            "meta": meta,
        }
        for m in call.models
    ]
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": "",
        "families": [""],
        "parameter_size": "",
        "quantization_level": "",
    }
    models = [
        {
            "name": m,
            "model": m,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": details,
        }
        for m in call.models
    ]
    return _json({"models": models, "object": "list", "data": data})


def _llama_props(call: Call) -> Reply:
    name = call.models[0] if call.models else "model.gguf"
    return _json(
        {
            "default_generation_settings": {"n_ctx": 4096, "params": {"n_predict": -1}},
            "total_slots": 1,
            "model_path": f"/models/{name}",
            "chat_template": "{{ messages }}",
            "build_info": "b0000-fake",
            "modalities": {"vision": False, "audio": False},
        }
    )


def _llama_slots(call: Call) -> Reply:
    return _json([{"id": 0, "id_task": -1, "n_ctx": 4096, "is_processing": False}])


# -- route tables ------------------------------------------------------------


def _const(
    obj: object, content_type: str = "application/json"
) -> Callable[[Call], Reply]:
    body = obj if isinstance(obj, bytes) else dumps(obj)
    return lambda call: Reply(200, content_type, (body,))


def _table(
    family: str, rows: Sequence[tuple[str, str, Callable[[Call], Reply], bool]]
) -> dict[str, Route]:
    """Rows of (methods, paths, handler, inference); paths space-separated."""
    table = {}
    for methods, paths, handler, inference in rows:
        for path in paths.split():
            openai_compat = family == "ollama" and path.startswith("/v1/")
            route_family = "openai" if openai_compat else family
            table[path] = Route(
                handler, frozenset(methods.split()), inference, route_family
            )
    return table


ROUTES: Mapping[str, Mapping[str, Route]] = {
    "ollama": _table(
        "ollama",
        [
            ("GET HEAD", "/", _const(b"Ollama is running", "text/plain"), False),
            ("GET", "/api/version", _const({"version": "0.0.0-fake"}), False),
            (
                "GET",
                "/api/tags",
                lambda c: _json(
                    {"models": [_ollama_entry(m, c.now) for m in c.models]}
                ),
                False,
            ),
            ("GET", "/api/ps", _ollama_ps, False),
            ("POST", "/api/show", _ollama_show, False),
            ("POST", "/api/pull", _ollama_pull, False),
            ("POST", "/api/generate /api/chat", _ollama_generate, True),
            ("POST", "/api/embed /api/embeddings", _ollama_embed, True),
            (
                "GET",
                "/v1/models",
                lambda c: _json(
                    {
                        "object": "list",
                        "data": (_oai_model_list(c.models, "library", int(c.now))),
                    }
                ),
                False,
            ),
            (
                "POST",
                "/v1/chat/completions /v1/completions /v1/embeddings",
                _ollama_v1,
                True,
            ),
        ],
    ),
    "openai": _table(
        "openai",
        [
            (
                "GET",
                "/v1/models",
                lambda c: _json(
                    {"object": "list", "data": (_oai_model_list(c.models, "fake", 0))}
                ),
                False,
            ),
            ("GET", "/api/v0/models", _lmstudio_models, False),
            ("GET", "/health", _const(b"", "application/json"), False),
            ("GET", "/version", _const({"version": "0.0.0-fake"}), False),
            (
                "POST",
                "/v1/chat/completions /v1/completions /v1/embeddings "
                "/v1/audio/transcriptions /api/v0/chat/completions /api/v0/completions "
                "/api/v0/embeddings",
                _openai_infer,
                True,
            ),
        ],
    ),
    "llamacpp": _table(
        "llamacpp",
        [
            ("GET", "/health /v1/health", _const({"status": "ok"}), False),
            ("GET", "/models /v1/models", _llama_models, False),
            ("GET", "/props", _llama_props, False),
            ("GET", "/slots", _llama_slots, False),
            ("POST", "/completion /completions /infill", _llama_native, True),
            (
                "POST",
                "/v1/completions /chat/completions /v1/chat/completions /v1/embeddings",
                _llama_oai,
                True,
            ),
            ("POST", "/v1/responses /responses", _llama_responses, True),
            ("POST", "/v1/messages", _llama_messages, True),
            ("POST", "/v1/messages/count_tokens", _llama_count_tokens, False),
            ("POST", "/embedding /embeddings", _llama_embedding, True),
            (
                "POST",
                "/rerank /reranking /v1/rerank /v1/reranking",
                _llama_rerank,
                True,
            ),
        ],
    ),
}
