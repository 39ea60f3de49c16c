"""
A real browser against a facade (spec §5.8), opt in: C{NVPROXY_BROWSER=1}
(C{tox -e browser}) with Debian's C{chromium} (or C{NVPROXY_CHROMIUM}).

A page served from one origin calls a facade on another with C{fetch()}: a
JSON POST with an API key (so a preflight first) and the model list.  The
page posts what it saw back to its own origin; headless Chromium is
stopped once it did.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import SkipTest
from twisted.web.resource import Resource
from twisted.web.server import Site

from nvproxy.config import AccessConfig
from nvproxy.testing.fakecors import CorsPolicy
from nvproxy.testing.harness import facade_url
from tests.test_access import ALL_LOOPBACK, KEY, AccessTestCase

PAGE = """<!doctype html><html><body><script>
async function attempt(what) {
  try { return await what(); } catch (e) { return "blocked"; }
}
async function run() {
  const base = %(base)s, key = %(key)s, out = {};
  out.chat = await attempt(async () => {
    const r = await fetch(base + "/v1/chat/completions", {
      method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + key},
      body: JSON.stringify({model: "m", messages: [{role: "user", content: "hi"}]}),
    });
    return r.status;
  });
  out.nokey = await attempt(async () => (await fetch(base + "/v1/chat/completions", {
    method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: "m", messages: []}),
  })).status);
  out.models = await attempt(async () =>
    (await (await fetch(base + "/v1/models", {
      headers: {"Authorization": "Bearer " + key},
    })).json()).data.map(m => m.id).sort());
  await fetch("/result", {method: "POST", body: JSON.stringify(out)});
}
run();
</script></body></html>
"""


class _Page(Resource):
    isLeaf = True

    def __init__(self, html: bytes) -> None:
        super().__init__()
        self.html = html
        self.result: Deferred[Any] = Deferred()

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"text/html")
        return self.html

    def render_POST(self, request: Any) -> bytes:
        if not self.result.called:
            self.result.callback(json.loads(request.content.read()))
        return b"ok"


class _Browser(ProcessProtocol):
    def __init__(self) -> None:
        self.ended: Deferred[None] = Deferred()

    def processEnded(self, reason: Failure) -> None:
        self.ended.callback(None)


class BrowserTests(AccessTestCase):
    timeout = 120

    def setUp(self) -> None:
        super().setUp()
        if not os.environ.get("NVPROXY_BROWSER"):
            raise SkipTest("opt in with NVPROXY_BROWSER=1 (tox -e browser)")
        self.chromium = os.environ.get("NVPROXY_CHROMIUM") or shutil.which("chromium")
        if self.chromium is None:
            raise SkipTest("no chromium")

    async def visit(self, facade: str) -> Any:
        page = _Page(b"")
        port = reactor.listenTCP(0, Site(page), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        page.html = (
            PAGE % {"base": json.dumps(facade), "key": json.dumps(KEY)}
        ).encode()
        origin = f"http://127.0.0.1:{port.getHost().port}"
        browser = _Browser()
        profile = self.mktemp()
        os.makedirs(profile)
        argv = [
            self.chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-breakpad",
            "--disable-crash-reporter",
            f"--user-data-dir={profile}",
            origin + "/",
        ]
        process = reactor.spawnProcess(browser, argv[0], argv, env=dict(os.environ))

        async def stop() -> None:
            if not browser.ended.called:
                process.signalProcess("TERM")
                await browser.ended

        self.addCleanup(lambda: Deferred.fromCoroutine(stop()))
        page.result.addTimeout(60, reactor)
        return origin, await page.result

    async def test_page_on_another_origin(self) -> None:
        fakes = []
        for models in (["m"], ["n"]):
            fakes.append(await self.engine("openai", models))
        keys = self.keys_file(**{"page": KEY})
        proxy = await self.keyed_proxy(
            {"vllm": fakes[0].url},
            AccessConfig(
                plaintext_from=ALL_LOOPBACK,
                api_keys_file=keys,
                require_key_on_loopback=True,
            ),
            nodes={"node-1": {"vllm": fakes[1].url}},
        )
        url = facade_url(proxy, "vllm")
        for fake in fakes:
            fake.cors = CorsPolicy(headers=("authorization", "content-type"))
        origin, seen = await self.visit(url)
        self.assertEqual(seen, {"chat": 200, "nokey": "blocked", "models": ["m", "n"]})
        # One engine stops allowing the page: the browser is refused both.
        fakes[1].cors = CorsPolicy(origins=("http://elsewhere.example",))
        _, seen = await self.visit(url)
        self.assertEqual(
            seen, {"chat": "blocked", "nokey": "blocked", "models": "blocked"}
        )
