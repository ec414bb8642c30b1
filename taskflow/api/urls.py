"""The API's URLs; a project mounts them with `path("api/", include("taskflow.api.urls"))`."""

from django.urls import path
from drf_spectacular.renderers import OpenApiJsonRenderer
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from . import views
from .permissions import LoggedIn

app_name = "taskflow_api"


class SchemaView(SpectacularAPIView):
    """The OpenAPI 3 schema, for logged-in users only."""

    authentication_classes = views.ApiView.authentication_classes
    permission_classes = [LoggedIn]
    get_exception_handler = views.ApiView.get_exception_handler


class DocsView(SpectacularSwaggerView):
    """Swagger UI, served from drf-spectacular-sidecar's static files (no CDN)."""

    authentication_classes = views.ApiView.authentication_classes
    permission_classes = [LoggedIn]
    get_exception_handler = views.ApiView.get_exception_handler


urlpatterns = [
    path("workers/", views.WorkersView.as_view(), name="workers"),
    path("tasks/", views.TasksView.as_view(), name="tasks"),
    path("tasks/bulk/", views.BulkCreateView.as_view(), name="tasks-bulk"),
    path("tasks/hold/", views.HoldView.as_view(), name="tasks-hold"),
    path("tasks/set/", views.BatchSetView.as_view(), name="tasks-set-batch"),
    path("tasks/heartbeat/", views.HeartbeatView.as_view(), name="tasks-heartbeat"),
    path("tasks/release/", views.ReleaseView.as_view(), name="tasks-release"),
    path("tasks/<str:task_id>/", views.TaskView.as_view(), name="task"),
    path("tasks/<str:task_id>/set/", views.TaskSetView.as_view(), name="task-set"),
    path("schedule-cfgs/", views.ScheduleCfgsView.as_view(), name="schedule-cfgs"),
    path("schedule-cfgs/<str:task_type>/", views.ScheduleCfgView.as_view(), name="schedule-cfg"),
    path("stats/", views.StatsView.as_view(), name="stats"),
    path("schema/", SchemaView.as_view(renderer_classes=[OpenApiJsonRenderer]), name="schema"),
    path("docs/", DocsView.as_view(url_name="taskflow_api:schema"), name="docs"),
]
