# -*- test-case-name: tests.test_client_errors -*-
"""
The gate in front of every Klein app nvproxy serves (facades, admin API):
URLs Klein cannot route as text are an expected client error, answered by
the caller's own dialect with one log line, not a Klein traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET

from nvproxy.proxy.headers import HOST
from nvproxy.proxy.pathnorm import url_text_problem


class TextURLGate(Resource):
    """
    Klein routes on text: a URL whose path or host is not UTF-8 is refused
    here (by C{refuse}: the facade's dialect, the admin API's JSON), before
    Klein would answer it with its own 400 and log a traceback.
    """

    isLeaf = True

    def __init__(self, inner: IResource, refuse: Callable[[Any, str], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._inner = inner
        self._refuse = refuse

    def render(self, request: Any) -> Any:
        # The Host header as it is: its port is digits, so it decodes as
        # the host name in it does (without getRequestHostname's regex and
        # name lookups); without one the host is the connection's address.
        host = request.requestHeaders._rawHeaders.get(HOST)
        problem = url_text_problem(request.postpath, host[-1] if host else b"")
        if problem is None:
            return self._inner.render(request)
        self._refuse(request, problem)
        return NOT_DONE_YET
