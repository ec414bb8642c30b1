"""Long-running processes: the worker (and its liveness thread) and the watcher (taskwatch).

They compose engine calls and own threads, signals and timing; no rule about a task lives here.
"""
