# -*- test-case-name: tests.test_pathnorm -*-
# trial's assertion methods are unannotated:
# mypy: disallow-untyped-calls=False
"""Tests for L{nvproxy.proxy.pathnorm}."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote_to_bytes

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.proxy.pathnorm import (
    CACHED_PATH,
    HIDDEN_VLLM,
    HIDDEN_VLLM_PREFIXES,
    MAX_PATH_BYTES,
    is_hidden,
    match_key,
    normalize_path,
)

_HIDDEN_PATHS = sorted(HIDDEN_VLLM) + [
    p + suffix for p in HIDDEN_VLLM_PREFIXES for suffix in ("", "/x", "/a/b")
]


class NormalizePathTests(SynchronousTestCase):
    def test_examples(self) -> None:
        cases = {
            b"/": "/",
            b"/v1/models": "/v1/models",
            b"/v1/models/": "/v1/models/",
            b"//v1///models": "/v1/models",
            b"/v1/./models": "/v1/models",
            b"/v1/x/../models": "/v1/models",
            b"/../../v1/models": "/v1/models",
            b"/v1/..": "/",
            b"/v1/x/..": "/v1/",
            b"/v1%2Fmodels": "/v1/models",
            b"/v1\\models": "/v1/models",
            b"/v1%5cmodels": "/v1/models",
            b"/V1/Models": "/V1/Models",
            b"/v1/models?x=/../sleep": "/v1/models",
            b"/v1/models#frag": "/v1/models",
            b"http://example.com/v1/models": "/v1/models",
            b"https://example.com": "/",
            b"/caf%C3%A9": "/caf\u00e9",
            b"/%25": "/%",
            b"/%zz": "/%zz",
        }
        for raw, expected in cases.items():
            self.assertEqual(normalize_path(raw), expected, raw)

    def test_invalid(self) -> None:
        for raw in [
            b"",
            b"*",
            b"v1/models",
            b"?x=1",
            b"/a\x00b",
            b"/a%00b",
            b"/a%2500b",
            b"/a%0ab",
            b"/a\tb",
            b"/a%7fb",
            b"/%ff",
            b"/%C3",
            b"/" + b"a" * MAX_PATH_BYTES,
            # still changing after MAX_DECODE_ROUNDS rounds
            b"/%252525252573",
        ]:
            self.assertIsNone(normalize_path(raw), raw)
            self.assertIsNone(match_key(raw), raw)

    def test_decode_rounds(self) -> None:
        """Up to four rounds of encoding are undone, a fifth is invalid."""
        self.assertEqual(normalize_path(b"/%25252573leep"), "/sleep")
        self.assertIsNone(normalize_path(b"/%2525252573leep"))

    def test_match_key(self) -> None:
        cases = {
            b"/": "/",
            b"/SLEEP/": "/sleep",
            b"/v1/Models//": "/v1/models",
            b"/sleep;x=1": "/sleep",
            b"/v1/..;/sleep": "/sleep",
            b"/v1;a/models;b": "/v1/models",
        }
        for raw, expected in cases.items():
            self.assertEqual(match_key(raw), expected, raw)

    def test_long_paths_as_short_ones(self) -> None:
        """
        A path longer than those whose forms are kept is normalized and
        keyed the same way, and asking twice gives the same answer.
        """
        segment = b"/Seg%41;p"
        for repeat in (1, CACHED_PATH // len(segment) + 1):
            raw = segment * repeat + b"/../x/"
            self.assertEqual(normalize_path(raw), "/SegA;p" * (repeat - 1) + "/x/")
            self.assertEqual(match_key(raw), "/sega" * (repeat - 1) + "/x")
            self.assertEqual(normalize_path(raw), normalize_path(bytes(raw)))
        self.assertGreater(len(raw), CACHED_PATH)


class IsHiddenTests(SynchronousTestCase):
    def test_hidden_spellings(self) -> None:
        for raw in [
            b"/sleep",
            b"/v1/../sleep",
            b"/v1%2f..%2fsleep",
            b"/v1%2F..%2Fsleep",
            b"//sleep",
            b"/./sleep",
            b"/SLEEP",
            b"/Sleep/",
            b"/%73leep",
            b"/%2573leep",
            b"/%2e%2e/sleep",
            b"/v1/%2e%2e/sleep",
            b"/v1/%252e%252e/sleep",
            b"/v1\\..\\sleep",
            b"/sleep?level=2",
            b"/sleep;x",
            b"/v1/..;/sleep",
            b"http://evil/sleep",
            b"/wake_up?tags=weights",
            b"/collective_rpc",
            b"/reset_prefix_cache",
            b"/is_sleeping",
            b"/admin",
            b"/ADMIN",
            b"/admin/",
            b"/admin/status",
            b"/Admin/Wake/text",
            b"/v1/admin/health",
            b"/pause/step",
            b"/fault_tolerance/apply",
            b"/v1/load_lora_adapter",
        ]:
            self.assertTrue(is_hidden(raw), raw)

    def test_invalid_is_hidden(self) -> None:
        for raw in [b"", b"*", b"/a%00", b"/%ff", b"/" + b"x" * MAX_PATH_BYTES]:
            self.assertTrue(is_hidden(raw), raw)

    def test_visible(self) -> None:
        for raw in [
            b"/",
            b"/v1/chat/completions",
            b"/v1/completions",
            b"/v1/models",
            b"/v1/embeddings",
            b"/health",
            b"/metrics",
            b"/sleepy",
            b"/v1/sleep",
            b"/sleep/x",
            b"/admins",
            b"/administrator",
            b"/v1/models?path=/sleep",
        ]:
            self.assertFalse(is_hidden(raw), raw)

    def test_custom_lists(self) -> None:
        self.assertTrue(is_hidden(b"/Secret/", frozenset({"/secret"}), ()))
        self.assertFalse(is_hidden(b"/sleep", frozenset({"/secret"}), ()))
        self.assertTrue(is_hidden(b"/ops/x", frozenset(), ("/OPS/",)))
        self.assertFalse(is_hidden(b"/admin", frozenset(), ()))

    def test_root_prefix_hides_all(self) -> None:
        self.assertTrue(is_hidden(b"/v1/models", frozenset(), ("/",)))

    @given(
        st.lists(
            st.sampled_from(["a", "A", "b", "ad", "/", ".", "..", ";p", "%2F", "x"]),
            max_size=6,
        ),
        st.lists(st.sampled_from(["/a", "/A/", "/ab", "/a/b", "/b"]), max_size=3),
    )
    def test_same_as_each_prefix_in_turn(
        self, parts: list[str], prefixes: list[str]
    ) -> None:
        """The one-pass lookup decides as comparing each prefix in turn did."""
        raw = ("/" + "".join(parts)).encode()
        hidden = frozenset({"/ad"})
        key = match_key(raw)
        keys = [match_key(p.encode()) or "" for p in prefixes]
        expected = key is None or (
            key in {"/ad"}
            or any(key == k or key.startswith(k.rstrip("/") + "/") for k in keys)
        )
        self.assertEqual(is_hidden(raw, hidden, tuple(prefixes)), expected)


# ---------------------------------------------------------------- strategies


def _encode_char(draw: st.DrawFn, char: str) -> str:
    """One character as written by a client trying to obfuscate it."""
    how = draw(st.sampled_from(["plain", "swapcase", "pct", "pct-lower", "double"]))
    hexed = f"{ord(char):02X}"
    if how == "swapcase":
        return char.swapcase()
    if how == "pct":
        return "%" + hexed
    if how == "pct-lower":
        return "%" + hexed.lower()
    if how == "double":
        return "%25" + hexed
    return char


def _separator(draw: st.DrawFn) -> str:
    seps = ["/", "//", "/./", "\\", "%2f", "%2F", "%5c", "%252f", "/%2e/"]
    return draw(st.sampled_from(seps))


@st.composite
def _disguised_hidden(draw: st.DrawFn) -> bytes:
    """A hidden path with random encodings, case, dot segments and slashes."""
    target = draw(st.sampled_from(_HIDDEN_PATHS))
    out: list[str] = []
    # A detour that a '..' undoes: /v1/chat/../../sleep
    detour = draw(
        st.lists(st.sampled_from(["v1", "x", "chat", "%2e%2e%2e"]), max_size=3)
    )
    for segment in detour:
        out.append(_separator(draw) + segment)
    for _ in detour:
        dots = draw(st.sampled_from(["..", "%2e%2e", "%2E.", "%252e%252e"]))
        out.append(_separator(draw) + dots)
    for segment in target.strip("/").split("/"):
        if draw(st.booleans()):
            out.append(_separator(draw) + ".")
        out.append(_separator(draw))
        out.append("".join(_encode_char(draw, c) for c in segment))
    out.append(draw(st.sampled_from(["", "/", "//", "?level=2", "/?x=1", ";p"])))
    path = "".join(out)
    if not path.startswith("/"):
        path = "/" + path
    return path.encode("ascii")


_PATH_ALPHABET = [*"/\\.%;?#aAsSlLeEpP_-019fF", "%2f", "%2e", "%25", "%00"]


@st.composite
def _arbitrary_path(draw: st.DrawFn) -> bytes:
    """Paths built from the characters that matter, plus a few hidden words."""
    tokens = st.one_of(
        st.sampled_from(_PATH_ALPHABET),
        st.sampled_from(["sleep", "SLEEP", "admin", "v1", "..", "wake_up"]),
        st.binary(min_size=1, max_size=3),
    )
    parts = draw(st.lists(tokens, max_size=20))
    raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in parts)
    return b"/" + raw


def _server_readings(raw: bytes) -> list[str]:
    """
    Paths a few plausible upstream servers might route ``raw`` to.

    Raw, decoded once (Starlette/uvicorn), decoded once then dot-resolved
    (nginx-like merge_slashes + normalization), decoded twice then resolved.
    """
    path = raw.split(b"?", 1)[0].split(b"#", 1)[0]
    readings: list[str] = []
    current = path
    for _ in range(3):
        text = current.decode("utf-8", "replace")
        readings.append(text)
        readings.append(posixpath.normpath("/" + text.replace("\\", "/")))
        current = unquote_to_bytes(current)
    return readings


def _is_hidden_text(path: str) -> bool:
    key = path.casefold().rstrip("/") or "/"
    return key in {p.casefold() for p in HIDDEN_VLLM} or any(
        key == p or key.startswith(p + "/") for p in HIDDEN_VLLM_PREFIXES
    )


class PropertyTests(SynchronousTestCase):
    @settings(deadline=None, max_examples=500)
    @given(_disguised_hidden())
    def test_disguised_hidden_paths_are_hidden(self, raw: bytes) -> None:
        self.assertTrue(is_hidden(raw), raw)

    @settings(deadline=None, max_examples=500)
    @given(_arbitrary_path())
    def test_nothing_normalizing_to_hidden_gets_through(self, raw: bytes) -> None:
        normalized = normalize_path(raw)
        if normalized is None or _is_hidden_text(normalized):
            self.assertTrue(is_hidden(raw), raw)

    @settings(deadline=None, max_examples=500)
    @given(st.one_of(_arbitrary_path(), _disguised_hidden()))
    def test_no_server_reading_reaches_hidden(self, raw: bytes) -> None:
        """
        If any plausible server reading of the path is a hidden endpoint,
        the path is hidden.
        """
        if any(_is_hidden_text(r) for r in _server_readings(raw)):
            self.assertTrue(is_hidden(raw), raw)

    @settings(deadline=None, max_examples=500)
    @given(st.one_of(_arbitrary_path(), _disguised_hidden(), st.binary()))
    def test_idempotent(self, raw: bytes) -> None:
        normalized = normalize_path(raw)
        if normalized is not None:
            self.assertEqual(normalize_path(normalized.encode()), normalized)
            self.assertEqual(match_key(normalized.encode()), match_key(raw))
        key = match_key(raw)
        if key is not None:
            self.assertEqual(match_key(key.encode()), key)
            self.assertEqual(is_hidden(key.encode()), is_hidden(raw))
