"""taskflow's own URLs (the console lives in the admin): mount with `path("", include("taskflow.urls"))`."""

from django.urls import path

from .metrics import metrics_view

app_name = "taskflow"

urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
]
