"""
The summary of a bench run: one line per figure (the numbers the performance
targets are stated in), one column per target -- direct, Twisted's
ReverseProxyResource, nginx, nvproxy -- then nvproxy's ratio to direct and to
RPR and nginx's ratio to RPR; and the same figures as a PNG chart when
matplotlib is installed (the C{bench} extra).

Every value is a median or a percentile over all the measured rounds of one
path (see C{docs/performance.rst}).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from attrs import frozen

DIRECT, RPR, NGINX, NVPROXY = "direct", "rpr", "nginx", "nvproxy"
TARGETS = (DIRECT, RPR, NGINX, NVPROXY)
COLUMNS = (
    "figure",
    "direct",
    "Twisted RPR",
    "nginx",
    "nvproxy",
    "nvproxy/direct",
    "nvproxy/RPR",
    "nginx/RPR",
)


class RowLike(Protocol):
    """The fields of L{bench.run.Row} a figure reads."""

    @property
    def scenario(self) -> str: ...

    @property
    def concurrency(self) -> int: ...

    @property
    def path(self) -> str: ...

    @property
    def rps(self) -> float: ...

    @property
    def p50(self) -> float: ...

    @property
    def p99(self) -> float: ...

    @property
    def ttfb_p50(self) -> float: ...

    @property
    def ttfb_p99(self) -> float: ...

    @property
    def errors(self) -> int: ...

    @property
    def lines_per_request(self) -> float: ...

    @property
    def proxy_cpu_per_request(self) -> float | None: ...

    @property
    def delay_p50(self) -> float: ...

    @property
    def delay_p99(self) -> float: ...

    @property
    def rss_base(self) -> int | None: ...

    @property
    def rss_peak(self) -> int | None: ...


@frozen
class Figure:
    """One figure for each target that has it (path -> value in C{unit})."""

    label: str
    unit: str
    values: dict[str, float]


def _chunks_per_second(r: RowLike) -> float | None:
    return r.rps * r.lines_per_request


def _cpu_per_1000(r: RowLike) -> float | None:
    cpu = r.proxy_cpu_per_request
    return None if cpu is None else cpu * 1000


def _paced_cpu_per_1000(r: RowLike) -> float | None:
    # One paced stream at a time, a path's rounds take a few ms of CPU in
    # all, under the 10 ms tick /proc counts it in: no figure.
    return _cpu_per_1000(r) if r.concurrency > 1 else None


def _cpu_us(r: RowLike) -> float | None:
    cpu = r.proxy_cpu_per_request
    return None if cpu is None else cpu * 1e6


def _mb(value: int | None) -> float | None:
    return None if value is None else value / 2**20


def _per_stream_kb(r: RowLike) -> float | None:
    if r.rss_base is None or r.rss_peak is None or not r.concurrency:
        return None
    return (r.rss_peak - r.rss_base) / r.concurrency / 1024


Extract = Callable[[RowLike], float | None]

#: scenario -> (label, unit, extractor) for each figure, in table order
SPECS: dict[str, Sequence[tuple[str, str, Extract]]] = {
    "chat": (
        ("p50 latency", "ms", lambda r: r.p50 * 1e3),
        ("p99 latency", "ms", lambda r: r.p99 * 1e3),
        ("req/s", "req/s", lambda r: r.rps),
        ("proxy CPU per request", "us", _cpu_us),
    ),
    "stream": (
        ("chunks/s", "chunks/s", _chunks_per_second),
        ("proxy CPU per 1,000 streams", "s", _cpu_per_1000),
    ),
    "stream-sse": (
        ("chunks/s", "chunks/s", _chunks_per_second),
        ("proxy CPU per 1,000 streams", "s", _cpu_per_1000),
    ),
    "paced": (
        ("chunk delay p50", "ms", lambda r: r.delay_p50 * 1e3),
        ("chunk delay p99", "ms", lambda r: r.delay_p99 * 1e3),
        ("proxy CPU per 1,000 streams", "s", _paced_cpu_per_1000),
    ),
    "open": (
        ("RSS base", "MB", lambda r: _mb(r.rss_base)),
        ("RSS peak", "MB", lambda r: _mb(r.rss_peak)),
        ("RSS per stream", "KB", _per_stream_kb),
        ("TTFB p99", "ms", lambda r: r.ttfb_p99 * 1e3),
        ("failed streams", "streams", lambda r: float(r.errors)),
    ),
}


def figures(rows: Iterable[RowLike]) -> list[Figure]:
    """The figures of every scenario and concurrency present in C{rows}."""
    groups: dict[tuple[str, int], dict[str, RowLike]] = {}
    for row in rows:
        if row.scenario in SPECS and row.path in TARGETS:
            groups.setdefault((row.scenario, row.concurrency), {})[row.path] = row
    result = []
    for (scenario, concurrency), by_path in groups.items():
        for label, unit, extract in SPECS[scenario]:
            values = {}
            for path, row in by_path.items():
                value = extract(row)
                if value is not None and not math.isnan(value):
                    values[path] = value
            if values:
                result.append(
                    Figure(f"{scenario} c={concurrency}: {label}", unit, values)
                )
    return result


def _number(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _ratio(values: dict[str, float], top: str, bottom: str) -> str:
    a, b = values.get(top), values.get(bottom)
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def figures_table(figs: Sequence[Figure]) -> str:
    """The figures as a text table, one line each (see L{COLUMNS})."""
    lines: list[tuple[str, ...]] = [COLUMNS]
    for fig in figs:
        lines.append(
            (
                f"{fig.label} ({fig.unit})",
                *(_number(fig.values.get(t)) for t in TARGETS),
                _ratio(fig.values, NVPROXY, DIRECT),
                _ratio(fig.values, NVPROXY, RPR),
                _ratio(fig.values, NGINX, RPR),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    text = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        text.append("  ".join(cells).rstrip())
        if n == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


COLOURS = {DIRECT: "#999999", RPR: "#4c72b0", NGINX: "#55a868", NVPROXY: "#c44e52"}


def chart(figs: Sequence[Figure], out: Path, title: str) -> str | None:
    """
    Write the figures as a PNG bar chart, one panel per figure; returns why
    not (matplotlib missing, no figures) or None once written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'nvproxy[bench]')"
    if not figs:
        return "no figures to draw"
    columns = 4
    rows = -(-len(figs) // columns)
    fig: Any
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 2.6 * rows), squeeze=False
    )
    names = {DIRECT: "direct", RPR: "RPR", NGINX: "nginx", NVPROXY: "nvproxy"}
    for ax, figure in zip(axes.flat, figs, strict=False):
        present = [t for t in TARGETS if t in figure.values]
        values = [figure.values[t] for t in present]
        bars = ax.bar(
            [names[t] for t in present],
            values,
            color=[COLOURS[t] for t in present],
        )
        ax.bar_label(bars, labels=[_number(v) for v in values], fontsize=7)
        ax.set_title(figure.label, fontsize=8)
        ax.set_ylabel(figure.unit, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.margins(y=0.2)
    for ax in list(axes.flat)[len(figs) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return None
