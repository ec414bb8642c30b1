"""Long-running processes: the worker (and its liveness thread) and the watcher (taskwatch).

`supervision` keeps their loops alive (or stops the process when one cannot go on) and
`connections` replaces database connections the server dropped.

They compose engine calls and own threads, signals and timing; no rule about a task lives here.
"""
