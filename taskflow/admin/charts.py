"""Charts drawn on the server as inline SVG: no script, no CDN, nothing to load but the page."""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

WIDTH, HEIGHT = 600, 110
TOP, BOTTOM, LEFT = 14, 16, 34  # room for the scale's label, the time axis and the y labels


def minute_bars(
    per_minute: list[dict[str, Any]],
    *,
    label: Callable[[dict[str, Any]], str],
    link: Callable[[dict[str, Any], str], str],
    title: str,
) -> SafeString:
    """One bar per minute: completed (green) with failed (red) stacked on top, each part a link.

    `label(minute)` names a minute ("12:34"); `link(minute, status)` is the list of the tasks it counts.
    """
    peak = max((m["completed"] + m["failed"] for m in per_minute), default=0)
    scale = _nice(peak)
    slot = (WIDTH - LEFT) / max(1, len(per_minute))
    bar = max(1.0, slot * 0.8)
    usable = HEIGHT - TOP - BOTTOM
    parts = []
    # Plain f-strings, escaped by hand: a page draws hundreds of bars, and format_html per bar
    # costs more than the rest of the page.
    for i, m in enumerate(per_minute):
        x = LEFT + i * slot
        base = HEIGHT - BOTTOM
        name = label(m)
        for status, n, css in (("success", m["completed"], "tf-bar-ok"), ("failed", m["failed"], "tf-bar-failed")):
            if not n:
                continue
            h = max(1.0, usable * n / scale)
            base -= h
            what = "completed" if status == "success" else "failed"
            parts.append(
                f'<a href="{escape(link(m, status))}"><rect class="{css}" x="{x:.1f}" y="{base:.1f}" '
                f'width="{bar:.1f}" height="{h:.1f}"><title>{escape(name)}: {int(n)} {what}</title></rect></a>'
            )
    ticks = format_html_join(
        "",
        '<text class="tf-axis" x="{}" y="{}" text-anchor="middle">{}</text>',
        (
            (_n(LEFT + i * slot + bar / 2), HEIGHT - 3, label(per_minute[i]))
            for i in range(0, len(per_minute), max(1, len(per_minute) // 6))
        ),
    )
    return format_html(
        '<svg class="tf-chart" viewBox="0 0 {} {}" width="100%" role="img" aria-label="{}">'
        '<line class="tf-grid" x1="{}" y1="{}" x2="{}" y2="{}"/>'
        '<line class="tf-grid" x1="{}" y1="{}" x2="{}" y2="{}"/>'
        '<text class="tf-axis" x="{}" y="{}" text-anchor="end">{}</text>'
        '<text class="tf-axis" x="{}" y="{}" text-anchor="end">0</text>'
        "{}{}</svg>",
        WIDTH,
        HEIGHT,
        title,
        LEFT,
        TOP,
        WIDTH,
        TOP,
        LEFT,
        HEIGHT - BOTTOM,
        WIDTH,
        HEIGHT - BOTTOM,
        LEFT - 4,
        TOP + 4,
        scale,
        LEFT - 4,
        HEIGHT - BOTTOM,
        SafeString("".join(parts)),
        ticks,
    )


def _n(value: float) -> str:
    return f"{value:.1f}"


def _nice(peak: int) -> int:
    """The scale's top: the smallest 1, 2 or 5 × 10^n at or above `peak` (at least 1)."""
    step = 1
    while True:
        for f in (1, 2, 5):
            if f * step >= peak:
                return f * step
        step *= 10
