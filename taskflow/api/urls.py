"""The API's URLs; a project mounts them with `path("api/", include("taskflow.api.urls"))`."""


from django.http import HttpRequest, JsonResponse
from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.renderers import OpenApiJsonRenderer, OpenApiJsonRenderer2
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from . import views
from .permissions import LoggedIn, PermissionsBeforeNegotiation

app_name = "taskflow_api"


class SchemaView(PermissionsBeforeNegotiation, SpectacularAPIView):
    """The OpenAPI 3 schema as JSON (`application/json` or the OpenAPI media type), for logged-in users only."""

    authentication_classes = views.ApiView.authentication_classes
    permission_classes = [LoggedIn]
    renderer_classes = [OpenApiJsonRenderer2, OpenApiJsonRenderer]  # application/json first: errors too
    get_exception_handler = views.ApiView.get_exception_handler



class DocsView(PermissionsBeforeNegotiation, SpectacularSwaggerView):
    """Swagger UI, served from drf-spectacular-sidecar's static files (no CDN)."""

    authentication_classes = views.ApiView.authentication_classes
    permission_classes = [LoggedIn]
    get_exception_handler = views.ApiView.get_exception_handler


@csrf_exempt  # answers a 404 whatever the method: there is nothing here a forged request could change
def unknown_path(request: HttpRequest) -> JsonResponse:
    detail = f"no API endpoint at {request.path[:200]}"
    if not request.path.endswith("/"):
        detail += " (the API's paths end with a slash)"
    return JsonResponse({"error": "not_found", "detail": detail}, status=404)


urlpatterns = [
    path("workers/", views.WorkersView.as_view(), name="workers"),
    path("tasks/", views.TasksView.as_view(), name="tasks"),
    path("tasks/bulk/", views.BulkCreateView.as_view(), name="tasks-bulk"),
    path("tasks/hold/", views.HoldView.as_view(), name="tasks-hold"),
    path("tasks/set/", views.BatchSetView.as_view(), name="tasks-set-batch"),
    path("tasks/heartbeat/", views.HeartbeatView.as_view(), name="tasks-heartbeat"),
    path("tasks/start/", views.StartView.as_view(), name="tasks-start"),
    path("tasks/release/", views.ReleaseView.as_view(), name="tasks-release"),
    path("tasks/<str:task_id>/", views.TaskView.as_view(), name="task"),
    path("tasks/<str:task_id>/set/", views.TaskSetView.as_view(), name="task-set"),
    path("schedule-cfgs/", views.ScheduleCfgsView.as_view(), name="schedule-cfgs"),
    path("schedule-cfgs/<str:task_type>/", views.ScheduleCfgView.as_view(), name="schedule-cfg"),
    path("stats/", views.StatsView.as_view(), name="stats"),
    path("schema/", SchemaView.as_view(), name="schema"),
    path("docs/", DocsView.as_view(url_name="taskflow_api:schema"), name="docs"),
    re_path(r"^", unknown_path),  # last: anything else under the API is a JSON 404, not the site's HTML one
]
