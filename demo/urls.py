from django.urls import path

from . import views

app_name = "demo"
urlpatterns = [
    path("", views.document_list, name="documents"),
    path("documents/<int:pk>/", views.document_detail, name="document"),
    path("documents/<int:pk>/status/", views.document_status, name="document_status"),
    path("words/", views.word_count, name="word_count"),
    path("words/<str:result_id>/", views.word_count_result, name="word_count_result"),
]
