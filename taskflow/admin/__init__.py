"""The operator console, in the Django admin: tasks to inspect and steer, types, workers, history.

One module per page: tasks.py (list and task page), actions.py (the operations and their
confirmation page), configs.py (task types), periodic.py (schedules), workers.py, events.py (the
audit trail), coordination.py (leases, rolling positions), dashboard.py (per-type numbers and
charts, from the rollup in engine/stats.py; charts.py draws them as SVG). listing.py keeps every
list fast at millions of rows; filters.py holds the task list's filters, display.py how values are shown.

The console lives in the project's admin site and leaves its header and titles alone: a project
that wants its admin titled says so itself (the example project does, in project/admin.py).
"""

from __future__ import annotations

from django.contrib import admin

from .configs import ScheduleCfgAdmin
from .coordination import LockAdmin, SchedulePosAdmin
from .dashboard import install as install_dashboard
from .events import TaskEventAdmin
from .periodic import PeriodicTaskAdmin
from .tasks import TaskAdmin
from .workers import WorkerProcessAdmin

# The dashboard: its URL (/admin/taskflow/dashboard/) and its entry in the index.
install_dashboard(admin.site)

__all__ = [
    "LockAdmin",
    "PeriodicTaskAdmin",
    "ScheduleCfgAdmin",
    "SchedulePosAdmin",
    "TaskAdmin",
    "TaskEventAdmin",
    "WorkerProcessAdmin",
]
