"""The example's pages: a form that saves a document and enqueues its task, and that task's live status."""

from typing import Any

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch

import taskflow
from taskflow.models import Status, Task

from .forms import DocumentForm, WordCountForm
from .models import Document
from .tasks import count_words

FINAL = {Status.SUCCESS, Status.FAILED, Status.STOPPED}


def document_list(request: HttpRequest) -> HttpResponse:
    """The upload form and the latest documents."""
    form = DocumentForm(request.POST or None)
    if form.is_valid():
        # One transaction: the document and its task commit together or not at all, and workers
        # are woken only after the commit, when the task's handler can see the document.
        with transaction.atomic():
            document = form.save()
            task = taskflow.enqueue("demo.index_document", {"document": document.pk}, key=f"document-{document.pk}")
            document.task_id = task.id
            document.save(update_fields=["task_id"])
        return redirect(document)
    return render(request, "documents/index.html", {"form": form, "documents": Document.objects.all()[:10]})


def document_detail(request: HttpRequest, pk: int) -> HttpResponse:
    """One document and its task's status, refreshed by polling `document_status`."""
    document = get_object_or_404(Document, pk=pk)
    return render(request, "documents/detail.html", {"document": document, "task": task_status(document)})


def document_status(request: HttpRequest, pk: int) -> JsonResponse:
    """The document's task as JSON."""
    return JsonResponse(task_status(get_object_or_404(Document, pk=pk)))


def task_status(document: Document) -> dict[str, Any]:
    try:
        task = taskflow.get_task(document.task_id)  # in the task table or, once rolled, in a history table
    except Task.DoesNotExist:
        return {"status": "purged", "done": True}  # finished tasks are deleted after their retention
    return {
        "id": str(task.id),  # a 64-bit id: as a JSON number JavaScript would round it
        "status": task.status,
        "stage": task.stage,
        "attempts": task.attempts,
        "pages_done": task.checkpoint or 0,
        "result": task.result,
        "message": task.status_msg,
        "done": task.status in FINAL,
    }


def word_count(request: HttpRequest) -> HttpResponse:
    """A form that enqueues a plain Django `@task` (demo.tasks.count_words) through Django's API."""
    form = WordCountForm(request.POST or None)
    if form.is_valid():
        result = count_words.enqueue(form.cleaned_data["text"])
        return redirect("demo:word_count_result", result_id=result.id)
    return render(request, "words/index.html", {"form": form})


def word_count_result(request: HttpRequest, result_id: str) -> HttpResponse:
    """The task's result as Django's get_result() shows it; the page reloads itself until it has finished."""
    try:
        result = count_words.get_result(result_id)
    except (TaskResultDoesNotExist, TaskResultMismatch):
        raise Http404("no such word count") from None
    return render(request, "words/result.html", {"result": result})
