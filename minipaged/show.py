"""Show minipaged's own code in a notebook, read from the package so that it never drifts.

``show(BlockAllocator.allocate)`` displays the source of a function, method, class or
Triton kernel with the file name and the file's own line numbers; the lines of a
``# BEGIN SOLUTION`` / ``# END SOLUTION`` region (the stage's key idea, what an exercise
asks for) are highlighted. ``start`` and ``stop`` cut a piece out of a long body, so a
notebook can walk through a kernel one step at a time. In an exercise workspace the
same call shows the learner's own code.
"""

from __future__ import annotations

import html
import inspect
from pathlib import Path

from minipaged.exercise import solution_regions

SOLUTION_BACKGROUND = "#fff3c4"


class Source:
    """A piece of a source file; notebooks render it as highlighted HTML."""

    def __init__(self, path: Path, first_line: int, lines: list[str], solution: set[int]):
        self.path, self.first_line, self.lines, self.solution = path, first_line, lines, solution

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def last_line(self) -> int:
        return self.first_line + len(self.lines) - 1

    @property
    def location(self) -> str:
        parts = self.path.parts  # from the package folder: the last "minipaged" (a clone is often one too)
        last = len(parts) - 1 - parts[::-1].index("minipaged") if "minipaged" in parts else len(parts) - 1
        shown = "/".join(parts[last:])
        return f"{shown}, lines {self.first_line}–{self.last_line}"

    def __repr__(self) -> str:
        return f"# {self.location}\n{self.text}"

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        marked = [n - self.first_line + 1 for n in sorted(self.solution)
                  if self.first_line <= n <= self.last_line]
        formatter = HtmlFormatter(noclasses=True, style="friendly", linenos="inline",
                                  linenostart=self.first_line, hl_lines=marked, nobackground=True)
        body = highlight(self.text, PythonLexer(), formatter)  # inline styles: no CSS needed
        body = body.replace(f"background-color: {formatter.style.highlight_color}",
                            f"background-color: {SOLUTION_BACKGROUND}")
        body = body.replace("<pre ", '<pre class="minipaged-source-code" ', 1)
        legend = " · highlighted: the stage's solution" if marked else ""
        return (
            '<div class="minipaged-source">'
            f'<div style="font-size:85%;color:#555;margin-bottom:2px">'
            f"<code>{html.escape(self.location)}</code>{legend}</div>{body}</div>"
        )


def _unwrap(obj):
    """The Python function behind a Triton kernel, a property or a bound method."""
    for attribute in ("fn", "fget", "__func__"):
        if hasattr(obj, attribute) and callable(getattr(obj, attribute)):
            return _unwrap(getattr(obj, attribute))
    return obj


def _cut(lines: list[str], start: str | None, stop: str | None) -> tuple[int, int]:
    """The 0-based ``[first, last]`` lines from the first holding ``start`` to the next holding ``stop``."""
    first = 0
    if start is not None:
        found = [i for i, line in enumerate(lines) if start in line]
        if not found:
            raise ValueError(f"no line holds start={start!r}")
        first = found[0]
    last = len(lines) - 1
    if stop is not None:
        found = [i for i, line in enumerate(lines) if i >= first and stop in line]
        if not found:
            raise ValueError(f"no line at or after the start holds stop={stop!r}")
        last = found[0]
    return first, last


def show(obj, start: str | None = None, stop: str | None = None) -> Source:
    """The source of ``obj``, from the line holding ``start`` to the line holding ``stop``."""
    target = _unwrap(obj)
    try:
        lines, first_line = inspect.getsourcelines(target)
        path = Path(inspect.getsourcefile(target))
    except (TypeError, OSError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from err
    first, last = _cut(lines, start, stop)
    file_text = path.read_text()
    solution = {n for begin, end, _ in solution_regions(file_text, str(path))
                for n in range(begin, end + 1)}
    return Source(path, first_line + first, lines[first:last + 1], solution)
