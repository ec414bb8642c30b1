"""Admin lists that stay fast at millions of rows: capped counts, no facets, nothing editable.

Django's admin counts every list it shows (`COUNT(*)` over the whole filtered table, for the
paginator, the "N results" line and "select all N"); at a million rows that count alone costs
more than the page. Here a list counts at most CAP + 1 matching rows and says "10,000+" beyond.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.utils.functional import cached_property

CAP = 10_000


class CappedPaginator(Paginator):
    """Counts at most CAP + 1 rows (COUNT over a LIMIT subquery), so a page never scans the table."""

    @cached_property
    def count(self) -> int:
        # Without ORDER BY the database takes whichever index finds CAP + 1 matches soonest.
        return self.object_list.order_by().values("pk")[: CAP + 1].count()

    @property
    def capped(self) -> bool:
        return self.count > CAP


def count_label(count: int, capped: bool) -> str:
    """How a list names its number of rows: "1,234", or "10,000+" when the count stopped at the cap."""
    return f"{CAP:,}+" if capped else f"{count:,}"


class CappedChangeList(ChangeList):
    """A ChangeList whose templates show `count_label` ("10,000+") instead of an exact count."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        capped = getattr(self.paginator, "capped", False)
        self.count_is_capped = capped
        self.count_label = count_label(self.result_count, capped)


class ConsoleAdmin(admin.ModelAdmin):
    """The console's lists: capped counts, no facet counts, no full count, no date drill-down."""

    paginator = CappedPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    list_max_show_all = 200

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return CappedChangeList

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Django answers an action the user may not run by showing the list again; a forged
        # action POST is refused outright instead.
        if request.method == "POST":
            allowed = self.get_actions(request)
            if any(name and name not in allowed for name in request.POST.getlist("action")):
                raise PermissionDenied
        return super().changelist_view(request, extra_context)


class ReadOnlyAdmin(ConsoleAdmin):
    """Viewable by staff with the view permission; nothing can be added, changed or deleted."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
