"""A griffe extension that adapts lossscale's docstrings for the Google-style parser.

The docstrings are Google style with a few reST habits. Before mkdocstrings parses them, this
extension rewrites, in the docs build only (the sources are not touched):

* ``:class:`X```, ``:func:`X```, ``:meth:`X```, ``:mod:`X```, ``:attr:`X``` -> a code span that
  links to ``X`` when ``X`` (resolved in the scope of the documented object) is rendered
  somewhere in the site; an optional cross-reference, so a target that is not rendered is
  plain code and never a warning;
* ``text::`` followed by an indented block -> ``text:`` and a fenced code block;
* ``Example:`` -> ``Examples:`` (griffe's name for the section whose ``>>>`` lines it renders
  as code);
* a ``>>>`` session anywhere else (after "For example, ...:" in the text) -> a fenced ``pycon``
  block: Markdown would read ``>>>`` as three nested blockquotes and run the lines together
  (``docs/_hooks.py`` fails the build if that ever reaches a page);
* ``a, b, c: description`` in an ``Args:`` section -> one entry per name (griffe reads one name
  per entry and would warn that ``a, b, c`` is not a parameter).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|obj|exc):`~?([A-Za-z_][\w.]*)`")
_SECTION = re.compile(r"^(\s*)([A-Z][\w ]*):\s*$")
_GROUPED_ARG = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+):\s*(.*)$")


def _resolve(obj: griffe.Object, target: str) -> str | None:
    if target.split(".", 1)[0] == "lossscale":
        return target
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError, ValueError):
        return None
    return f"{path}.{rest}" if rest else path


def _link_roles(text: str, obj: griffe.Object) -> str:
    def one(match: re.Match[str]) -> str:
        target = match.group(1)
        path = _resolve(obj, target)
        if path is None:
            return f"`{target}`"
        return f'<autoref identifier="{path}" optional><code>{target}</code></autoref>'

    return _ROLE.sub(one, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence_literal_blocks(lines: list[str]) -> list[str]:
    """``text::`` + an indented block -> ``text:`` + a fenced ``python`` block."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        out.append(line.rstrip()[:-1])
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        block_end = j
        while block_end < len(lines) and (
            not lines[block_end].strip() or _indent(lines[block_end]) > base
        ):
            block_end += 1
        block = lines[j:block_end]
        while block and not block[-1].strip():
            block.pop()
        if not block:
            i += 1
            continue
        depth = min(_indent(b) for b in block if b.strip())
        pad = " " * base
        out.append("")
        out.append(f"{pad}```python")
        out.extend(pad + b[depth:] if b.strip() else "" for b in block)
        out.append(f"{pad}```")
        out.append("")
        i = block_end
    return out


def _fence_sessions(lines: list[str]) -> list[str]:
    """A ``>>>`` session outside an ``Examples:`` section -> a fenced ``pycon`` block (the
    session and its output lines, up to the next blank line)."""
    out: list[str] = []
    in_examples, section_indent = False, 0
    i = 0
    while i < len(lines):
        line = lines[i]
        section = _SECTION.match(line)
        if section:
            in_examples = section.group(2) == "Examples"
            section_indent = len(section.group(1))
        elif (
            line.strip() and _indent(line) <= section_indent and not line.lstrip().startswith(">>>")
        ):
            in_examples = in_examples and _indent(line) > section_indent
        if in_examples or not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        pad = " " * _indent(line)
        end = i
        while end < len(lines) and lines[end].strip():
            end += 1
        out.extend(["", f"{pad}```pycon"])
        out.extend(pad + b[len(pad) :] if b.startswith(pad) else b for b in lines[i:end])
        out.extend([f"{pad}```", ""])
        i = end
    return out


def _split_grouped_args(lines: list[str]) -> list[str]:
    """``a, b: desc`` (and its continuation lines) in an Args section -> one entry per name."""
    out: list[str] = []
    in_args = False
    section_indent = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        section = _SECTION.match(line)
        if section:
            in_args = section.group(2) in {"Args", "Arguments", "Parameters", "Params"}
            section_indent = len(section.group(1))
            out.append(line)
            continue
        if line.strip() and _indent(line) <= section_indent:
            in_args = False
        grouped = _GROUPED_ARG.match(line) if in_args else None
        if grouped is None:
            out.append(line)
            continue
        indent, names, description = grouped.groups()
        continuation = []
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > len(indent):
            continuation.append(lines[i])
            i += 1
        for name in names.split(","):
            out.append(f"{indent}{name.strip()}: {description}")
            out.extend(continuation)
    return out


def rewrite(text: str, obj: griffe.Object) -> str:
    """The docstring ``text`` of ``obj``, rewritten as described in the module docstring."""
    lines = text.splitlines()
    lines = [re.sub(r"^(\s*)Example:\s*$", r"\1Examples:", line) for line in lines]
    lines = _split_grouped_args(lines)
    lines = _fence_literal_blocks(lines)
    lines = _fence_sessions(lines)
    return _link_roles("\n".join(lines), obj)


class LossscaleDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is fully loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._visit(pkg, set())

    def _visit(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value, obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member, seen)  # type: ignore[arg-type]
