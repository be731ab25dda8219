"""MkDocs hooks: a site that needs nothing outside itself, and notebook pages joined to the rest.

* MathJax (from the ``jupyter-server-mathjax`` package) is copied into the site, so
  formulas render offline; ``docs/javascripts/mathjax-config.js`` configures it.
* Notebook pages lose the scripts nbconvert points at content-delivery networks (MathJax,
  mermaid, the Jupyter widget manager) and any embedded widget state: the site's own
  MathJax renders their formulas, and the tutorials draw no widgets.
* Each notebook page opens with a link to download the notebook. Links a notebook writes
  to a page's source (``../stages/1_block_allocator.md``) become links to the page.
  Notebook pages give the table of contents' room to the notebook.
* A notebook's outputs stay out of the search index: the search finds what its cells and text
  say, not the numbers a run printed. Those differ from run to run and from one CPU to
  another, and lunr (the search's engine) can break on some sets of numeric words, so an
  index without them is the same on every machine that builds the site.
* Everything fits the column (``docs/stylesheets/extra.css`` does the rest): each line of
  a code block or text output becomes a ``<span class="line">`` of its own, so that a line
  too long for the column wraps under its own indentation, marked as a continuation; names
  in table cells may break after ``_ . / ( ,``, never inside a word.
"""

from __future__ import annotations

import re
import shutil
from html import unescape
from pathlib import Path

import mkdocs.utils

SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.S | re.I)
EXTERNAL = re.compile(r"""["']https?://""", re.I)  # a quoted address: src="…", from "…", import("…")
# nbconvert's own MathJax set-up (the site's replaces it) and embedded widget state.
NOTEBOOK_SCRIPTS = ("text/x-mathjax-config", "widget-state+json", "widget-view+json")
OUTPUT_WRAPPER = re.compile(r'<div class="jp-Cell-outputWrapper"')
DIV = re.compile(r"<(/?)div\b[^>]*>", re.I)
MD_LINK = re.compile(r'href="(?!https?:|#|/)([^"#]+)\.md(#[^"]*)?"')
EMPTY_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=(\"\"|'')[^>]*>\s*</script>", re.I)
ALTERNATE = re.compile(r'<link rel="alternate" href="[^"]*" hreflang="[^"]*">\s*')
PRE = re.compile(r"(<pre\b[^>]*>)(.*?)(</pre>)", re.S | re.I)
CODE_CONTAINER = re.compile(r"^((?:\s*<span></span>)?\s*<code\b[^>]*>)(.*)(</code>\s*)$", re.S)
TAG = re.compile(r"(<[^>]+>)")
VOID = {"br", "wbr", "img", "hr", "input"}
# Pygments' inline line numbers: a span of digits with padding, where a line opens.
LINE_NUMBER = re.compile(r'<span (?:class="linenos"|style="[^"]*padding-left[^"]*")>(\s*\d+\s*)</span>')
TABLE = re.compile(r"<table\b.*?</table>", re.S | re.I)
CELL_CODE = re.compile(r"(<code\b[^>]*>)(.*?)(</code>)", re.S)
BREAK_AFTER = re.compile(r"([_./(,])(?=[^<>]*(?:<|$))(?!<wbr>)")


def _is_notebook(page) -> bool:
    return page.file.src_uri.endswith(".ipynb")


def _download_link(page) -> str:
    name = Path(page.file.src_uri).name
    return (f'<p class="minipaged-notebook-bar"><a href="{name}" download>Download this notebook '
            f"({name})</a> to run it in Jupyter, next to a clone of minipaged.</p>")


def _tag_name(tag: str) -> str:
    return re.match(r"</?\s*([A-Za-z0-9]+)", tag).group(1).lower()


def _text(html: str) -> str:
    return unescape(TAG.sub("", html))


def _lines(inner: str) -> str:
    """``inner`` (a ``<pre>``'s HTML) with each line in a ``<span class="line">``: the tags open
    at a line's end are closed there and opened again on the next line; ``--indent`` is the
    width the line's own indentation (and line number, if it opens with one) takes."""
    lines: list[list[str]] = [[]]
    open_tags: list[str] = []
    for token in TAG.split(inner):
        if token.startswith("<"):
            lines[-1].append(token)
            if token.startswith("</"):
                if open_tags:
                    open_tags.pop()
            elif not token.endswith("/>") and _tag_name(token) not in VOID:
                open_tags.append(token)
            continue
        for number, piece in enumerate(token.split("\n")):
            if number:
                lines[-1].append("\n" + "".join(f"</{_tag_name(t)}>" for t in reversed(open_tags)))
                lines.append(list(open_tags))
            if piece:
                lines[-1].append(piece)
    if len(lines) > 1 and not _text("".join(lines[-1])):  # after the last newline: tags only
        lines.pop()
    out = []
    for line in lines:
        html = "".join(line)
        text = _text(html).rstrip("\n")
        indent = f"{len(text) - len(text.lstrip())}ch"
        number = LINE_NUMBER.search(html)
        if number and not _text(html[:number.start()]):  # show()'s: 5 px of padding either side
            code = text[len(unescape(number.group(1))):]
            indent = f"calc({len(text) - len(code.lstrip())}ch + 10px)"
        out.append(f'<span class="line" style="--indent: {indent}">{html}</span>')
    return "".join(out)


def _wrap_lines(html: str) -> str:
    def wrap(match: re.Match) -> str:
        start, inner, end = match.groups()
        before = match.string[max(0, match.start() - 80):match.start()]
        if 'class="line"' in inner or "linenodiv" in before or '<td class="code">' in before:
            return match.group(0)  # done, or a numbered listing whose numbers sit beside it
        if container := CODE_CONTAINER.match(inner):
            inner = container.group(1) + _lines(container.group(2)) + container.group(3)
        else:
            inner = _lines(inner)
        return start + inner + end

    return PRE.sub(wrap, html)


def _breakable_names(html: str) -> str:
    def cell_code(match: re.Match) -> str:
        start, inner, end = match.groups()
        return start + BREAK_AFTER.sub(r"\1<wbr>", inner) + end

    return TABLE.sub(lambda table: CELL_CODE.sub(cell_code, table.group(0)), html)


CJK = "\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef"  # CJK punctuation, ideographs, full-width forms
INLINE_TAGS = r"(?:</?(?:a|em|strong|span|b|i|sup|sub|mark|abbr|small)\b[^>]*>)*"
CJK_SPACE = re.compile(rf"(?<=[{CJK}])({INLINE_TAGS})\s+({INLINE_TAGS})(?=[{CJK}])")
VERBATIM = re.compile(r"(<(pre|code|script|style)\b.*?</\2>)", re.S)


def close_cjk_spaces(html: str) -> str:
    """The whitespace between two CJK characters in prose removed, across inline tags too (a link's
    text and the word after it). Chinese sources are wrapped where an English line would be, and a
    browser shows each line break as a space, which Chinese puts between no two characters.
    ``pre``, ``code``, ``script`` and ``style`` are kept as they are."""
    parts = VERBATIM.split(html)  # text, verbatim element, its tag's name, text, ...
    return "".join(CJK_SPACE.sub(r"\1\2", part) if i % 3 == 0 else part
                   for i, part in enumerate(parts) if i % 3 != 2)


def _is_chinese(page) -> bool:
    return any(str(path).endswith(".zh.md") for path in (page.file.src_uri, page.file.abs_src_path or ""))


def _outputs_out_of_search(html: str) -> str:
    """Each cell's outputs become a ``<section data-search-exclude>``. The search plugin skips a
    marked element only until the first element of the same tag inside it closes, and an
    output's wrapper holds other ``div``s; it holds no ``section``."""
    start = OUTPUT_WRAPPER.search(html)
    if start is None:
        return html
    depth = 0
    for tag in DIV.finditer(html, start.start()):
        depth += -1 if tag.group(1) else 1
        if depth == 0:
            opened = '<section class="jp-Cell-outputWrapper" data-search-exclude'
            inside = html[start.end():tag.start()]  # the wrapper's attributes' end, and what it holds
            rest = html[tag.end():]
            return html[:start.start()] + opened + inside + "</section>" + _outputs_out_of_search(rest)
    raise ValueError("a notebook output's <div> is never closed")


def on_page_content(html: str, page, config, files):
    html = _breakable_names(close_cjk_spaces(html) if _is_chinese(page) else html)
    if not _is_notebook(page):
        return html
    page.meta.setdefault("hide", []).append("toc")
    html = MD_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', html)
    html = _outputs_out_of_search(html)
    return _download_link(page) + html


def on_post_page(output: str, page, config):
    # The theme reads a sitemap.xml beside each <link rel="alternate"> it finds, taking them for
    # the roots of the languages; here they are the page's other versions, where there is none.
    # The language switcher's links already lead to the page's other version.
    output = ALTERNATE.sub("", output)
    output = _wrap_lines(EMPTY_SCRIPT.sub("", output))
    if not _is_notebook(page):
        return output

    def keep(match: re.Match) -> str:
        script = match.group(0)
        if EXTERNAL.search(script) or any(kind in script for kind in NOTEBOOK_SCRIPTS):
            return ""
        return script

    return SCRIPT.sub(keep, output)


def on_config(config):
    # Notebooks are pages (mkdocs-jupyter renders them), but the i18n plugin rebuilds each file
    # as a plain File, which calls only Markdown files pages: it would copy a notebook's JSON
    # to the page's place. Counted as pages, they are rendered in each language, in English.
    if ".ipynb" not in mkdocs.utils.markdown_extensions:
        mkdocs.utils.markdown_extensions = (*mkdocs.utils.markdown_extensions, ".ipynb")
    return config


def on_post_build(config):
    import jupyter_server_mathjax

    site = Path(config["site_dir"])
    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(source, site / "assets" / "mathjax", dirs_exist_ok=True)
    # A sitemap lists absolute addresses; without a site_url the theme writes "None" in front of
    # every path. The site is read from a folder or a local server, so it has none to give.
    if not config.get("site_url"):
        for sitemap in (*site.glob("sitemap.xml*"), *site.glob("*/sitemap.xml*")):
            sitemap.unlink()
