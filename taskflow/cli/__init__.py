"""The operator's command line, `manage.py taskflow <subcommand>` (docs/cli.md).

The management command only parses; these modules turn options into the engine's filters and
operations (`selection.py`, `operating.py`), read what an operator looks at (`reading.py`), print
it as an aligned table or JSON (`output.py`), and supervise workers and the watcher (`supervisor.py`).
"""
