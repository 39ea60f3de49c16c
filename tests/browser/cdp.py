"""
A minimal Chrome DevTools Protocol client over C{--remote-debugging-pipe}
(NUL-terminated JSON messages, commands on the child's fd 3, answers on its
fd 4), on the Twisted reactor: enough to open a page, evaluate script in it
and take a screenshot.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure


class CDPError(Exception):
    pass


class Chromium(ProcessProtocol):
    def __init__(self) -> None:
        self._buffer = b""
        self._next = 0
        self._waiting: dict[int, Deferred[Any]] = {}
        self.err = b""
        self.ended: Deferred[None] = Deferred()
        self.session: str | None = None

    # -- process -----------------------------------------------------------

    def childDataReceived(self, childFD: int, data: bytes) -> None:
        if childFD == 4:
            self._buffer += data
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                self._message(json.loads(raw))
        elif childFD == 2:
            self.err = (self.err + data)[-20000:]

    def processEnded(self, reason: Failure) -> None:
        for d in self._waiting.values():
            d.errback(CDPError("chromium exited"))
        self._waiting.clear()
        self.ended.callback(None)

    def _message(self, message: dict[str, Any]) -> None:
        d = self._waiting.pop(message.get("id", -1), None)
        if d is None:
            return  # an event
        if "error" in message:
            d.errback(CDPError(message["error"]))
        else:
            d.callback(message.get("result", {}))

    # -- commands ------------------------------------------------------------

    def call(self, method: str, session: bool = True, **params: Any) -> Deferred[Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session and self.session is not None:
            message["sessionId"] = self.session
        d: Deferred[Any] = Deferred()
        self._waiting[self._next] = d
        assert self.transport is not None
        self.transport.writeToChild(3, json.dumps(message).encode() + b"\0")  # type: ignore[attr-defined]
        return d

    async def open(self, url: str, width: int, height: int) -> None:
        """Attach to the first page target and navigate it to C{url}."""
        targets = await self.call("Target.getTargets", session=False)
        page = next(t for t in targets["targetInfos"] if t["type"] == "page")
        attached = await self.call(
            "Target.attachToTarget",
            session=False,
            targetId=page["targetId"],
            flatten=True,
        )
        self.session = attached["sessionId"]
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise CDPError(result["exceptionDetails"])
        return result["result"].get("value")

    async def screenshot(self, full_page: bool = True) -> bytes:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
            metrics = await self.call("Page.getLayoutMetrics")
            size = metrics["cssContentSize"]
            params["clip"] = {
                "x": 0,
                "y": 0,
                "width": size["width"],
                "height": size["height"],
                "scale": 1,
            }
        shot = await self.call("Page.captureScreenshot", **params)
        return base64.b64decode(shot["data"])

    async def close(self) -> None:
        try:
            await self.call("Browser.close", session=False)
        except CDPError:
            pass
