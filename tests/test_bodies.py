"""
Tests for L{nvproxy.proxy.bodies}: finding the model without holding the body.
"""

from __future__ import annotations

import io
import json

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.proxy import bodies
from nvproxy.proxy.bodies import (
    BadBody,
    media_type,
    model_from_json,
    model_from_multipart,
)


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
