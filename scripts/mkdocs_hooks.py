"""mkdocs hook (mkdocs.yml `hooks:`): flowkit's docstrings cross-reference in Sphinx's roles (``:class:`~a.B```),
which mkdocstrings prints as written; on the rendered API page each becomes the code span it names, shortened to
the last name under ``~`` as Sphinx does."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(<code>)(~?)([\w.]+)(</code>)")


def _shorten(match: re.Match) -> str:
    name = match.group(3).rpartition(".")[2] if match.group(2) else match.group(3)
    return f"{match.group(1)}{name}{match.group(4)}"


def on_page_content(html: str, **_) -> str:
    return ROLE.sub(_shorten, html)
