from django.urls import path

from . import views

app_name = "demo"
urlpatterns = [
    path("", views.document_list, name="documents"),
    path("documents/<int:pk>/", views.document_detail, name="document"),
    path("documents/<int:pk>/status/", views.document_status, name="document_status"),
]
