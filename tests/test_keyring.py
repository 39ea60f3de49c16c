"""
The API keys file: its parser and a ring that re-reads it on change.
"""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.keyring import (
    KeyFileError,
    KeyRing,
    StoredKey,
    format_keys,
    hash_key,
    new_key,
    parse_keys,
)

KEY_A = "a" * 43
KEY_B = "b" * 43


def line(name: str, key: str) -> str:
    return f"{name} sha256:{hash_key(key).hex()}\n"


class ParseTests(SynchronousTestCase):
    def test_names_hashes_comments(self) -> None:
        text = (
            "# the keys\n\n"
            + line("svc-a", KEY_A)
            + "   \n"
            + line("svc.b@team", KEY_B).rstrip("\n")
            + "   # trailing comment\n"
        )
        keys = parse_keys(text, "keys")
        self.assertEqual(
            keys,
            (
                StoredKey("svc-a", hash_key(KEY_A)),
                StoredKey("svc.b@team", hash_key(KEY_B)),
            ),
        )

    def test_upper_case_hex(self) -> None:
        text = f"a sha256:{hash_key(KEY_A).hex().upper()}\n"
        self.assertEqual(parse_keys(text, "f")[0].digest, hash_key(KEY_A))

    def test_errors_name_the_line_never_its_content(self) -> None:
        cases = {
            "a\n": "f: line 1: expected NAME sha256:HEX",
            line("a", KEY_A) + "b " + KEY_B + "\n": (
                "f: line 2: expected sha256: and 64 hex digits after the name"
                " (the key's hash, never the key)"
            ),
            "\n\n" + line("a", KEY_A) + line("a", KEY_B): "f: line 4: duplicate name a",
            "-x sha256:" + "0" * 64 + "\n": (
                "f: line 1: a name is 1 to 128 letters, digits, '.', '_', '@' or"
                " '-', starting with a letter or digit"
            ),
            "a sha256:00 extra\n": "f: line 1: expected NAME sha256:HEX",
        }
        for text, expected in cases.items():
            with self.assertRaises(KeyFileError) as caught:
                parse_keys(text, "f")
            self.assertEqual(str(caught.exception), expected)
            self.assertNotIn(KEY_B, str(caught.exception))

    def test_new_key(self) -> None:
        key = new_key()
        self.assertGreaterEqual(len(key), 43)  # 256 bits, base64
        self.assertRegex(key, r"^[A-Za-z0-9_-]+$")
        self.assertNotEqual(key, new_key())

    @given(
        st.lists(
            st.tuples(
                st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,20}", fullmatch=True),
                st.binary(min_size=32, max_size=32),
            ),
            max_size=8,
            unique_by=lambda pair: pair[0],
        )
    )
    def test_round_trip(self, pairs: list[tuple[str, bytes]]) -> None:
        keys = tuple(StoredKey(name, digest) for name, digest in pairs)
        self.assertEqual(parse_keys(format_keys(keys), "f"), keys)


class RingTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.path = self.mktemp()
        self.write(line("svc-a", KEY_A))
        self.clock = Clock()
        self.events: list[dict[str, object]] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def write(self, text: str) -> None:
        with open(self.path, "w") as f:
            f.write(text)
        # A distinct mtime even on coarse file systems.
        stamp = os.stat(self.path).st_mtime_ns + 10**9 * (len(text) + 1)
        os.utime(self.path, ns=(stamp, stamp))

    def test_match(self) -> None:
        ring = KeyRing(self.path, self.clock)
        self.assertEqual(ring.match(KEY_A), "svc-a")
        self.assertIsNone(ring.match(KEY_B))
        self.assertIsNone(ring.match(""))

    def test_bad_file_at_start(self) -> None:
        self.write("oops\n")
        with self.assertRaises(KeyFileError):
            KeyRing(self.path, self.clock)
        with self.assertRaises(KeyFileError) as caught:
            KeyRing(self.path + ".missing", self.clock)
        self.assertIn("cannot read", str(caught.exception))

    def test_reread_on_change(self) -> None:
        ring = KeyRing(self.path, self.clock)
        self.write(line("svc-b", KEY_B))
        # Not looked at again within the interval.
        self.assertEqual(ring.match(KEY_A), "svc-a")
        self.clock.advance(1)
        self.assertIsNone(ring.match(KEY_A))
        self.assertEqual(ring.match(KEY_B), "svc-b")
        self.assertEqual(ring.names, ("svc-b",))

    def test_malformed_change_keeps_previous_keys(self) -> None:
        ring = KeyRing(self.path, self.clock)
        self.write(line("svc-b", KEY_B) + "pasted " + KEY_B + "\n")
        self.clock.advance(1)
        self.assertEqual(ring.match(KEY_A), "svc-a")
        self.assertIsNone(ring.match(KEY_B))
        errors = [e for e in self.events if e.get("log_level") == LogLevel.error]
        self.assertEqual(len(errors), 1)
        self.assertIn("line 2", str(errors[0]["error"]))
        self.assertNotIn(KEY_B, repr(self.events))
        # Refused once, not again on every look.
        self.clock.advance(1)
        ring.match(KEY_A)
        self.assertEqual(
            len([e for e in self.events if e.get("log_level") == LogLevel.error]), 1
        )
        # Fixed: taken.
        self.write(line("svc-b", KEY_B))
        self.clock.advance(1)
        self.assertEqual(ring.match(KEY_B), "svc-b")

    def test_removed_file_keeps_keys(self) -> None:
        ring = KeyRing(self.path, self.clock)
        os.remove(self.path)
        self.clock.advance(1)
        self.assertEqual(ring.match(KEY_A), "svc-a")


class KeysCommandTests(SynchronousTestCase):
    """C{nvproxyctl keys add|list|remove}."""

    def setUp(self) -> None:
        self.path = self.mktemp()

    def run_keys(self, *argv: str) -> tuple[int, str, str]:
        import io

        from nvproxy.ctl.keys import keys_command

        out, err = io.StringIO(), io.StringIO()
        code = keys_command([*argv, "--file", self.path], out, err=err, environ={})
        return code, out.getvalue(), err.getvalue()

    def test_add_prints_once_and_stores_the_hash(self) -> None:
        code, out, err = self.run_keys("add", "svc-a")
        self.assertEqual(code, 0)
        key = out.strip()
        self.assertRegex(key, r"^[A-Za-z0-9_-]{43,}$")
        with open(self.path) as f:
            text = f.read()
        self.assertNotIn(key, text)
        self.assertEqual(text, line("svc-a", key))
        self.assertEqual(os.stat(self.path).st_mode & 0o777, 0o600)
        self.assertNotIn(key, err)
        ring = KeyRing(self.path, Clock())
        self.assertEqual(ring.match(key), "svc-a")

    def test_list_and_remove_keep_comments(self) -> None:
        with open(self.path, "w") as f:
            f.write("# keep me\n" + line("a", KEY_A) + line("b", KEY_B))
        self.assertEqual(self.run_keys("list"), (0, "a\nb\n", ""))
        code, _, err = self.run_keys("remove", "a")
        self.assertEqual(code, 0)
        with open(self.path) as f:
            self.assertEqual(f.read(), "# keep me\n" + line("b", KEY_B))
        self.assertEqual(self.run_keys("remove", "a")[0], 1)

    def test_refusals(self) -> None:
        self.assertEqual(self.run_keys("add", "a")[0], 0)
        code, _, err = self.run_keys("add", "a")
        self.assertEqual((code, err), (1, "nvproxyctl keys add: a already has a key\n"))
        self.assertEqual(self.run_keys("add", "no spaces")[0], 2)
        with open(self.path, "a") as f:
            f.write("broken\n")
        code, _, err = self.run_keys("add", "c")
        self.assertEqual(code, 1)
        self.assertIn("line 2: expected NAME sha256:HEX", err)
        self.assertEqual(self.run_keys("list", "--bogus")[0], 2)
