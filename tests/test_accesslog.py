"""
The access line's structured fields are exactly L{ACCESS_FIELDS}, in text
and JSON output alike.
"""

from __future__ import annotations

from typing import Any

from twisted.logger import LogLevel
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.test.requesthelper import DummyRequest

from nvproxy.logs import Logger, event_as_json_line, event_as_text_line
from nvproxy.proxy import accesslog


class AccessLineTests(SynchronousTestCase):
    def test_fields(self) -> None:
        events: list[dict[str, Any]] = []
        self.patch(
            accesslog,
            "log",
            Logger(namespace="nvproxy.access", observer=events.append),
        )
        request = DummyRequest([b"api", b"chat"])
        request.method = b"POST"
        request.path = b"/api/chat"
        request.startedWriting = 1
        request.code = 200
        request.sentLength = 512
        record = accesslog.access_of(request)
        record.engine, record.model, record.node, record.attempts = (
            "ollama",
            "m",
            "gpu-1",
            2,
        )
        accesslog.emit(request, 10.0, 10.04, 11.5, completed=True)
        (event,) = [e for e in events if e.get("log_namespace") == "nvproxy.access"]
        self.assertEqual(event["log_level"], LogLevel.info)
        fields = [key for key in event if not key.startswith("log_")]
        self.assertEqual(sorted(fields), sorted(accesslog.ACCESS_FIELDS))
        text = event_as_text_line(dict(event))
        assert text is not None
        self.assertIn(
            "POST /api/chat 200 engine=ollama model=m node=gpu-1 attempts=2"
            " ttfb_ms=40 duration_ms=1500 bytes=512 outcome=finished request_id=None",
            text,
        )
        self.assertIn('"attempts": 2', event_as_json_line(dict(event)))
