"""The example project's admin site: Django's, titled for this project (taskflow itself titles nothing)."""

from django.contrib import admin
from django.contrib.admin.apps import AdminConfig


class ExampleAdminSite(admin.AdminSite):
    site_header = "taskflow example"
    site_title = "taskflow example"
    index_title = "Tasks, workers and schedule configuration"


class ExampleAdminConfig(AdminConfig):
    """In INSTALLED_APPS instead of "django.contrib.admin": Django's way to replace the default site."""

    default_site = "project.admin.ExampleAdminSite"
