"""
Tests for L{nvproxy.proxy.bodies}: finding the model without holding the body.
"""

from __future__ import annotations

import io
import json
import tempfile
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.config import ConfigError, load_config
from nvproxy.proxy import bodies
from nvproxy.proxy.bodies import (
    BadBody,
    media_type,
    model_from_json,
    model_from_multipart,
    with_model,
)
from nvproxy.testing.harness import facade_url
from tests.test_forwarding import ProxyTestCase


def multipart(boundary: str, parts: list[tuple[str, str | None, bytes]]) -> bytes:
    out = b""
    for name, filename, value in parts:
        out += b"--" + boundary.encode() + b"\r\n"
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"Content-Disposition: {disposition}\r\n".encode()
        if filename is not None:
            out += b"Content-Type: application/octet-stream\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + b"--" + boundary.encode() + b"--\r\n"


class TrackingFile(io.BytesIO):
    """
    A file that remembers the largest single read, to prove the scan reads in
    bounded blocks.
    """

    largest = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.largest = max(self.largest, len(data))
        return data


class JsonTests(SynchronousTestCase):
    def test_model(self) -> None:
        body = io.BytesIO(b'{"model": "llama3", "prompt": "secret"}')
        self.assertEqual(model_from_json(body), "llama3")
        self.assertEqual(body.tell(), 0)

    def test_absent(self) -> None:
        self.assertIsNone(model_from_json(io.BytesIO(b'{"prompt": "x"}')))

    def test_malformed(self) -> None:
        with self.assertRaises(BadBody) as caught:
            model_from_json(io.BytesIO(b'{"model": "llama3", "prompt": "sec'))
        message = str(caught.exception)
        self.assertIn("not valid JSON", message)
        self.assertNotIn("sec", message.split(":", 1)[0])

    def test_not_object(self) -> None:
        with self.assertRaises(BadBody):
            model_from_json(io.BytesIO(b'["model"]'))

    def test_model_not_string(self) -> None:
        with self.assertRaises(BadBody):
            model_from_json(io.BytesIO(b'{"model": 3}'))


def reference(raw: bytes) -> Any:
    """
    What the model of a JSON body is, by decoding it whole: C{"<bad>"} for a
    body that must be refused.
    """
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return "<bad>"
    if not isinstance(body, dict):
        return "<bad>"
    model = body.get("model")
    if model is None:
        return None
    return model if isinstance(model, str) else "<bad>"


def scanned(raw: bytes, block: int = bodies.BLOCK, fast: bool = False) -> Any:
    """
    L{model_from_json}'s answer, by the block scan (C{fast}: as the daemon
    runs it, a small body decoded by C{json.loads} first), C{"<bad>"} for a
    refusal.
    """
    old, limit = bodies.BLOCK, bodies.FAST_LIMIT
    bodies.BLOCK = block
    bodies.FAST_LIMIT = limit if fast else -1
    try:
        return model_from_json(io.BytesIO(raw))
    except BadBody:
        return "<bad>"
    finally:
        bodies.BLOCK, bodies.FAST_LIMIT = old, limit


def outcome(raw: bytes, fast: bool) -> tuple[str, Any]:
    """The model, or the refusal's exact message."""
    limit = bodies.FAST_LIMIT
    bodies.FAST_LIMIT = limit if fast else -1
    try:
        return ("model", model_from_json(io.BytesIO(raw)))
    except BadBody as e:
        return ("refused", str(e))
    finally:
        bodies.FAST_LIMIT = limit


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["model", "mode", "a", "\u00e9"]) | st.text(max_size=8),
            children,
            max_size=4,
        )
    ),
    max_leaves=20,
)
top_members = st.lists(
    st.tuples(
        st.sampled_from(["model", "messages", "x"]) | st.text(max_size=8),
        st.one_of(json_values, st.text(max_size=20)),
    ),
    max_size=6,
)


def render(members: list[tuple[str, Any]], ascii: bool, spaced: bool) -> bytes:
    """
    A JSON object with these members in order, duplicates kept.
    """
    sep = ", " if spaced else ","
    colon = " : " if spaced else ":"
    parts = [
        json.dumps(k, ensure_ascii=ascii)
        + colon
        + json.dumps(v, ensure_ascii=ascii, indent=1 if spaced else None)
        for k, v in members
    ]
    return ("{" + sep.join(parts) + "}").encode("utf-8", "surrogatepass")


@st.composite
def mutated(draw: Any, min_edits: int) -> bytes:
    """
    A JSON document (any value, or an object rendered with duplicate keys)
    with up to three runs of bytes inserted or replaced.
    """
    document = draw(
        st.one_of(json_values, top_members.map(lambda m: render(m, False, True)))
    )
    edits = draw(
        st.lists(
            st.tuples(st.integers(0, 1 << 16), st.binary(max_size=2), st.booleans()),
            min_size=min_edits,
            max_size=3,
        )
    )
    raw = document if isinstance(document, bytes) else json.dumps(document).encode()
    for at, data, replace in edits:
        at = at % (len(raw) + 1)
        raw = raw[:at] + data + raw[at + (len(data) if replace else 0) :]
    return bytes(raw)


class JsonScanTests(SynchronousTestCase):
    """
    The streaming scan agrees with decoding the body whole, never recurses
    and never holds more than a block of it.
    """

    def test_duplicates_last_wins(self) -> None:
        self.assertEqual(scanned(b'{"model": "a", "model": "b"}'), "b")
        self.assertEqual(scanned(b'{"model": 3, "model": "b"}'), "b")
        self.assertIsNone(scanned(b'{"model": "a", "model": null}'))
        self.assertEqual(scanned(b'{"model": "a", "model": [1]}'), "<bad>")

    def test_only_top_level(self) -> None:
        self.assertIsNone(scanned(b'{"a": {"model": "x"}, "b": [{"model": 1}]}'))
        self.assertEqual(scanned(b'{"model": {"model": "x"}}'), "<bad>")
        self.assertIsNone(scanned(b'{"model": null}'))

    def test_escapes(self) -> None:
        self.assertEqual(scanned(b'{"mod\\u0065l": "\\u00e9\\"x\\\\"}'), '\u00e9"x\\')
        self.assertEqual(scanned(b'{"m": "\\"model\\"", "model": "y"}'), "y")
        self.assertEqual(scanned(b'{"model": "\\ud800"}'), "\ud800")

    def test_encodings(self) -> None:
        """
        UTF-8 with a BOM, UTF-16 and UTF-32 are read as C{json.loads} reads
        bytes; invalid UTF-8 anywhere is refused.
        """
        text = '{"model": "caf\u00e9"}'
        for raw in [
            b"\xef\xbb\xbf" + text.encode(),
            text.encode("utf-16"),
            text.encode("utf-16-le"),
            text.encode("utf-32-be"),
        ]:
            self.assertEqual(scanned(raw), "caf\u00e9", raw)
        self.assertEqual(scanned(b'{"model": "m", "x": "\xff"}'), "<bad>")
        with self.assertRaises(BadBody) as caught:
            model_from_json(io.BytesIO(b'{"a" 1, "x": "\xff"}'))
        self.assertIn("UnicodeDecodeError", str(caught.exception))

    def test_error_position(self) -> None:
        with self.assertRaises(BadBody) as caught:
            model_from_json(io.BytesIO('{\n "\u00e9": tru}'.encode()))
        self.assertEqual(
            str(caught.exception),
            "request body is not valid JSON: Expecting value at line 2 column 7",
        )

    def test_deep_nesting_refused(self) -> None:
        """
        100,000 levels are refused with BadBody (no RecursionError); up to
        L{bodies.MAX_DEPTH} levels are scanned.
        """
        for opener in [b"[", b'{"a":']:
            with self.assertRaises(BadBody) as caught:
                model_from_json(io.BytesIO(b'{"x":' + opener * 100_000))
            self.assertIn("deeper than", str(caught.exception))
        depth = bodies.MAX_DEPTH - 1
        body = b'{"model": "m", "x": ' + b"[" * depth + b"]" * depth + b"}"
        self.assertEqual(scanned(body), "m")
        self.assertEqual(scanned(body[:-2] + b"}"), "<bad>")

    def test_model_too_long(self) -> None:
        long = "m" * (bodies.MAX_FIELD + 1)
        self.assertEqual(scanned(json.dumps({"model": long}).encode()), "<bad>")
        self.assertEqual(scanned(json.dumps({"model": long[1:]}).encode()), long[1:])

    def test_large_body_read_in_blocks(self) -> None:
        """
        A body of 4 MiB of base64 and many small items is read a block at a
        time; the position is left at the start.
        """
        body = (
            b'{"images": ["'
            + b"QUJD" * (1 << 20)
            + b'"], "n": ['
            + b"1, " * 100_000
            + b'{"a": [true]}], "model": "m"}'
        )
        f = TrackingFile(body)
        self.assertEqual(model_from_json(f), "m")
        self.assertLessEqual(f.largest, bodies.BLOCK)
        self.assertEqual(f.tell(), 0)

    @settings(max_examples=300)
    @given(top_members, st.booleans(), st.booleans(), st.integers(1, 64))
    def test_agrees_with_json(
        self,
        members: list[tuple[str, Any]],
        ascii: bool,
        spaced: bool,
        block: int,
    ) -> None:
        """
        For any JSON object (duplicate keys, nested containers, escapes,
        NaN), at any block size, the scan finds what C{json.loads} finds.
        """
        raw = render(members, ascii, spaced)
        self.assertEqual(scanned(raw, block), reference(raw))

    @settings(max_examples=300)
    @given(mutated(min_edits=1), st.integers(1, 16))
    def test_mutated_agrees_with_json(self, raw: bytes, block: int) -> None:
        """
        A JSON document with a few bytes inserted or replaced is accepted or
        refused exactly as C{json.loads} accepts or refuses it.
        """
        self.assertEqual(scanned(raw, block), reference(raw))

    @given(st.binary(max_size=200), st.integers(1, 16))
    def test_random_bytes_only_badbody(self, raw: bytes, block: int) -> None:
        self.assertEqual(scanned(raw, block), reference(raw))


class FastPathTests(SynchronousTestCase):
    """
    A small body decoded by C{json.loads} gets exactly the answer, or the
    refusal with exactly the message, the block scan gives.
    """

    @settings(max_examples=300)
    @given(mutated(min_edits=0))
    def test_same_as_scan(self, raw: bytes) -> None:
        self.assertEqual(outcome(raw, fast=True), outcome(raw, fast=False))

    @given(st.binary(max_size=200))
    def test_random_bytes(self, raw: bytes) -> None:
        self.assertEqual(outcome(raw, fast=True), outcome(raw, fast=False))

    def test_near_the_scans_limits(self) -> None:
        """Nesting, number length and model length at and past each limit."""
        depth = bodies.MAX_DEPTH
        long_model = '"' + "m" * bodies.MAX_FIELD + '"'
        cases = [
            b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}",
            b'{"x":' + b"[" * depth + b"]" * depth + b"}",
            b'{"x": 1.' + b"5" * (bodies.MAX_NUMBER + 10) + b"}",
            b'{"x": 1' + b"0" * bodies.MAX_NUMBER + b"}",
            ('{"model": ' + long_model + "}").encode(),
            ('{"model": ' + long_model + ', "model": "short"}').encode(),
            b'{"model": "\u006dodel", "\u006dodel": "m2"}',
            b"\xef\xbb\xbf" + b'{"model": "bom"}',
            '{"model": "wide"}'.encode("utf-16"),
            b'{"model": "\ud800"}',
            b'{"model": NaN}',
            b"[]",
            b'{"model": null}',
        ]
        for raw in cases:
            fast, scan = outcome(raw, fast=True), outcome(raw, fast=False)
            self.assertEqual(fast, scan, raw[:40])


class WithModelTests(SynchronousTestCase):
    """
    L{with_model} rewrites the top-level model without decoding the body.
    """

    def rewrite(self, raw: bytes, model: str = "Served") -> bytes:
        out = with_model(io.BytesIO(raw), model)
        self.assertIsInstance(out, io.BytesIO)
        return out.read()

    def test_replaces(self) -> None:
        raw = b'{"model": "alias", "messages": [{"model": "inner"}], "n": 1.50}'
        self.assertEqual(
            self.rewrite(raw),
            b'{"model": "Served", "messages": [{"model": "inner"}], "n": 1.50}',
        )
        self.assertEqual(
            self.rewrite(b'{"model":"a","x":1,"model":null}', "\u00e9"),
            b'{"model":"\\u00e9","x":1,"model":"\\u00e9"}',
        )

    def test_inserts(self) -> None:
        self.assertEqual(self.rewrite(b" {}"), b' {"model": "Served"}')
        self.assertEqual(
            self.rewrite(b'{"prompt": "x"}'), b'{"model": "Served", "prompt": "x"}'
        )

    def test_refuses_what_the_scan_refuses(self) -> None:
        for raw in [b"[1]", b'{"model": "a"', b'{"x":' + b"[" * 100_000]:
            with self.assertRaises(BadBody):
                with_model(io.BytesIO(raw), "m")

    def test_file_body_gets_a_file(self) -> None:
        """
        A spooled body (a real file) is rewritten into a temporary file read
        and written a block at a time, never as one string.
        """
        body = b'{"model": "a", "image": "' + b"x" * 300_000 + b'"}'
        with tempfile.TemporaryFile() as content:
            content.write(body)
            out = with_model(content, "B")
            self.assertEqual(content.tell(), 0)
        self.assertNotIsInstance(out, io.BytesIO)
        out.fileno()
        self.assertEqual(json.loads(out.read()), {"model": "B", "image": "x" * 300_000})

    @given(top_members, st.text(max_size=10))
    def test_agrees_with_json(self, members: list[tuple[str, Any]], model: str) -> None:
        raw = render(members, True, False)
        try:
            expected = json.loads(raw)
        except ValueError:
            return
        expected["model"] = model
        self.assertEqual(
            json.loads(with_model(io.BytesIO(raw), model).read()), expected
        )


class MultipartTests(SynchronousTestCase):
    def test_model_field(self) -> None:
        body = multipart(
            "xyz",
            [("file", "a.wav", b"\x00" * 1000), ("model", None, b"whisper-1")],
        )
        self.assertEqual(model_from_multipart(io.BytesIO(body), "xyz"), "whisper-1")

    def test_no_model(self) -> None:
        body = multipart("b", [("file", "a.wav", b"data")])
        self.assertIsNone(model_from_multipart(io.BytesIO(body), "b"))

    def test_file_named_model_is_not_the_field(self) -> None:
        body = multipart(
            "b", [("model", "model.bin", b"weights"), ("model", None, b"real")]
        )
        self.assertEqual(model_from_multipart(io.BytesIO(body), "b"), "real")

    def test_large_file_read_in_blocks(self) -> None:
        """
        A 5 MiB file part is scanned block by block, never read at once.
        """
        payload = b"--notquite\r\n" * 400_000
        body = multipart("bound", [("file", "big.bin", payload), ("model", None, b"m")])
        f = TrackingFile(body)
        self.assertEqual(model_from_multipart(f, "bound"), "m")
        self.assertLessEqual(f.largest, bodies.BLOCK)
        self.assertEqual(f.tell(), 0)

    def test_truncated(self) -> None:
        body = multipart("b", [("file", "a", b"x" * 100)])[:60]
        with self.assertRaises(BadBody):
            model_from_multipart(io.BytesIO(body), "b")

    def test_no_boundary(self) -> None:
        with self.assertRaises(BadBody):
            model_from_multipart(io.BytesIO(b"whatever"), "")

    def test_field_too_long(self) -> None:
        body = multipart("b", [("model", None, b"m" * 10_000)])
        with self.assertRaises(BadBody):
            model_from_multipart(io.BytesIO(body), "b")

    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["file", "purpose", "language", "model"]),
                st.one_of(st.none(), st.just("f.bin")),
                st.binary(max_size=300),
            ),
            max_size=5,
        ),
        st.integers(min_value=1, max_value=64),
    )
    def test_matches_reference(
        self, parts: list[tuple[str, str | None, bytes]], block: int
    ) -> None:
        """
        For any parts and any block size, the scan finds the first C{model}
        field that is not a file, or nothing.
        """
        boundary = "----b0undary7MA4YWxkTrZu0gW"
        parts = [(n, f, v.replace(b"----b0undary", b"")) for (n, f, v) in parts]
        body = multipart(boundary, parts)
        expected = None
        for name, filename, value in parts:
            if name == "model" and filename is None:
                try:
                    expected = value.decode("utf-8").strip()
                except UnicodeDecodeError:
                    expected = "<bad>"
                break
        old = bodies.BLOCK
        bodies.BLOCK = block
        try:
            try:
                found: str | None = model_from_multipart(io.BytesIO(body), boundary)
            except BadBody:
                found = "<bad>"
        finally:
            bodies.BLOCK = old
        self.assertEqual(found, expected)


class MediaTypeTests(SynchronousTestCase):
    def test_params(self) -> None:
        self.assertEqual(
            media_type(b'Multipart/Form-Data; boundary="a b"; charset=utf-8'),
            ("multipart/form-data", {"boundary": "a b", "charset": "utf-8"}),
        )
        self.assertEqual(media_type(None), ("", {}))

    def test_json_roundtrip(self) -> None:
        self.assertEqual(json.loads(b"{}"), {})


class HostileJsonTests(ProxyTestCase):
    """
    Deeply nested JSON on the facades and the admin API is a client error:
    400 in the listener's dialect, nothing logged as a failure, and the next
    request is served.
    """

    deep = b'{"model": "m", "x": ' + b"[" * 100_000

    def failures(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []

        def observe(event: dict[str, Any]) -> None:
            if "log_failure" in event or event.get("log_level") in (
                LogLevel.error,
                LogLevel.critical,
            ):
                events.append(event)

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        return events

    async def test_facades(self) -> None:
        failures = self.failures()
        for engine, dialect, path, model in [
            ("ollama", "ollama", "/api/chat", "m:latest"),
            ("lmstudio", "openai", "/v1/chat/completions", "m"),
            ("vllm", "openai", "/v1/chat/completions", "m"),
        ]:
            fake = await self.engine(dialect, [model])
            proxy = await self.proxy({engine: fake.url})
            url = facade_url(proxy, engine) + path
            code, _, body = await self.client.request(
                "POST",
                url,
                data=self.deep,
                headers={"Content-Type": ["application/json"]},
            )
            self.assertEqual(code, 400, body)
            error = json.loads(body)["error"]
            message = error if dialect == "ollama" else error["message"]
            self.assertIn("deeper than", message)
            if dialect == "openai":
                self.assertEqual(error["type"], "invalid_request_error")
            code, _, body = await self.post(
                url, {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            )
            self.assertEqual(code, 200, body)
        self.assertEqual(failures, [])

    async def test_admin(self) -> None:
        failures = self.failures()
        fake = await self.engine("ollama", ["m:latest"])
        proxy = await self.proxy({"ollama": fake.url}, admin=True)
        admin = f"http://127.0.0.1:{proxy.admin.bound_port()}"
        for route in ["/admin/engines/ollama/port", "/admin/engines/ollama/select"]:
            code, _, body = await self.client.request(
                "PUT", admin + route, data=b'{"port": ' + b"[" * 100_000
            )
            self.assertEqual(
                (code, json.loads(body)),
                (400, {"error": "request body is not valid JSON"}),
            )
        code, _, body = await self.client.request("GET", admin + "/admin/status")
        self.assertEqual(code, 200)
        self.assertEqual(failures, [])


class DeepTomlTests(SynchronousTestCase):
    def test_one_line_error(self) -> None:
        """
        A config file nested too deeply for the TOML reader is a one-line
        config error, not a crash.
        """
        for nested in ["[" * 100_000, "{a = " * 100_000]:
            path = self.mktemp()
            with open(path, "w") as f:
                f.write('node_id = "a"\nx = ' + nested + "\n")
            with self.assertRaises(ConfigError) as raised:
                load_config(path, {}, {})
            self.assertEqual(
                str(raised.exception),
                f"config file {path}: invalid TOML: nested too deeply",
            )
