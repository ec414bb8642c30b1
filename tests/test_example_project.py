"""The example project's pages (demo/views.py, templates/): enqueueing from a view, and a task's live status."""

import pytest
from django.db import DatabaseError
from django.urls import reverse

import taskflow
from demo.models import Document
from taskflow.models import Status, Task
from taskflow.runtime.worker import Worker


@pytest.mark.django_db
def test_the_form_saves_the_document_and_enqueues_its_task(client):
    page = client.get(reverse("demo:documents"))
    assert page.status_code == 200
    assert b'name="pages"' in page.content

    response = client.post(reverse("demo:documents"), {"name": "Annual report", "pages": 3})

    document = Document.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("demo:document", args=[document.pk])
    task = Task.objects.get(pk=document.task_id)
    assert (task.task_type, task.key, task.payload, task.status) == (
        "demo.index_document",
        f"document-{document.pk}",
        {"document": document.pk},
        Status.PENDING,
    )


@pytest.mark.django_db
def test_an_invalid_form_writes_nothing(client):
    response = client.post(reverse("demo:documents"), {"name": "Empty", "pages": 0})

    assert response.status_code == 200
    assert response.context["form"].errors["pages"]
    assert not Document.objects.exists()
    assert not Task.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_failure_after_enqueue_leaves_neither_document_nor_task(client, monkeypatch):
    """The view's atomic block is the real (outermost) transaction here, as in production."""
    real_enqueue = taskflow.enqueue
    enqueued = []

    def enqueue_then_fail(*args, **kwargs):
        task = real_enqueue(*args, **kwargs)
        enqueued.append(task.pk)
        assert Task.objects.filter(pk=task.pk).exists()  # written in the view's transaction...
        raise DatabaseError("the next write of the request failed")

    monkeypatch.setattr(taskflow, "enqueue", enqueue_then_fail)

    with pytest.raises(DatabaseError):
        client.post(reverse("demo:documents"), {"name": "Doomed", "pages": 2})

    assert len(enqueued) == 1
    assert not Task.objects.exists()  # ...and rolled back with the document
    assert not Document.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_status_page_follows_the_task_to_its_result(client):
    client.post(reverse("demo:documents"), {"name": "Memo", "pages": 1})
    document = Document.objects.get()
    status_url = reverse("demo:document_status", args=[document.pk])

    page = client.get(document.get_absolute_url())
    assert page.status_code == 200
    assert page.context["task"]["status"] == Status.PENDING
    assert status_url.encode() in page.content  # the page polls the endpoint while the task runs
    assert client.get(status_url).json() == {
        "id": str(document.task_id),
        "status": "pending",
        "stage": "",
        "attempts": 0,
        "pages_done": 0,
        "result": None,
        "message": "",
        "done": False,
    }

    Worker(["demo.index_document"], concurrency=1, burst=True).run()

    status = client.get(status_url).json()
    assert (status["status"], status["attempts"], status["pages_done"], status["done"]) == ("success", 1, 1, True)
    assert status["result"] == {"pages": 1, "words": 250}
    page = client.get(document.get_absolute_url())
    assert page.context["task"]["status"] == Status.SUCCESS
    assert b"success" in page.content
    assert b'"result": {"pages": 1, "words": 250}' in page.content  # the data the page's script shows
    document.refresh_from_db()
    assert document.words == 250  # the handler updated the business row too


@pytest.mark.django_db
def test_the_status_of_a_purged_task(client):
    client.post(reverse("demo:documents"), {"name": "Old", "pages": 1})
    document = Document.objects.get()
    Task.objects.filter(pk=document.task_id).delete()  # as the watcher's purge does after retention

    assert client.get(reverse("demo:document_status", args=[document.pk])).json() == {"status": "purged", "done": True}
    assert client.get(document.get_absolute_url()).status_code == 200


@pytest.mark.django_db
def test_an_unknown_document_is_404(client):
    assert client.get(reverse("demo:document", args=[404])).status_code == 404
    assert client.get(reverse("demo:document_status", args=[404])).status_code == 404
