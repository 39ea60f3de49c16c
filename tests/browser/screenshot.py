"""
Save a screenshot of the status page of the 20-node, 50-model fleet
fixture (the one in README.rst)::

    python -m tests.browser.screenshot docs/images/status-page.png [WIDTH HEIGHT]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater, react

from nvproxy.testing.fleetstatus import serve
from tests.browser.cdp import Chromium
from tests.browser.test_status_page import CHROMIUM, chromium_args


async def shoot(reactor: Any, out: str, width: int, height: int) -> None:
    port = serve(reactor, 0)
    profile = tempfile.mkdtemp()
    browser = Chromium()
    argv = chromium_args(profile, "--remote-debugging-pipe", "about:blank")
    argv[0] = CHROMIUM or "chromium"
    reactor.spawnProcess(
        browser,
        argv[0],
        argv,
        env=dict(os.environ),
        childFDs={0: "w", 1: "r", 2: "r", 3: "w", 4: "r"},
    )
    try:
        await browser.open(f"http://127.0.0.1:{port.getHost().port}/", width, height)
        for _ in range(100):
            if await browser.evaluate("document.querySelectorAll('.node').length"):
                break
            await deferLater(reactor, 0.05, lambda: None)
        # Let the fleet move on once, so the page shows an update too.
        await deferLater(reactor, 2.5, lambda: None)
        with open(out, "wb") as f:
            f.write(await browser.screenshot(full_page=False))
    finally:
        await browser.close()
        await browser.ended
        shutil.rmtree(profile, ignore_errors=True)
        await port.stopListening()


def main() -> None:
    out = sys.argv[1]
    width, height = (
        (int(v) for v in sys.argv[2:4]) if len(sys.argv) > 3 else (1440, 1800)
    )
    react(lambda reactor: Deferred.fromCoroutine(shoot(reactor, out, width, height)))


if __name__ == "__main__":
    main()
