# -*- test-case-name: tests.test_pathnorm -*-
"""
Request-path normalization and the hidden-endpoint check (FD §6, FD §10 case 14).

The vLLM facade must answer 404 for vLLM's development and admin endpoints
(``/sleep``, ``/wake_up``, ...), however a client spells them.  The check is
made on a *normalized* path, so the spellings an upstream server, an
intermediary or a future vLLM might resolve to the same route are all caught:

1. Only the path is considered: anything from the first raw ``?`` or ``#`` on
   is dropped.  An absolute-form request target (``http://host/sleep``) is
   reduced to its path, because some servers route on it.
2. Percent-decoding is applied repeatedly until the result stops changing
   (``%2573`` -> ``%73`` -> ``s``), at most :data:`MAX_DECODE_ROUNDS` times;
   a path that is still changing after that is invalid.
3. ``\\`` is treated as ``/``.  No OpenAI-style route contains a backslash,
   several servers and URL parsers (WHATWG, IIS) treat it as a separator, and
   for a deny list the safe mistake is to over-match.
4. Empty segments (``//``) and ``.`` segments are dropped; ``..`` removes the
   previous segment and never climbs above the root.

:func:`normalize_path` stops there: it keeps case and a trailing slash, so
callers can also use it for routing.  :func:`match_key` goes further, for
matching only: it drops ``;parameters`` from each segment before resolving
dot segments (``/v1/..;/sleep``), case-folds, and removes the trailing slash.

A path is *invalid* (``None``) when it is empty, too long (before or after
decoding), does not start with ``/``, decodes to bytes that are not UTF-8, or
contains a NUL or any other control character.  :func:`is_hidden` fails
closed: an invalid path counts as hidden, so the facade answers 404 (or 400)
instead of forwarding it.

:func:`url_text_problem` is a separate, earlier check: Klein routes on text,
so a path whose percent-decoded segments, or a ``Host`` whose bytes, are not
UTF-8 can only be refused (400); it names the reason so the refusal is one
log line, not a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from urllib.parse import unquote_to_bytes

from nvproxy.memo import SHORT, keep_short

__all__ = [
    "HIDDEN_VLLM",
    "HIDDEN_VLLM_PREFIXES",
    "MAX_DECODE_ROUNDS",
    "MAX_PATH_BYTES",
    "is_hidden",
    "match_key",
    "normalize_path",
    "url_text_problem",
]

MAX_PATH_BYTES = 8192
"""Longest raw request path accepted; longer ones are invalid."""

MAX_DECODE_ROUNDS = 4
"""Percent-decoding rounds; a path still changing after them is invalid."""

HIDDEN_VLLM: frozenset[str] = frozenset(
    {
        # vllm/entrypoints/serve/dev/sleep/api_router.py (VLLM_SERVER_DEV_MODE)
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        # dev/rpc/api_router.py
        "/collective_rpc",
        # dev/cache/api_router.py
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        # dev/server_info/api_router.py
        "/server_info",
        # dev/api_router.py (some versions)
        "/reconfigure",
        # dev/rlhf/api_router.py: generation pause and weight transfer
        "/pause",
        "/resume",
        "/is_paused",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/get_world_size",
        # dev/runtime_config/api_router.py (GET and PATCH)
        "/v1/runtime_config",
        # profile/api_router.py (VLLM_TORCH_PROFILER_DIR)
        "/start_profile",
        "/stop_profile",
        # elastic_ep/api_router.py
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        # lora/api_router.py (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)
"""vLLM endpoints that change or reveal engine state; never reachable publicly.

Collected from the routers under ``vllm/entrypoints/serve/`` (and the older
``vllm/entrypoints/openai/api_server.py``), which mount them only in dev mode
or behind an opt-in environment variable or flag.
"""

HIDDEN_VLLM_PREFIXES: tuple[str, ...] = (
    # nvproxy's own admin namespace: served only on the loopback admin
    # listener (FD §6.5), never on a public facade.
    "/admin",
    # vLLM's opt-in control plane (serve/admin/api_router.py, --enable-admin-api).
    "/v1/admin",
    # /pause/step (serve/pause/api_router.py) next to the exact /pause.
    "/pause",
    # /fault_tolerance/apply and /fault_tolerance/status.
    "/fault_tolerance",
)
"""Path prefixes hidden together with everything below them."""

_ABSOLUTE_FORM = re.compile(rb"^[A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _decode(raw: bytes) -> str | None:
    """Cut the query, percent-decode until stable, validate; no splitting."""
    if not raw or len(raw) > MAX_PATH_BYTES:
        return None
    raw = raw.split(b"?", 1)[0].split(b"#", 1)[0]
    absolute = _ABSOLUTE_FORM.match(raw)
    if absolute is not None:
        raw = raw[absolute.end() :] or b"/"
    decoded = raw
    for _ in range(MAX_DECODE_ROUNDS):
        again = unquote_to_bytes(decoded)
        if again == decoded:
            break
        decoded = again
    else:
        if unquote_to_bytes(decoded) != decoded:
            return None
    if len(decoded) > MAX_PATH_BYTES:
        return None
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _CONTROL.search(text) is not None:
        return None
    text = text.replace("\\", "/")
    if not text.startswith("/"):
        return None
    return text


def _resolve(segments: Iterable[str]) -> list[str]:
    """Drop empty and ``.`` segments, apply ``..`` (never above the root)."""
    out: list[str] = []
    for segment in segments:
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return out


CACHED_PATH = SHORT
"""Paths up to this many bytes have their forms kept (a facade sees the
same few routes over and over, and each request asks several times)."""


@keep_short(1024, CACHED_PATH)
def normalize_path(raw: bytes) -> str | None:
    """
    Return the normalized form of a request path, or ``None`` if invalid.

    The result starts with ``/``, has no empty, ``.`` or ``..`` segments, keeps
    the case of the input and keeps one trailing slash if the decoded path
    ended with one (``/`` itself stays ``/``).  Normalizing a normalized path
    returns it unchanged.
    """
    text = _decode(raw)
    if text is None:
        return None
    parts = text.split("/")
    segments = _resolve(parts)
    if not segments:
        return "/"
    trailing = parts[-1] in ("", ".", "..")
    return "/" + "/".join(segments) + ("/" if trailing else "")


@keep_short(1024, CACHED_PATH)
def match_key(raw: bytes) -> str | None:
    """
    Return the key :func:`is_hidden` compares, or ``None`` if invalid.

    Like :func:`normalize_path`, but ``;parameters`` are removed from each
    segment before dot segments are resolved, the result is case-folded, and
    there is no trailing slash (except for the root, ``/``).
    """
    text = _decode(raw)
    if text is None:
        return None
    segments = _resolve(part.split(";", 1)[0] for part in text.split("/"))
    return ("/" + "/".join(segments)).casefold()


@lru_cache(maxsize=32)
def _keys(
    hidden: frozenset[str], prefixes: tuple[str, ...]
) -> tuple[frozenset[str], tuple[str, ...]]:
    """
    The keys a path is hidden as (the exact paths and the prefixes
    themselves) and what a path below a prefix starts with: one set lookup
    and one C{startswith} per request, not a pass over the prefixes.
    """

    def key(path: str) -> str:
        normalized = match_key(path.encode("utf-8"))
        if normalized is None:
            raise ValueError(f"invalid hidden path: {path!r}")
        return normalized

    below = tuple(key(p) for p in prefixes)
    exact = frozenset(key(p) for p in hidden) | frozenset(below)
    return exact, tuple(prefix.rstrip("/") + "/" for prefix in below)


def is_hidden(
    raw_path: bytes,
    hidden: frozenset[str] = HIDDEN_VLLM,
    hidden_prefixes: tuple[str, ...] = HIDDEN_VLLM_PREFIXES,
) -> bool:
    """
    Whether a request for ``raw_path`` must not reach the engine.

    True if the path's :func:`match_key` equals one of ``hidden`` or equals or
    lies under one of ``hidden_prefixes`` (both compared case-insensitively and
    without trailing slashes), and True for every invalid path (fail closed).
    """
    key = match_key(raw_path)
    if key is None:
        return True
    exact, below = _keys(hidden, hidden_prefixes)
    return key in exact or key.startswith(below)


def url_text_problem(segments: Sequence[bytes], host: bytes) -> str | None:
    """
    Why a request's URL cannot be routed as text, or C{None} if it can.

    @param segments: the request's path segments as twisted.web hands them
        to a resource (C{request.postpath}: split on ``/``, each
        percent-decoded once).
    @param host: the request's C{Host} value (or the host name in it: a
        port is digits, which decode either way), empty without one.
    """
    try:
        b"/".join(segments).decode("utf-8")
    except UnicodeDecodeError:
        return "the request path is not valid UTF-8"
    try:
        host.decode("utf-8")
    except UnicodeDecodeError:
        return "the Host header is not valid UTF-8"
    return None
