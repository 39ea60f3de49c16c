# -*- test-case-name: tests.test_inferstats -*-
"""Tests for nvproxy.inferstats."""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

from attrs import evolve
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from nvproxy.inferstats import HEAD_BYTES, Dialect, Stats, StatsMeter, _loads
from nvproxy.testing import _fakedialects as dialects


def sse(*events: dict[str, Any] | str) -> bytes:
    out = b""
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        out += b"data: " + data.encode() + b"\n\n"
    return out


def ndjson(*records: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def openai_chunk(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}],
    }


USAGE = {"prompt_tokens": 12, "completion_tokens": 340, "total_tokens": 352}
TOKENS = [openai_chunk(f"tok{i} data: ") for i in range(20)]
OPENAI_SSE_USAGE = sse(
    *TOKENS,
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": USAGE},
    "[DONE]",
)
OPENAI_SSE_NO_USAGE = sse(*TOKENS, "[DONE]")
ROLE_ONLY = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "choices": [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": None},
            "finish_reason": None,
        }
    ],
}
FINISHING = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
}
# llama.cpp's shape: a role-only opening chunk and a finishing chunk, neither of
# which is a token.
OPENAI_SSE_FRAMED_NO_USAGE = sse(ROLE_ONLY, *TOKENS, FINISHING, "[DONE]")
# vLLM opens with an empty content instead of null.
OPENAI_SSE_EMPTY_ROLE_NO_USAGE = sse(
    {
        **ROLE_ONLY,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    },
    *TOKENS,
    {
        **FINISHING,
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}],
    },
    "[DONE]",
)
# Ollama's OpenAI route names the role in every chunk, the first with a token.
OPENAI_SSE_ROLE_EVERYWHERE_NO_USAGE = sse(
    *[
        {
            **t,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", **t["choices"][0]["delta"]}}
            ],
        }
        for t in TOKENS
    ],
    {
        **FINISHING,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": "stop",
            }
        ],
    },
    "[DONE]",
)
OPENAI_JSON = json.dumps(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"content": "hello"}}],
        "usage": USAGE,
    }
).encode()

OLLAMA_FINAL = {
    "model": "llama3:latest",
    "response": "",
    "done": True,
    "done_reason": "stop",
    "prompt_eval_count": 12,
    "eval_count": 340,
    "eval_duration": 8_037_825_000,
}
OLLAMA_TOKENS = [
    {"model": "llama3:latest", "response": f"t{i}\n", "done": False} for i in range(30)
]
OLLAMA_STREAM = ndjson(*OLLAMA_TOKENS, OLLAMA_FINAL)
OLLAMA_JSON = json.dumps({**OLLAMA_FINAL, "response": "Hello there"}).encode()

LLAMACPP_FINAL = {
    "content": "",
    "stop": True,
    "tokens_predicted": 340,
    "tokens_evaluated": 12,
    "timings": {"prompt_n": 12, "predicted_n": 340, "predicted_per_second": 42.3},
}
LLAMACPP_STREAM = sse(
    *[{"content": f"t{i}", "stop": False} for i in range(25)], LLAMACPP_FINAL
)
LLAMACPP_JSON = json.dumps({**LLAMACPP_FINAL, "content": "Hello"}).encode()
LLAMACPP_STREAM_NO_USAGE = sse(
    *[{"content": f"t{i}", "stop": False} for i in range(25)],
    {"content": "", "stop": True, "stop_type": "eos"},
)

REPORTED = Stats(12, 340, None, 0, False)
OLLAMA_STATS = Stats(12, 340, 340 / 8.037825, 0, False)
LLAMACPP_STATS = Stats(12, 340, 42.3, 0, False)

CASES: dict[str, tuple[Dialect, bytes, Stats]] = {
    "openai-sse-usage": ("openai", OPENAI_SSE_USAGE, REPORTED),
    "openai-sse-no-usage": (
        "openai",
        OPENAI_SSE_NO_USAGE,
        Stats(None, 20, None, 0, True),
    ),
    "openai-sse-framed-no-usage": (
        "llamacpp",
        OPENAI_SSE_FRAMED_NO_USAGE,
        Stats(None, 20, None, 0, True),
    ),
    "openai-sse-empty-role-no-usage": (
        "openai",
        OPENAI_SSE_EMPTY_ROLE_NO_USAGE,
        Stats(None, 20, None, 0, True),
    ),
    "openai-sse-role-everywhere-no-usage": (
        "ollama",
        OPENAI_SSE_ROLE_EVERYWHERE_NO_USAGE,
        Stats(None, 20, None, 0, True),
    ),
    "openai-json": ("openai", OPENAI_JSON, REPORTED),
    "ollama-stream": ("ollama", OLLAMA_STREAM, OLLAMA_STATS),
    "ollama-json": ("ollama", OLLAMA_JSON, OLLAMA_STATS),
    "llamacpp-stream": ("llamacpp", LLAMACPP_STREAM, LLAMACPP_STATS),
    "llamacpp-json": ("llamacpp", LLAMACPP_JSON, LLAMACPP_STATS),
    "llamacpp-stream-no-usage": (
        "llamacpp",
        LLAMACPP_STREAM_NO_USAGE,
        Stats(None, 25, None, 0, True),
    ),
}


def measure(
    dialect: Dialect,
    chunks: list[bytes],
    tail_bytes: int = 8192,
    clock: Clock | None = None,
) -> Stats | None:
    meter = StatsMeter(clock or Clock(), dialect, tail_bytes=tail_bytes)
    meter.started()
    for chunk in chunks:
        meter.feed(chunk)
        assert meter.window <= tail_bytes
    return meter.finish()


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(body), *(min(c, len(body)) for c in cuts)})
    return [body[a:b] for a, b in itertools.pairwise(points)]


class StatsTests(SynchronousTestCase):
    def test_to_json_omits_none(self) -> None:
        self.assertEqual(Stats().to_json(), {})
        self.assertEqual(
            Stats(12, 340, 42.2999, 812).to_json(),
            {
                "promptTokens": 12,
                "completionTokens": 340,
                "tokensPerSecond": 42.3,
                "ttftMs": 812,
            },
        )
        self.assertEqual(
            Stats(None, 5, None, None, True).to_json(),
            {"completionTokens": 5, "estimated": True},
        )


class StatsMeterTests(SynchronousTestCase):
    def test_cases_whole(self) -> None:
        for name, (dialect, body, expected) in CASES.items():
            self.assertEqual(measure(dialect, [body]), expected, name)

    @given(
        case=st.sampled_from(sorted(CASES)),
        cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=40),
        byte_at_a_time=st.booleans(),
    )
    @settings(deadline=None, max_examples=300)
    def test_any_split_same_stats(
        self, case: str, cuts: list[int], byte_at_a_time: bool
    ) -> None:
        """The result does not depend on where the body is split into chunks."""
        dialect, body, expected = CASES[case]
        chunks = (
            [body[i : i + 1] for i in range(len(body))]
            if byte_at_a_time
            else split(body, cuts)
        )
        self.assertEqual(measure(dialect, chunks), expected)

    @given(
        case=st.sampled_from(sorted(CASES)),
        cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=40),
    )
    @settings(deadline=None, max_examples=300)
    def test_any_split_small_window(self, case: str, cuts: list[int]) -> None:
        """
        With a window much smaller than the body, the result is still
        independent of the split, and reported counts are still found.
        """
        dialect, body, expected = CASES[case]
        reference = measure(dialect, [body], tail_bytes=400)
        self.assertEqual(measure(dialect, split(body, cuts), tail_bytes=400), reference)
        assert reference is not None
        if expected.estimated:
            # The finishing chunk is within 400 bytes of the end, the role-only
            # one within the head: the estimate does not need the big window.
            self.assertEqual(reference, expected)
        else:
            self.assertEqual(reference.completionTokens, 340)

    def test_large_nonstreaming_body(self) -> None:
        """
        A non-streaming answer larger than the window still reports its usage,
        read from the end of the document.
        """
        body = json.dumps(
            {
                "choices": [{"message": {"content": 'say "usage": {"x": 1} ' * 2000}}],
                "usage": USAGE,
            }
        ).encode()
        self.assertEqual(measure("openai", split(body, [4000, 9000])), REPORTED)
        big = json.dumps({**OLLAMA_FINAL, "response": "x" * 50_000}).encode()
        self.assertEqual(measure("ollama", [big]), OLLAMA_STATS)

    def test_llamacpp_final_event_larger_than_window(self) -> None:
        """
        llama.cpp's final event repeats the prompt; when it outgrows the window
        the counts come from its tail keys.
        """
        # llama.cpp writes "prompt" before "timings" (and tokens_* before both).
        final = {
            "content": "",
            "stop": True,
            "tokens_predicted": 340,
            "tokens_evaluated": 12,
            "prompt": "p" * 20_000,
            "timings": LLAMACPP_FINAL["timings"],
        }
        body = sse({"content": "a", "stop": False}, final)
        self.assertEqual(measure("llamacpp", [body]), LLAMACPP_STATS)

    def test_ollama_truncated_stream_estimated(self) -> None:
        body = ndjson(*OLLAMA_TOKENS)
        self.assertEqual(measure("ollama", [body]), Stats(None, 30, None, 0, True))
        self.assertEqual(measure("ollama", [body[:-1]]), Stats(None, 30, None, 0, True))

    def test_ollama_openai_route(self) -> None:
        """An OpenAI-shaped stream is measured under the Ollama dialect too."""
        self.assertEqual(measure("ollama", [OPENAI_SSE_USAGE]), REPORTED)

    def test_llamacpp_openai_usage_and_timings(self) -> None:
        body = sse(
            *TOKENS,
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": USAGE,
                "timings": {"predicted_per_second": 50.0},
            },
            "[DONE]",
        )
        self.assertEqual(measure("llamacpp", [body]), Stats(12, 340, 50.0, 0))

    def test_llamacpp_stream_timings_count_cached_prompt(self) -> None:
        """
        A llama.cpp chat stream without C{include_usage} reports only
        C{timings} on its finishing chunk; the prompt is C{prompt_n} (the
        tokens evaluated now) plus C{cache_n} (those from the prompt cache),
        as llama-server reports a repeated prompt.
        """
        timings = {
            "cache_n": 33,
            "prompt_n": 1,
            "prompt_ms": 12.5,
            "predicted_n": 20,
            "predicted_ms": 400.0,
            "predicted_per_second": 50.0,
        }
        finishing = {**FINISHING, "timings": timings}
        body = sse(ROLE_ONLY, *TOKENS, finishing, "[DONE]")
        self.assertEqual(measure("llamacpp", [body]), Stats(34, 20, 50.0, 0))
        # An engine that sends no cache_n: prompt_n is all there is.
        finishing["timings"] = {k: v for k, v in timings.items() if k != "cache_n"}
        body = sse(ROLE_ONLY, *TOKENS, finishing, "[DONE]")
        self.assertEqual(measure("llamacpp", [body]), Stats(1, 20, 50.0, 0))
        # Found by its key at the end of a window that cut the record.
        body = sse({**FINISHING, "padding": "p" * 20_000, "timings": timings}, "[DONE]")
        stats = measure("llamacpp", [body], tail_bytes=4096)
        self.assertEqual(stats and stats.promptTokens, 34)

    def test_llamacpp_usage_not_summed_with_cache(self) -> None:
        """
        C{usage.prompt_tokens} and C{tokens_evaluated} already count the
        whole prompt: C{cache_n} next to them is not added again.
        """
        timings = {"cache_n": 33, "prompt_n": 1, "predicted_per_second": 50.0}
        body = sse(
            *TOKENS,
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {**USAGE, "prompt_tokens": 34},
                "timings": timings,
            },
            "[DONE]",
        )
        stats = measure("llamacpp", [body])
        self.assertEqual(stats and stats.promptTokens, 34)
        final = {**LLAMACPP_FINAL, "tokens_evaluated": 34, "timings": timings}
        stats = measure("llamacpp", [sse({"content": "a", "stop": False}, final)])
        self.assertEqual(stats and stats.promptTokens, 34)

    def test_estimate_discounts_tokenless_events(self) -> None:
        """
        An estimate counts neither the finishing chunk nor a role-only opening
        chunk, but does count a chunk that carries a token besides.
        """
        body = sse(ROLE_ONLY, *TOKENS[:3], FINISHING, "[DONE]")
        self.assertEqual(measure("llamacpp", [body]), Stats(None, 3, None, 0, True))
        # The last token arrives on the finishing chunk.
        last = {
            **FINISHING,
            "choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}],
        }
        body = sse(ROLE_ONLY, *TOKENS[:3], last, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 4, None, 0, True))
        # The first chunk carries a token besides the role.
        first = {"choices": [{"delta": {"role": "assistant", "content": "a"}}]}
        body = sse(first, *TOKENS[:3], FINISHING, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 4, None, 0, True))
        # A tool call is output too.
        call = {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}
        body = sse(ROLE_ONLY, call, FINISHING, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 1, None, 0, True))
        # A /v1/completions stream: an empty text with the finish_reason.
        text = {"choices": [{"text": "a", "finish_reason": None}]}
        end = {"choices": [{"text": "", "finish_reason": "length"}]}
        body = sse(text, text, end, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 2, None, 0, True))
        # Only the role-only chunk and the end: no token at all.
        body = sse(ROLE_ONLY, FINISHING, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 0, None, 0, True))

    def test_role_only_beyond_head_counted(self) -> None:
        """
        A first event that does not end within the head is not recognised (a
        bounded look), so it counts as a token.
        """
        padded = {**ROLE_ONLY, "pad": "x" * HEAD_BYTES}
        body = sse(padded, *TOKENS[:3], FINISHING, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 4, None, 0, True))
        # An SSE comment or event name before the first data line is skipped.
        body = b": hi\nevent: x\n" + sse(ROLE_ONLY, *TOKENS[:3], FINISHING, "[DONE]")
        self.assertEqual(measure("openai", [body]), Stats(None, 3, None, 0, True))

    def test_head_let_go_once_the_first_event_is_complete(self) -> None:
        """
        The head is kept only until the first event's line is complete (a
        long stream holds its tail alone), and the role-only opening is
        still discounted, whatever the split.
        """
        body = sse(ROLE_ONLY, *TOKENS[:3], FINISHING, "[DONE]")
        for cut in (1, 10, len(sse(ROLE_ONLY)) - 2, len(sse(ROLE_ONLY)), 200):
            meter = StatsMeter(Clock(), "openai")
            meter.feed(body[:cut])
            opening_done = b"\n" in body[:cut]
            self.assertEqual(meter._head is None, opening_done, cut)
            meter.feed(body[cut:])
            self.assertIsNone(meter._head)
            self.assertEqual(meter.finish(), Stats(None, 3, None, None, True), cut)
        # An NDJSON stream's first record settles it too (nothing to discount).
        meter = StatsMeter(Clock(), "ollama")
        meter.feed(ndjson({"message": {"content": "a"}, "done": False}))
        self.assertIsNone(meter._head)

    def test_fake_engine_streams_estimated_exactly(self) -> None:
        """
        Every fake dialect's OpenAI streams without usage are estimated at
        exactly their token count.
        """
        for dialect, path, model in (
            ("ollama", "/v1/chat/completions", "m:latest"),
            ("ollama", "/v1/completions", "m:latest"),
            ("openai", "/v1/chat/completions", "m"),
            ("openai", "/v1/completions", "m"),
            ("llamacpp", "/v1/chat/completions", "m"),
            ("llamacpp", "/v1/completions", "m"),
            ("llamacpp", "/completion", "m"),
        ):
            for n in (0, 1, 7):
                call = dialects.Call(
                    method="POST",
                    path=path,
                    body={"model": model, "prompt": "hi", "stream": True},
                    form={},
                    models=[model],
                    now=0.0,
                    seq=1,
                    tokens=n,
                    usage=False,
                    force_usage=False,
                )
                reply = dialects.ROUTES[dialect][path].handler(call)
                self.assertTrue(reply.streaming)
                stats = measure(dialect, list(reply.parts))  # type: ignore[arg-type]
                self.assertEqual(
                    stats, Stats(None, n, None, 0, True), (dialect, path, n)
                )

    def test_nothing_measured(self) -> None:
        meter = StatsMeter(Clock(), "openai")
        self.assertIsNone(meter.finish())
        meter = StatsMeter(Clock(), "openai")
        meter.feed(b"not json")
        self.assertIsNone(meter.finish())

    def test_unreported_document_ttft_only(self) -> None:
        self.assertEqual(measure("openai", [b'{"choices": []}']), Stats(ttftMs=0))
        self.assertEqual(
            measure("ollama", [b'{"done": true, "done_reason": "load"}']),
            Stats(ttftMs=0),
        )

    def test_ttft_and_decode_rate(self) -> None:
        clock = Clock()
        meter = StatsMeter(clock, "openai")
        meter.started()
        clock.advance(0.812)
        meter.feed(sse(openai_chunk("a")))
        clock.advance(2)
        meter.feed(sse(openai_chunk("b")))
        meter.feed(sse({"choices": [], "usage": USAGE}, "[DONE]"))
        stats = meter.finish()
        self.assertEqual(stats, Stats(12, 340, 170.0, 812))
        self.assertIs(meter.finish(), stats)

    def test_no_started_no_ttft(self) -> None:
        meter = StatsMeter(Clock(), "ollama")
        meter.feed(OLLAMA_JSON)
        stats = meter.finish()
        assert stats is not None
        self.assertIsNone(stats.ttftMs)

    def test_feed_after_finish_ignored(self) -> None:
        meter = StatsMeter(Clock(), "ollama")
        meter.feed(OLLAMA_JSON)
        first = meter.finish()
        meter.feed(b"garbage")
        self.assertEqual(meter.finish(), first)

    def test_tail_bytes_minimum(self) -> None:
        self.assertRaises(ValueError, StatsMeter, Clock(), "openai", tail_bytes=10)

    def test_50mb_stream_bounded_window(self) -> None:
        """
        A 50 MB stream keeps at most ``tail_bytes`` of body, counts every event,
        and still finds the usage report at the end.
        """
        meter = StatsMeter(Clock(), "openai", tail_bytes=8192)
        meter.started()
        block = sse(*[openai_chunk("x" * 40)] * 40)
        events_per_block = 40
        fed = 0
        blocks = 0
        while fed < 50 * 1024 * 1024:
            meter.feed(block)
            fed += len(block)
            blocks += 1
            self.assertLessEqual(meter.window, 8192)
        meter.feed(sse({"choices": [], "usage": USAGE}, "[DONE]"))
        self.assertEqual(meter.finish(), REPORTED)
        self.assertEqual(meter.window, 0)
        self.assertGreater(meter.total_bytes, 50 * 1024 * 1024)

        meter = StatsMeter(Clock(), "openai", tail_bytes=8192)
        for _ in range(blocks):
            meter.feed(block)
        self.assertLessEqual(meter.window, 8192)
        stats = meter.finish()
        assert stats is not None
        self.assertEqual(stats.completionTokens, blocks * events_per_block)
        self.assertTrue(stats.estimated)

    def test_stream_window_keeps_last_lines(self) -> None:
        """
        An open stream holds only its last L{TAIL_LINES} lines once its
        window passes 1.5 KB, not the whole C{tail_bytes}: what each open
        stream costs in memory.  The report and the estimate come out as
        with the whole window.
        """
        token = openai_chunk("x" * 40)
        cases: list[tuple[Dialect, list[bytes], bytes, Stats]] = [
            (
                "openai",
                [sse(token)] * 300,
                sse({"choices": [], "usage": USAGE}, "[DONE]"),
                REPORTED,
            ),
            (
                "openai",
                [sse(token)] * 300,
                sse(FINISHING, "[DONE]"),
                Stats(None, 300, None, 0, True),
            ),
            (
                "ollama",
                [ndjson({"message": {"content": "x" * 40}, "done": False})] * 300,
                ndjson(OLLAMA_FINAL),
                OLLAMA_STATS,
            ),
        ]
        for dialect, chunks, end, expected in cases:
            meter = StatsMeter(Clock(), dialect, tail_bytes=8192)
            meter.started()
            largest = 0
            for chunk in chunks:
                meter.feed(chunk)
                largest = max(largest, meter.window)
            self.assertLessEqual(largest, 1536 + len(chunks[0]))
            meter.feed(end)
            self.assertEqual(meter.finish(), expected)
            whole = measure(dialect, [b"".join(chunks) + end], tail_bytes=1 << 20)
            self.assertEqual(whole, expected)

    def test_stream_window_holds_its_lines_not_its_peak(self) -> None:
        """
        What an open stream's window holds in memory follows the lines it
        keeps: cutting the window back does not leave it the allocation it
        grew to before the cut (a bytearray keeps it when its head is
        deleted).
        """
        record = ndjson({"message": {"content": "x" * 80}, "done": False})
        meter = StatsMeter(Clock(), "ollama", tail_bytes=8192)
        meter.started()
        empty = sys.getsizeof(bytearray())
        for _ in range(300):
            meter.feed(record)
            held = sys.getsizeof(meter._tail) - empty
            # a bytearray grows by an eighth over what it is asked for
            self.assertLessEqual(held, meter.window * 1.25 + 64)

    def test_document_window_not_cut_by_lines(self) -> None:
        """
        A document that is not a stream of lines (pretty-printed JSON) keeps
        its whole window, so an answer below C{tail_bytes} is read whole.
        """
        answer = {
            "choices": [{"message": {"content": "x"}, "finish_reason": "stop"}],
            "padding": [f"line {n}" for n in range(300)],
            "usage": USAGE,
        }
        body = json.dumps(answer, indent=2).encode()
        self.assertGreater(body.count(b"\n"), 300)
        self.assertLess(len(body), 8192)
        meter = StatsMeter(Clock(), "openai", tail_bytes=8192)
        meter.started()
        for chunk in split(body, list(range(0, len(body), 100))):
            meter.feed(chunk)
        self.assertEqual(meter.window, len(body))
        self.assertEqual(meter.finish(), REPORTED)


_LINES = st.sampled_from(
    [
        b'{"message":{"content":"a"},"done":false}',
        b'{"done":true,"eval_count":7,"prompt_eval_count":3,"eval_duration":1000}',
        b'{"done":true,"prompt_eval_count":3}',
        b'data: {"choices":[{"delta":{"content":"x"}}]}',
        b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":5}}',
        b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":'
        b'{"predicted_n":4,"prompt_n":1,"cache_n":2}}',
        b"data: [DONE]",
        b"event: message",
        b": keep-alive",
        b'{"tokens_predicted":3,"tokens_evaluated":9}',
        b'{"usage":{"prompt_tokens":"x"}}',
        b"not json",
        b"",
        b'data: {"choices":[{"delta":{"content":"a"},"finish_reason":null},'
        b'{"delta":{},"finish_reason":"length"}]}',
        b'data: {"choices":[{"delta":{},"finish_reason": "stop"}]}',
        b'data: {"choices":[{"delta":{},"\\u0066inish_reason":"stop"}]}',
        b'{"content":"","stop":true,"tokens_predicted":2}',
        b'{"content":"x","stop":false}',
        b'{"\\u0075sage":{"completion_tokens":4}}',
        b'{"done":true}',
        b'data: {"choices":[],"usage":null}',
        b"  data:[DONE]\r",
        b'\t{"done":true,"eval_count":2}\r',
        b" \r",
        b'data: {"choices":[{"delta":{"content":"[DONE]"},"finish_reason":null}]}',
        b'{"done":true} {"usage":{"completion_tokens":1}}',
    ]
)


def _decode_all(window: bytes, whole: bool) -> tuple[Any, Any]:
    """
    The report and the tally of a window by decoding every line, the way
    the meter did before it skipped lines that cannot matter.
    """
    from nvproxy import inferstats

    if whole and window:
        body = inferstats._loads(window)
        if isinstance(body, dict):
            only, tokenless = inferstats._counted(body)
            return inferstats._report(body), inferstats._Tally(
                0, only, tokenless, body.get("done") is True
            )
    records, done = [], 0
    lines = window.split(b"\n")
    if not whole:
        lines = lines[1:]  # the first line in a trimmed window may be partial
    for line in (line.strip() for line in lines):
        if not line:
            continue
        if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
            done += 1
            continue
        value = inferstats._record(line)
        if isinstance(value, dict):
            records.append(value)
    report = None
    for record in reversed(records):
        report = inferstats._report(record)
        if report is not None:
            break
    counts = [inferstats._counted(record) for record in records]
    tally = inferstats._Tally(
        done,
        sum(only for only, _ in counts),
        sum(tokenless for _, tokenless in counts),
        bool(records) and records[-1].get("done") is True,
    )
    return report, tally


class LastReportTests(SynchronousTestCase):
    def test_key_names_cover_every_report_key(self) -> None:
        """
        Every report key is found by the window's search for key names, so
        a key added later cannot be skipped.
        """
        from nvproxy import inferstats

        for key in inferstats._REPORT_KEYS:
            with self.subTest(key=key):
                line = b'{"' + key.encode() + b'":1}'
                self.assertTrue(
                    any(name.search(line) for name in inferstats._KEY_NAMES)
                )

    @settings(max_examples=500)
    @given(
        st.lists(_LINES, max_size=12),
        st.booleans(),
        st.booleans(),
        st.integers(min_value=0, max_value=80),
    )
    def test_same_as_decoding_every_record(
        self, lines: list[bytes], whole: bool, one_document: bool, cut: int
    ) -> None:
        """
        The report and the counts the meter finds by decoding back from the
        window's end, and only lines that can change them, are what decoding
        every record finds.
        """
        from nvproxy import inferstats

        window = b"\n".join(lines) + b"\n"
        if one_document and lines:
            window = lines[0]
        if not whole:
            window = window[cut:]  # a trimmed window starts anywhere
        report, tally = _decode_all(window, whole)
        win = inferstats._Window(window, whole)
        self.assertEqual(inferstats._last_report(win), report)
        self.assertEqual(inferstats._tally(win), tally)
        # An SSE body's estimate does not ask for the last record's "done".
        self.assertEqual(
            inferstats._tally(win, last_done=False), evolve(tally, last_done=False)
        )


class FoundTests(SynchronousTestCase):
    @given(st.lists(_LINES, max_size=12), st.integers(min_value=0, max_value=80))
    def test_same_as_the_search(self, lines: list[bytes], cut: int) -> None:
        """
        Where the window finds each pattern is where a search finds it: the
        literal it looks for first is in every match.
        """
        from nvproxy import inferstats

        window = (b"\n".join(lines) + b"\n")[cut:]
        win = inferstats._Window(window, False)
        for pattern in (*inferstats._MAY_REPORT, *inferstats._MAY_TALLY):
            self.assertTrue(inferstats._NEEDLES[pattern])
            self.assertEqual(
                win.found(pattern), [m.start() for m in pattern.finditer(window)]
            )


class LoadsTests(SynchronousTestCase):
    """The meter decodes a record as C{json.loads} would, UTF-8 or not."""

    def test_same_as_json_loads(self) -> None:
        """
        Plain UTF-8 JSON takes the short way; a byte order mark, UTF-16 or
        UTF-32, bytes that are not UTF-8 and what is not JSON come out as
        C{json.loads} makes them (C{None} where it raises).
        """
        record = {"done": True, "eval_count": 5, "content": "\u00e9\u4e2d"}
        cases = [
            json.dumps(record).encode(),
            b"  " + json.dumps(record).encode() + b"\n",
            b"\xef\xbb\xbf" + json.dumps(record).encode(),
            json.dumps(record).encode("utf-16"),
            json.dumps(record).encode("utf-32-le"),
            b'{"a": "\xff"}',
            b'{"a": "\\ud800"}',
            b'{"a": "\xed\xa0\x80"}',
            b"\x00{",
            b"[]\x00",
            b"not json",
            b"{} {}",
            b"",
        ]
        for data in cases:
            try:
                expected = json.loads(data)
            except ValueError:
                expected = None
            self.assertEqual(_loads(data), expected, data)
        self.assertEqual(_loads(json.dumps(record).encode("utf-16")), record)

    @given(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(),
            lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
            max_leaves=8,
        ),
        st.sampled_from(
            ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "utf-32-be"]
        ),
    )
    @settings(max_examples=200, deadline=None)
    def test_any_document(self, value: object, encoding: str) -> None:
        """Any JSON document in any encoding C{json.loads} reads."""
        data = json.dumps(value).encode(encoding)
        self.assertEqual(_loads(data), json.loads(data))
