"""Show minipaged's own code in a notebook, read from the package so that it never drifts.

``show(BlockAllocator.allocate)`` displays the source of a function, method, class or
Triton kernel with the file name and the file's own line numbers. The lines of a
``# BEGIN SOLUTION`` / ``# END SOLUTION`` region (the stage's key idea, what an exercise
asks for) are folded: in a notebook, or on the site, they open on a click ("show the
solution"); the plain text keeps the BEGIN and END lines and says how many lines it folds
(``.text`` holds them all). ``start`` and ``stop`` cut a piece out of a long body, so a
notebook can walk through a kernel one step at a time.

In an exercise workspace (a folder that ``minipaged exercise`` wrote, found from the
current directory up) the same call shows the learner's own file, even when the object
was imported from a minipaged installed elsewhere.
"""

from __future__ import annotations

import ast
import html
import inspect
from pathlib import Path

from minipaged.learn.exercise import BEGIN, END, find_workspace, solution_regions

SOLUTION_BACKGROUND = "#fff3c4"
SUMMARY_STYLE = "cursor:pointer;font-size:85%;color:#7a5b00;background:#fff3c4;padding:1px 6px"


class Source:
    """A piece of a source file; notebooks render it as highlighted HTML, solutions folded."""

    def __init__(self, path: Path, first_line: int, lines: list[str], solution: set[int]):
        self.path, self.first_line, self.lines, self.solution = path, first_line, lines, solution

    @property
    def text(self) -> str:
        """Every line, the solution's too."""
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

    def segments(self) -> list[tuple[bool, int, list[str]]]:
        """``(is_solution, first_line, lines)`` runs of consecutive lines, in order."""
        runs: list[tuple[bool, int, list[str]]] = []
        for number, line in enumerate(self.lines, start=self.first_line):
            folded = number in self.solution
            if runs and runs[-1][0] == folded:
                runs[-1][2].append(line)
            else:
                runs.append((folded, number, [line]))
        return runs

    def __repr__(self) -> str:
        out = [f"# {self.location}\n"]
        for folded, _, lines in self.segments():
            if not folded:
                out.extend(lines)
                continue
            head = lines[:1] if lines[0].strip().startswith(BEGIN) else []
            tail = lines[-1:] if len(lines) > len(head) and lines[-1].strip().startswith(END) else []
            inner = lines[len(head) : len(lines) - len(tail)]
            out.extend(head)
            if inner:
                indent = inner[0][: len(inner[0]) - len(inner[0].lstrip())]
                out.append(f"{indent}# ... {len(inner)} line(s) of the solution, folded (.text shows them)\n")
            out.extend(tail)
        return "".join(out)

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        pieces, any_folded = [], False
        for folded, first, lines in self.segments():
            formatter = HtmlFormatter(noclasses=True, style="friendly", linenos="inline",
                                      linenostart=first, nobackground=True,
                                      hl_lines=list(range(1, len(lines) + 1)) if folded else [])
            body = highlight("".join(lines), PythonLexer(), formatter)  # inline styles: no CSS needed
            body = body.replace(f"background-color: {formatter.style.highlight_color}",
                                f"background-color: {SOLUTION_BACKGROUND}")
            body = body.replace("<pre ", '<pre class="minipaged-source-code" ', 1)
            if folded:
                any_folded = True
                last = first + len(lines) - 1
                marker = lines[0].strip()
                hint = marker[len(BEGIN):].strip(" :-—") if marker.startswith(BEGIN) else ""
                hint = f": {html.escape(hint)}" if hint else ""
                body = (f'<details class="minipaged-solution"><summary style="{SUMMARY_STYLE}">'
                        f"show the solution (lines {first}–{last}){hint}</summary>{body}</details>")
            pieces.append(body)
        legend = " · folded: the stage's solution" if any_folded else ""
        return (
            '<div class="minipaged-source">'
            f'<div style="font-size:85%;color:#555;margin-bottom:2px">'
            f"<code>{html.escape(self.location)}</code>{legend}</div>{''.join(pieces)}</div>"
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


def _definition(path: Path, qualname: str) -> tuple[list[str], int]:
    """The lines and first line number of the class or function ``qualname`` in ``path``."""
    text = path.read_text()
    scope: list[ast.stmt] = ast.parse(text, str(path)).body
    node = None
    for name in qualname.split("."):
        node = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                       | ast.ClassDef) and n.name == name), None)
        if node is None:
            raise TypeError(f"{qualname} is not defined in {path}")
        scope = node.body
    assert node is not None  # a qualified name has at least one part
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return text.splitlines(keepends=True)[first - 1 : node.end_lineno], first


def _in_workspace(path: Path, target) -> tuple[Path, list[str], int] | None:
    """The learner's version of ``target`` when the current directory is in a workspace whose
    package is not where ``target`` came from; ``None`` otherwise."""
    workspace = find_workspace(Path.cwd())
    if workspace is None or "minipaged" not in path.parts:
        return None
    parts = path.resolve().parts
    package = len(parts) - 1 - parts[::-1].index("minipaged")
    own = workspace.resolve().joinpath(*parts[package:])
    if own == path.resolve() or not own.is_file():
        return None
    qualname = getattr(target, "__qualname__", "")
    if not qualname or "<" in qualname:
        raise TypeError(f"cannot find {target!r} in the workspace's {own}")
    lines, first_line = _definition(own, qualname)
    return own, lines, first_line


def show(obj, start: str | None = None, stop: str | None = None) -> Source:
    """The source of ``obj``, from the line holding ``start`` to the line holding ``stop``."""
    target = _unwrap(obj)
    try:
        lines, first_line = inspect.getsourcelines(target)
        source_file = inspect.getsourcefile(target)
        if source_file is None:
            raise TypeError("its source file is unknown")
        path = Path(source_file)
    except (TypeError, OSError) as err:
        raise TypeError(f"cannot show the source of {obj!r}: {err}") from err
    learners = _in_workspace(path, target)
    if learners is not None:
        path, lines, first_line = learners
    first, last = _cut(lines, start, stop)
    file_text = path.read_text()
    solution = {n for begin, end, _ in solution_regions(file_text, str(path))
                for n in range(begin, end + 1)}
    return Source(path, first_line + first, lines[first:last + 1], solution)
