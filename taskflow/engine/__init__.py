"""The domain engine: enqueueing, claiming, the state machine, reports and every rule about a task.

It knows nothing of the web: the admin, the API, the worker and the watcher call it; none of them
writes a task row itself.
"""
