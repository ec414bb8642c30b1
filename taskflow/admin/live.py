"""Live pages: the dashboard, the task list and the task page refresh themselves.

The page carries a hidden control (templates/taskflow/live.html) naming the regions to refresh;
static/taskflow/live.js shows it, fetches the same URL every REFRESH_SECONDS and swaps those
regions in, keeping the operator's ticked rows, scroll and anything being typed. Without
JavaScript the control stays hidden and the page is an ordinary page.
"""

from __future__ import annotations

from typing import Any

REFRESH_SECONDS = 5.0


def live(*regions: str) -> dict[str, Any]:
    """Template context making a page live: the CSS selectors of the regions its refresh replaces."""
    return {"live": {"interval": REFRESH_SECONDS, "regions": ",".join(regions)}}
