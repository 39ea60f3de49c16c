# -*- test-case-name: tests.test_access -*-
"""
Keys that engines want from nvproxy (C{[engines.E] backend_api_key_file}):
vLLM's C{--api-key}, LM Studio's tokens.

L{KeyedAgent} wraps the shared upstream agent: a request to a configured
engine base URL (this node's engine, a direct node's) carries
C{Authorization: Bearer KEY}, replacing any the client sent.  It sits under
the data path, inventory polling, inventory fan-outs, CORS fan-outs and the
vLLM sleep/wake calls alike, since they all share the one agent.  A peer's
facade is never a configured engine URL: a peer adds its own engine's key.
"""

from __future__ import annotations

from collections.abc import Mapping

from twisted.internet.defer import Deferred
from twisted.web.http_headers import Headers
from twisted.web.iweb import IAgent, IBodyProducer, IResponse
from zope.interface import implementer

from nvproxy.proxy.headers import OwnHeaders, copy_headers

__all__ = ["BackendKeyError", "KeyedAgent", "read_backend_key"]


class BackendKeyError(Exception):
    """The key file cannot be used; C{str()} is one line, never the key."""


def read_backend_key(path: str) -> str:
    """
    The key in C{path}: its one line, without surrounding whitespace.

    @raise BackendKeyError: unreadable, empty, or more than one line.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(65537)
    except OSError as e:
        raise BackendKeyError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise BackendKeyError(f"{path}: the key must be ASCII text") from None
    if not text:
        raise BackendKeyError(f"{path} is empty")
    if (
        len(data) > 65536
        or "\n" in text
        or "\r" in text
        or any(ch.isspace() or not ch.isprintable() for ch in text)
    ):
        raise BackendKeyError(f"{path} must hold one line: the key")
    return text


def _base(url: str) -> bytes:
    return url.rstrip("/").encode("ascii")


@implementer(IAgent)
class KeyedAgent:
    """
    C{agent}, adding each engine's key to requests for its base URLs.

    @param keys: engine base URL -> the key it wants.
    """

    def __init__(self, agent: IAgent, keys: Mapping[str, str]) -> None:
        self._agent = agent
        self._keys = [(_base(url), key.encode("ascii")) for url, key in keys.items()]
        # Longest first, so a base with a path wins over its host's.
        self._keys.sort(key=lambda pair: -len(pair[0]))

    def _key_for(self, uri: bytes) -> bytes | None:
        for base, key in self._keys:
            if uri == base or uri[len(base) : len(base) + 1] in (b"/", b"?"):
                if uri.startswith(base):
                    return key
        return None

    def request(
        self,
        method: bytes,
        uri: bytes,
        headers: Headers | None = None,
        bodyProducer: IBodyProducer | None = None,
    ) -> Deferred[IResponse]:
        key = self._key_for(uri)
        if key is not None:
            if type(headers) is not OwnHeaders:
                headers = copy_headers(headers) if headers is not None else Headers()
            headers.setRawHeaders(b"authorization", [b"Bearer " + key])
        return self._agent.request(method, uri, headers, bodyProducer)
