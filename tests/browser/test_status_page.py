"""
The status page in a real browser: headless chromium opens the admin page of
an nvproxy in front of fake engines, and shows the nodes, the models and a
workload that arrives after the page loaded (without a reload).  Also: a
wheel of the project carries the page's files, and an installed copy
serves them.

Opt-in (C{tox -e browser}, or C{NVPROXY_BROWSER=1}); needs C{chromium}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import SkipTest, TestCase

from nvproxy.testing.fakeengine import Behaviour, FakeEngine
from nvproxy.testing.harness import (
    Client,
    eventually,
    facade_url,
    proxy_config,
    start_proxy,
)
from tests.browser.cdp import Chromium

CHROMIUM = os.environ.get("NVPROXY_CHROMIUM") or shutil.which("chromium")
ROOT = Path(__file__).resolve().parents[2]


def _skip() -> None:
    if not os.environ.get("NVPROXY_BROWSER"):
        raise SkipTest("browser suite is opt-in: tox -e browser (NVPROXY_BROWSER=1)")


def chromium_args(profile: str, *extra: str) -> list[str]:
    return [
        CHROMIUM or "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *extra,
    ]


async def _until(
    browser: Chromium, expression: str, what: str, attempts: int = 200
) -> Any:
    """Evaluate C{expression} in the page until it is truthy (bounded)."""
    for _ in range(attempts):
        value = await browser.evaluate(expression)
        if value:
            return value
        await deferLater(reactor, 0.05, lambda: None)
    raise AssertionError(f"{what} did not show within {attempts * 0.05:.0f} s")


class _Browser(TestCase):
    timeout = 90

    def setUp(self) -> None:
        _skip()
        if CHROMIUM is None:
            raise SkipTest("chromium is not installed")
        self.client = Client(reactor)
        self.addCleanup(self.client.close)

    def browser(self) -> Chromium:
        protocol = Chromium()
        argv = chromium_args(
            os.path.abspath(self.mktemp()), "--remote-debugging-pipe", "about:blank"
        )
        process = reactor.spawnProcess(  # type: ignore[attr-defined]
            protocol,
            argv[0],
            argv,
            env=dict(os.environ),
            childFDs={0: "w", 1: "r", 2: "r", 3: "w", 4: "r"},
        )

        async def stop() -> None:
            if not protocol.ended.called:
                await protocol.close()
                kill = reactor.callLater(  # type: ignore[attr-defined]
                    5, process.signalProcess, "KILL"
                )
                await protocol.ended
                if kill.active():
                    kill.cancel()

        self.addCleanup(lambda: Deferred.fromCoroutine(stop()))
        return protocol


class BrowserTests(_Browser):
    async def test_page_shows_fleet_and_updates(self) -> None:
        """
        The page shows this node and its model from the snapshot, then a
        request made after it loaded appears as a workload without a reload;
        a screenshot is saved in the test's directory.
        """
        fake = FakeEngine("openai", ["browser-model"], reactor)  # type: ignore[arg-type]
        await fake.listen(reactor)
        self.addCleanup(fake.stop)
        fake.default = Behaviour(chunks=3)
        proxy = await start_proxy(
            reactor, proxy_config(self.mktemp(), {"lmstudio": fake.url}, admin=True)
        )
        self.addCleanup(proxy.stopService)
        browser = self.browser()
        page = f"http://127.0.0.1:{proxy.admin.bound_port()}/"
        await browser.open(page, 1400, 1000)
        await _until(
            browser,
            "document.querySelector('#nodes [data-node=\"local\"]') !== null",
            "this node",
        )
        await _until(
            browser,
            "document.querySelector('#models [data-model=\"browser-model\"]') !== null",
            "the model",
        )
        self.assertEqual(
            await browser.evaluate(
                "document.querySelectorAll('#workloads tr[data-workload]').length"
            ),
            0,
        )
        self.assertEqual(
            await browser.evaluate("document.getElementById('conn').textContent"),
            "live",
        )
        loads = await browser.evaluate(
            "performance.getEntriesByType('navigation').length"
        )
        code, _h, _b = await self.client.request(
            "POST",
            facade_url(proxy, "lmstudio") + "/v1/chat/completions",
            data=json.dumps({"model": "browser-model", "messages": []}).encode(),
            headers={
                "Content-Type": ["application/json"],
                "X-Request-Id": ["from-the-browser-test"],
            },
        )
        self.assertEqual(code, 200)
        row = await _until(
            browser,
            "(function () {"
            " var r = document.querySelector('#workloads tr[data-workload]');"
            " return r && r.textContent.indexOf('completed') >= 0"
            " ? r.textContent : null; })()",
            "the workload",
        )
        self.assertIn("browser-model", row)
        self.assertIn("from-the-browser-test", row)
        # Updated in place: still the first navigation, and an update arrived.
        self.assertEqual(
            await browser.evaluate("performance.getEntriesByType('navigation').length"),
            loads,
        )
        self.assertGreater(
            int(await browser.evaluate("document.body.dataset.updates || '0'")), 0
        )
        shot = Path(self.mktemp() + ".png").resolve()
        shot.write_bytes(await browser.screenshot())
        self.assertGreater(shot.stat().st_size, 10_000)
        await browser.close()
        await browser.ended
        await eventually(
            reactor,
            lambda: proxy.status_page.feed.clients == 0,
            what="the stream ended with the browser",
        )


class FleetPageTests(_Browser):
    async def test_twenty_nodes_fifty_models(self) -> None:
        """
        With the 20-node, 50-model fixture every node and model is on the
        page, and neither a wide nor a laptop-sized window scrolls
        sideways.
        """
        from nvproxy.testing.fleetstatus import serve

        port = serve(reactor, 0)
        self.addCleanup(port.stopListening)
        for width, height in ((1440, 1000), (1024, 768)):
            browser = self.browser()
            await browser.open(
                f"http://127.0.0.1:{port.getHost().port}/", width, height
            )
            await _until(
                browser, "document.querySelectorAll('.node').length === 20", "nodes"
            )
            self.assertEqual(
                await browser.evaluate(
                    "document.querySelectorAll('#models tr[data-model]').length"
                ),
                50,
            )
            self.assertTrue(
                await browser.evaluate(
                    "document.documentElement.scrollWidth"
                    " <= document.documentElement.clientWidth"
                ),
                f"scrolls sideways at {width} px",
            )
            await browser.close()
            await browser.ended


class WheelTests(TestCase):
    timeout = 120

    def setUp(self) -> None:
        _skip()

    def test_wheel_serves_the_page(self) -> None:
        """
        The wheel holds the page's HTML, CSS and script, and the package
        installed from it (not this checkout) reads them.
        """
        out = Path(self.mktemp()).resolve()
        out.mkdir()
        # Built from a copy: setuptools leaves a build/ directory behind.
        source = out / "source"
        shutil.copytree(
            ROOT,
            source,
            ignore=shutil.ignore_patterns(
                ".git", ".tox", "build", "_trial_temp*", "*.egg-info", "__pycache__"
            ),
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(out),
                str(source),
            ],
            check=True,
            cwd=out,
            capture_output=True,
        )
        [wheel] = out.glob("nvproxy-*.whl")
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            site = out / "site"
            z.extractall(site)
        for name in ("index.html", "status.css", "status.js"):
            self.assertIn(f"nvproxy/statuspage/static/{name}", names)
        script = (
            "import nvproxy, sys\n"
            "from twisted.internet.task import Clock\n"
            "from nvproxy.statuspage import StatusPage\n"
            "page = StatusPage(None, Clock())\n"
            "print(nvproxy.__file__)\n"
            "print(sorted((r, len(b)) for r, (b, _k) in page._assets.items()))\n"
        )
        env = {**os.environ, "PYTHONPATH": str(site)}
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            cwd=out,
            env=env,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr)
        where, sizes = result.stdout.splitlines()
        self.assertTrue(where.startswith(str(site)), where)
        for route in ("/", "/static/status.css", "/static/status.js"):
            self.assertIn(repr(route), sizes)
