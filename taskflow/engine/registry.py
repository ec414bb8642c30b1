"""Task handlers: `@taskflow.handler("type")` registers a function for a task type."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from ..exceptions import UnknownTaskType
from .validation import validate_task_type

Handler = Callable[..., Any]
# The decorated function keeps its own type, so a type checker still sees what it returns.
H = TypeVar("H", bound=Handler)
_handlers: dict[str, Handler] = {}


def handler(task_type: str) -> Callable[[H], H]:
    """Register the decorated function as the handler of `task_type`; it receives a TaskContext."""
    validate_task_type(task_type)

    def register(fn: H) -> H:
        existing = _handlers.get(task_type)
        if existing is not None and existing is not fn and _qualname(existing) != _qualname(fn):
            raise ValueError(f"task type {task_type!r} already has a handler: {_qualname(existing)}")
        _handlers[task_type] = fn
        return fn

    return register


def get_handler(task_type: str) -> Handler:
    try:
        return _handlers[task_type]
    except KeyError:
        raise UnknownTaskType(f"no handler registered for task type {task_type!r}") from None


def registered_types() -> list[str]:
    return sorted(_handlers)


def _qualname(fn: Handler) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def is_async(task_type: str) -> bool:
    """Whether the handler of `task_type` is an `async def` function (run on the worker's event loop)."""
    return inspect.iscoroutinefunction(get_handler(task_type))
