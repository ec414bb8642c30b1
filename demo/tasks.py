"""Demo handlers: what a project's tasks.py looks like."""

import random
import time

from django.tasks import task

import taskflow

from .models import Document


@taskflow.handler("demo.noop")
def noop(ctx):
    return None


@taskflow.handler("demo.resize_image")
def resize_image(ctx):
    time.sleep(random.uniform(0.05, 0.3))
    if random.random() < 0.2:
        raise RuntimeError("image service timed out")  # retried with back-off
    return {"width": ctx.payload.get("width", 640) // 2}


@taskflow.handler("demo.parse_document")
def parse_document(ctx):
    """A two-stage task: parse, then index, carrying data between stages in ctx.context."""
    if ctx.stage in ("", "parse"):
        pages = ctx.payload.get("pages", 3)
        for page in range((ctx.checkpoint or 0), pages):
            time.sleep(0.05)
            ctx.save_checkpoint(page + 1)
        ctx.next_stage("index", context={"pages": pages})
    return {"indexed_pages": ctx.context["pages"]}


@taskflow.handler("demo.notify")
def notify(ctx):
    """Shows the other endings: snooze once (not counted as an attempt), and fail without retrying."""
    if not ctx.payload.get("to"):
        ctx.fail("no recipient: retrying cannot help")
    if ctx.checkpoint is None:
        ctx.save_checkpoint("waited")
        ctx.snooze(2, "recipient's quiet hours")
    return {"sent_to": ctx.payload["to"]}


@taskflow.handler("demo.index_document")
def index_document(ctx):
    """The example form's task (demo/views.py): index an uploaded document page by page."""
    # The row exists: the view committed it in the same transaction as this task.
    document = Document.objects.get(pk=ctx.payload["document"])
    for page in range(ctx.checkpoint or 0, document.pages):
        time.sleep(0.3)  # stands in for the real work on one page
        ctx.save_checkpoint(page + 1)  # the progress the status page shows; a retry resumes here
    words = document.pages * 250
    # Delivery is at-least-once, so the write is one that does no harm when repeated.
    Document.objects.filter(pk=document.pk).update(words=words)
    return {"pages": document.pages, "words": words}


@task(max_retries=2, timeout=30)
def count_words(text: str) -> dict:
    """A plain Django task (`django.tasks`), run by taskflow since it is the project's TASKS backend."""
    words = text.split()
    return {"words": len(words), "longest": max(words, key=len, default="")}
