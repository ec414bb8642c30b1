"""MkDocs hooks (mkdocs.yml): README.md is the site's home page and CHANGELOG.md its changelog, and
links that leave docs/ for other repository files are checked, then shown as the file's path.

MkDocs validates links between pages itself (strict: a broken one fails the build). A link to a
repository file that is not a page (`../bench/README.md`, `demo/tasks.py` from the README) has no
page to go to on the site: it must name a file that exists (else the build fails), and it becomes
that path in code type, or a link into the repository when `repo_url` is set.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parent.parent
# The pages whose text lives outside docs/, as the site shows them: (repository file, page).
OUTSIDE = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
# [text](target) with a relative target (no scheme, not only an anchor).
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>(?![a-z][a-z0-9+.-]*:|#)[^)\s]+)\)")


def on_files(files: Files, config: Any) -> Files:
    for source, page in OUTSIDE.items():
        files.append(File.generated(config, page, abs_src_path=str(REPO / source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    repo_path = _repository_path(page.file.src_uri)
    here = posixpath.dirname(repo_path)
    code = _fenced_blocks(markdown)

    def rewrite(match: re.Match[str]) -> str:
        if any(start <= match.start() < end for start, end in code):
            return match.group(0)
        target, _, anchor = match.group("target").partition("#")
        path = posixpath.normpath(posixpath.join(here, target))
        if path.startswith("docs/"):
            # A page: link to it from where this page sits on the site (MkDocs checks it).
            relative = posixpath.relpath(path[len("docs/") :], posixpath.dirname(page.file.src_uri) or ".")
            return f"[{match.group('text')}]({relative}{'#' + anchor if anchor else ''})"
        if path in OUTSIDE:
            relative = posixpath.relpath(OUTSIDE[path], posixpath.dirname(page.file.src_uri) or ".")
            return f"[{match.group('text')}]({relative}{'#' + anchor if anchor else ''})"
        if path.startswith("../") or not (REPO / path).exists():
            raise PluginError(f"{repo_path}: the link to {match.group('target')!r} names no file of the repository")
        if config.get("repo_url"):
            return f"[{match.group('text')}]({config['repo_url'].rstrip('/')}/blob/main/{path})"
        return f"{match.group('text')} (`{path}`)" if match.group("text").strip("`") != path else f"`{path}`"

    return LINK.sub(rewrite, markdown)


def _repository_path(src_uri: str) -> str:
    """Where a page's text lives in the repository."""
    for source, page in OUTSIDE.items():
        if src_uri == page:
            return source
    return f"docs/{src_uri}"


def _fenced_blocks(markdown: str) -> list[tuple[int, int]]:
    """Spans of fenced code blocks, whose text is shown as it is."""
    spans, start = [], None
    for match in re.finditer(r"^ {0,3}(```|~~~).*$", markdown, flags=re.MULTILINE):
        if start is None:
            start = match.start()
        else:
            spans.append((start, match.end()))
            start = None
    return spans
