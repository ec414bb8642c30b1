"""The example's business data: what a project's own models look like next to taskflow."""

from django.db import models
from django.urls import reverse


class Document(models.Model):
    """A document uploaded through the example form; a taskflow task indexes it."""

    name = models.CharField(max_length=200)
    pages = models.PositiveIntegerField()
    words = models.PositiveIntegerField(null=True, blank=True, editable=False, help_text="set by the task")
    # The task's id, not a ForeignKey: finished tasks are purged on their own schedule, and the
    # business row must outlive them.
    task_id = models.BigIntegerField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("demo:document", args=[self.pk])
