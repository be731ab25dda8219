"""MkDocs hooks: a site that needs nothing outside itself, and notebook pages joined to the rest.

* MathJax (from the ``jupyter-server-mathjax`` package) is copied into the site, so
  formulas render offline; ``docs/javascripts/mathjax-config.js`` configures it.
* Notebook pages lose the scripts nbconvert points at content-delivery networks (MathJax,
  mermaid, the Jupyter widget manager) and any embedded widget state: the site's own
  MathJax renders their formulas, and the tutorials draw no widgets.
* Each notebook page opens with a link to download the notebook. Links a notebook writes
  to a page's source (``../stages/1_block_allocator.md``) become links to the page.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

SCRIPT = re.compile(r"<script\b[^>]*>.*?</script>", re.S | re.I)
EXTERNAL = re.compile(r"""["']https?://""", re.I)  # a quoted address: src="…", from "…", import("…")
# nbconvert's own MathJax set-up (the site's replaces it) and embedded widget state.
NOTEBOOK_SCRIPTS = ("text/x-mathjax-config", "widget-state+json", "widget-view+json")
MD_LINK = re.compile(r'href="(?!https?:|#|/)([^"#]+)\.md(#[^"]*)?"')


def _is_notebook(page) -> bool:
    return page.file.src_uri.endswith(".ipynb")


def _download_link(page) -> str:
    name = Path(page.file.src_uri).name
    return (f'<p class="minipaged-notebook-bar"><a href="{name}" download>Download this notebook '
            f"({name})</a> to run it in Jupyter, next to a clone of minipaged.</p>")


def on_page_content(html: str, page, config, files):
    if not _is_notebook(page):
        return html
    html = MD_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', html)
    return _download_link(page) + html


def on_post_page(output: str, page, config):
    if not _is_notebook(page):
        return output

    def keep(match: re.Match) -> str:
        script = match.group(0)
        if EXTERNAL.search(script) or any(kind in script for kind in NOTEBOOK_SCRIPTS):
            return ""
        return script

    return SCRIPT.sub(keep, output)


def on_post_build(config):
    import jupyter_server_mathjax

    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(source, Path(config["site_dir"]) / "assets" / "mathjax", dirs_exist_ok=True)
