"""The HTTP API (Django REST framework): producers create tasks, remote workers hold and report them.

Every view validates its input with a serializer and calls the engine; the views set their own
authentication, permissions, parsers and error handler, so the API is equally strict in any project
that mounts `taskflow.api.urls`. See docs/api.md.
"""
