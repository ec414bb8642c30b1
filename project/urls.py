"""URLs of the example project: its pages at the site root (demo/urls.py), the console at /admin/, the API at
/api/, taskflow's own URLs (/metrics)."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("demo.urls")),
    path("admin/", admin.site.urls),
    path("api/", include("taskflow.api.urls")),
    path("", include("taskflow.urls")),
]
