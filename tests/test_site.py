"""The documentation site stands alone: every page works offline, in a real browser.

The tests marked ``docs`` need the built site (``make docs-build`` runs them); the others
read the sources and run with every other test. Beyond staying offline, the site keeps to
the learner's path (footers: stage page, tutorial, exercise, next stage), fits the column at
1280 px, and is built in English and in Chinese (under ``zh/``), each page one click from
its other version, search finding pages in both.

The site is ``$MINIPAGED_SITE`` when set (``make test`` builds it with the executed
notebooks first), otherwise it is built here. Two checks:

* every page and stylesheet is read, and any resource it loads from outside the site
  (a script, stylesheet, font, image or frame with an address of its own) fails the test,
  as does a local resource that is missing;
* headless Chromium opens pages from a local server with every other host unreachable,
  records every request the pages make, and checks that formulas were typeset by the
  site's own MathJax and that every image loaded.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

docs = pytest.mark.docs  # needs the built site

ROOT = Path(__file__).resolve().parent.parent
ABSOLUTE = re.compile(r"^(https?:)?//", re.I)
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")]+)['"]?\s*\)|@import\s+['"]([^'"]+)['"]""", re.I)
RESOURCE_ATTRIBUTES = {  # tag: the attributes that make the browser fetch something
    "script": ("src",), "link": ("href",), "img": ("src", "srcset"), "source": ("src", "srcset"),
    "iframe": ("src",), "video": ("src", "poster"), "audio": ("src",), "embed": ("src",),
    "object": ("data",), "input": ("src",),
}
NOT_FETCHED = {"canonical", "alternate", "next", "prev", "author", "license", "me"}


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    if os.environ.get("MINIPAGED_SITE"):
        site = Path(os.environ["MINIPAGED_SITE"])
        assert (site / "index.html").is_file(), f"no built site at {site}"
        return site
    tutorials = ROOT / "docs" / "tutorials"  # what `make docs-build` puts there
    if not any(tutorials.glob("*.ipynb")):
        tutorials.mkdir(parents=True, exist_ok=True)
        for notebook in (ROOT / "tutorials").glob("*.ipynb"):
            shutil.copy2(notebook, tutorials / notebook.name)
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
                   cwd=ROOT, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    return site


class _Resources(HTMLParser):
    """The addresses a page makes the browser fetch: attributes, inline styles, module imports."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self._in_script = self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        rel = set((attrs.get("rel") or "").lower().split())
        fetched = not (tag == "link" and rel and rel <= NOT_FETCHED)
        for name in RESOURCE_ATTRIBUTES.get(tag, ()) if fetched else ():
            if (value := attrs.get(name)) is not None:  # an empty address loads the page again
                parts = value.split(",") if name == "srcset" else [value]
                self.found += [part.strip().split(" ")[0] for part in parts]
        if attrs.get("style"):
            self.found += [a or b for a, b in CSS_URL.findall(attrs["style"])]
        self._in_script, self._in_style = tag == "script", tag == "style"

    def handle_endtag(self, tag):
        self._in_script = self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self.found += [a or b for a, b in CSS_URL.findall(data)]
        if self._in_script:  # `import x from "https://..."`, `import("https://...")`
            self.found += re.findall(r"""(?:from|import\s*\()\s*["']((?:https?:)?//[^"']+)""", data)


def _local_target(site: Path, page: Path, address: str) -> Path | None:
    path = urlparse(address).path
    if not path or address.startswith(("data:", "#", "blob:")):
        return None
    return (site / path.lstrip("/")) if path.startswith("/") else (page.parent / path)


@docs
def test_no_page_or_stylesheet_loads_anything_from_outside_the_site(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= 30, "the site is missing pages"
    outside, missing = [], []
    for page in pages:  # 404.html's root-relative addresses are read from the site's root
        html = page.read_text(encoding="utf-8")
        parser = _Resources()
        parser.feed(html)
        for address in parser.found:
            if not address:
                missing.append(f"{page.relative_to(site)}: an empty address")
            elif ABSOLUTE.match(address):
                outside.append(f"{page.relative_to(site)}: {address}")
            elif (target := _local_target(site, page, address)) and not target.exists():
                missing.append(f"{page.relative_to(site)}: {address}")
        if 'class="mermaid"' in html:  # the theme would fetch mermaid
            outside.append(f"{page.relative_to(site)}: a mermaid diagram")
    for sheet in site.rglob("*.css"):
        for a, b in CSS_URL.findall(sheet.read_text(encoding="utf-8")):
            if ABSOLUTE.match(a or b):
                outside.append(f"{sheet.relative_to(site)}: {a or b}")
    assert not outside, "resources from outside the site:\n" + "\n".join(outside)
    assert not missing, "resources missing from the site:\n" + "\n".join(missing)


@docs
def test_no_file_of_the_site_names_an_address_it_does_not_have(site):
    """Without a site_url there is no absolute address to give: no sitemap saying "None…"."""
    unset = re.compile(r"""<loc>None|(?:href|src|content)=["']None""")
    for path in (*site.rglob("*.html"), *site.rglob("*.xml")):
        assert not unset.search(path.read_text(encoding="utf-8")), path.relative_to(site)


def test_the_check_finds_what_it_looks_for():
    parser = _Resources()
    parser.feed('<link rel="stylesheet" href="https://fonts.example/css"><img srcset="a.png 1x, '
                '//cdn.example/b.png 2x"><script type="module">import m from "https://cdn.example/m.js"'
                '</script><div style="background: url(https://x.example/i.png)"></div>'
                '<link rel="canonical" href="https://example.org/"><script src=""> </script>')
    assert "" in parser.found
    assert [a for a in parser.found if ABSOLUTE.match(a)] == [
        "https://fonts.example/css", "//cdn.example/b.png", "https://cdn.example/m.js",
        "https://x.example/i.png"]


LANGUAGES = {"en": "", "zh": "zh/"}  # each language's folder in the site


@docs
@pytest.mark.parametrize("language", LANGUAGES)
def test_notebook_pages_can_be_downloaded_and_link_to_their_stage_and_exercise(site, language):
    site = site / LANGUAGES[language]  # the Chinese site shows the English notebooks
    notebooks = sorted((site / "tutorials").glob("*.html"))
    assert len(notebooks) == len(list((ROOT / "tutorials").glob("*.ipynb")))
    for page in notebooks:
        html = page.read_text(encoding="utf-8")
        name = page.stem
        assert (site / "tutorials" / f"{name}.ipynb").is_file()
        assert f'href="{name}.ipynb" download' in html
        if not name[:2].isdigit():  # the serving tutorial: no stage of its own
            continue
        number = int(name[:2])
        stage = re.search(rf'href="\.\./stages/({number}_\w+)\.html"', html)
        assert stage and (site / "stages" / f"{stage.group(1)}.html").is_file(), name
        assert f'href="../exercises/stage{number}.html"' in html, name
        assert (site / "exercises" / f"stage{number}.html").is_file()
        stage_page = (site / "stages" / f"{stage.group(1)}.html").read_text(encoding="utf-8")
        assert f"../tutorials/{name}.html" in stage_page  # and back
        assert f"../exercises/stage{number}.html" in stage_page


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromium-driver (make installs them where it can)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,900",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):  # offline but for us
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    yield driver
    driver.quit()


def _requests(browser) -> list[str]:
    urls = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


# A page of each kind: prose with formulas, a notebook with formulas and figures, the home page.
PAGES_WITH_MATH = ["stages/5_triton_attention.html", "tutorials/05_triton_kernel.html",
                   "zh/stages/5_triton_attention.html", "zh/tutorials/05_triton_kernel.html"]
PAGES = ["index.html", *PAGES_WITH_MATH, "tutorials/09_prefix_caching.html", "stages/1_block_allocator.html",
         "zh/index.html", "zh/glossary.html"]


@docs
@pytest.mark.parametrize("page", PAGES)
def test_pages_render_in_a_browser_that_cannot_reach_the_internet(page, served, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("performance")  # forget earlier pages
    browser.get(urljoin(served + "/", page))
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    wait.until(lambda b: b.execute_script("return document.readyState") == "complete")
    if page in PAGES_WITH_MATH:
        wait.until(lambda b: b.execute_script(
            "return window.MathJax && MathJax.Hub && MathJax.Hub.queue.pending === 0 "
            "&& document.querySelectorAll('.MathJax').length > 0"))
        errors = browser.execute_script("return [...document.querySelectorAll('.MathJax .noError, "
                                        ".MathJax .merror')].map(e => e.textContent)")
        assert not errors, f"formulas MathJax could not typeset: {errors[:3]}"
        leftover = browser.execute_script(
            "return [...document.querySelectorAll('.arithmatex')].filter("
            "e => !e.querySelector('.MathJax')).map(e => e.textContent)")
        assert not leftover, f"formulas left as source: {leftover[:3]}"
    broken = browser.execute_script(
        "return [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
    assert not broken, f"images that did not load: {broken}"
    outside = [url for url in _requests(browser) if not url.startswith((served, "data:", "blob:", "about:"))]
    assert not outside, f"{page} asked for {outside}"


@docs
def test_a_page_opened_from_the_folder_shows_its_figures_and_links_to_files(site, browser):
    browser.get((site / "stages" / "1_block_allocator.html").resolve().as_uri())
    images = browser.execute_script("return [...document.images].map(i => i.naturalWidth)")
    assert images and all(width > 0 for width in images)
    links = browser.execute_script(
        "return [...document.querySelectorAll('nav a.md-nav__link[href]')].map(a => a.href)")
    pages = [link for link in links if link.startswith("file:") and "#" not in link]
    assert pages and all(link.endswith(".html") for link in pages), pages[:5]


# ---------------------------------------------------------------------------------------------
# One test command everywhere: `pytest -k stageN`. A page, notebook or message that picks a
# stage's tests by marker (`pytest -m stage3`) shows a second way to do one thing.

PYTEST_COMMAND = re.compile(r"pytest\b[^\n`]*")
BY_MARKER = re.compile(r"""\s(?:-m|--markexpr)[\s=]*["']?[^"'\n`]*?\b(stage\d+|serving|tooling)\b""")


def _other_test_commands(text: str) -> list[str]:
    """The pytest command lines in ``text`` that select tests by marker rather than with -k."""
    return [command.group(0).strip() for command in PYTEST_COMMAND.finditer(text)
            if BY_MARKER.search(command.group(0))]


def _shown_texts() -> dict[str, str]:
    """Every text a learner reads: pages (both languages), the README, notebook cells, messages."""
    texts = {}
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md"))  # docs/tutorials: notebook copies
             if "tutorials" not in p.relative_to(ROOT / "docs").parts]
    for path in [ROOT / "README.md", *pages]:
        texts[str(path.relative_to(ROOT))] = path.read_text(encoding="utf-8")
    for notebook in sorted((ROOT / "tutorials").glob("*.ipynb")):
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        for number, cell in enumerate(cells):
            source = cell["source"]
            texts[f"{notebook.relative_to(ROOT)} cell {number}"] = (
                source if isinstance(source, str) else "".join(source))
    for module in sorted((ROOT / "minipaged").rglob("*.py")):
        texts[str(module.relative_to(ROOT))] = module.read_text(encoding="utf-8")
    return texts


def test_the_test_command_check_finds_marker_selections():
    assert _other_test_commands("run `pytest -m stage3`, then `python -m pytest -k stage3`") == [
        "pytest -m stage3"]
    assert _other_test_commands('pytest -q -m "stage6 and not gpu"\npytest --markexpr=serving') == [
        'pytest -q -m "stage6 and not gpu"', "pytest --markexpr=serving"]
    assert _other_test_commands('cd ex0 && pytest -k stage0\n`pytest -k "stage6 and rule_"`') == []


def test_the_test_command_selects_one_stage_and_no_stage_whose_number_begins_alike():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-k", "stage1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert any("test_stage1_block_allocator.py::" in test for test in selected), done.stdout[-2000:]
    assert all(re.search(r"stage1(?!\d)", test) for test in selected), selected
    if list((ROOT / "tests").glob("test_stage1[0-9]_*.py")):  # stage 10 exists: it must not be picked
        assert not [test for test in selected if re.search(r"stage1\d", test)]


def test_every_page_notebook_and_message_shows_one_test_command():
    texts = _shown_texts()
    assert any(name.startswith("tutorials/") for name in texts) and "README.md" in texts
    others = [f"{name}: {command}" for name, text in texts.items()
              for command in _other_test_commands(text)]
    assert not others, "use `pytest -k stageN`:\n" + "\n".join(others)
    stage_pages = [p for p in (ROOT / "docs" / "stages").glob("*.md") if not p.name.endswith(".zh.md")]
    assert len(stage_pages) >= 10
    for stage_page in stage_pages:  # and each stage's page and exercise show the command for it
        number = int(stage_page.name.split("_")[0])
        for page in (stage_page, ROOT / "docs" / "exercises" / f"stage{number}.md"):
            assert re.search(rf"pytest -k \"?stage{number}\b", page.read_text(encoding="utf-8")), page


# ---------------------------------------------------------------------------------------------
# The learner's path: stage N's page, tutorial N, exercise N, then stage N + 1; after stage 9's
# exercise, the serving tutorial and the serving page; stages 10, 11 and 12; then the benchmarks. The
# footers follow it.

class _FooterLinks(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for direction in ("prev", "next"):
            if tag == "a" and f"md-footer__link--{direction}" in (attrs.get("class") or ""):
                self.links[direction] = attrs["href"]


def _footer(site: Path, page: str) -> dict[str, str]:
    parser = _FooterLinks()
    parser.feed((site / page).read_text(encoding="utf-8"))
    base = f"http://site/{page}"
    return {direction: urljoin(base, href).removeprefix("http://site/")
            for direction, href in parser.links.items()}


def _walk(site: Path, start: str, direction: str) -> list[str]:
    pages = [start]
    while (following := _footer(site, pages[-1]).get(direction)) is not None:
        assert following not in pages, f"the footers go round in a circle at {following}"
        pages.append(following)
    return pages


def _step(page: str) -> str:
    """A page's place on the learner's path: 'stage 3', 'tutorial 3', 'exercise 3', or its name."""
    if page == "tutorials/serving.html":
        return "tutorial serving"
    for kind, pattern in (("stage", r"stages/(\d+)_\w+\.html"), ("tutorial", r"tutorials/(\d+)_\w+\.html"),
                          ("exercise", r"exercises/stage(\d+)\.html")):
        if match := re.fullmatch(pattern, page):
            return f"{kind} {int(match.group(1))}"
    return page.removesuffix(".html")


LEARNERS_PATH = ["exercises/index", *[f"{kind} {n}" for n in range(10)
                                      for kind in ("stage", "tutorial", "exercise")],
                 "tutorial serving", "serving", "stage 10", "tutorial 10", "exercise 10", "stage 11", "tutorial 11",
                 "exercise 11", "stage 12", "tutorial 12", "exercise 12", "stage 13", "tutorial 13", "exercise 13",
                 "stage 14", "tutorial 14", "exercise 14", "stage 15", "tutorial 15", "exercise 15", "benchmarks"]


def _check_learners_path(pages: list[str]) -> None:
    steps = [_step(page) for page in pages]
    assert steps[0] == "index", steps[:3]
    missing = [step for step in LEARNERS_PATH if step not in steps]
    assert not missing, f"pages the footers never reach: {missing}"
    start = steps.index("stage 0")
    assert steps.index("exercises/index") < start
    assert steps[start:start + len(LEARNERS_PATH) - 1] == LEARNERS_PATH[1:], steps[start:]


def test_the_path_check_finds_a_page_out_of_order():
    good = ["index.html", "exercises/index.html", "glossary.html"]
    for n in range(10):
        good += [f"stages/{n}_x.html", f"tutorials/{n:02d}_x.html", f"exercises/stage{n}.html"]
    good += ["tutorials/serving.html", "serving.html", "stages/10_x.html", "tutorials/10_x.html",
             "exercises/stage10.html", "stages/11_x.html", "tutorials/11_x.html", "exercises/stage11.html",
             "stages/12_x.html", "tutorials/12_x.html", "exercises/stage12.html", "stages/13_x.html",
             "tutorials/13_x.html", "exercises/stage13.html", "stages/14_x.html", "tutorials/14_x.html",
             "exercises/stage14.html", "stages/15_x.html", "tutorials/15_x.html", "exercises/stage15.html",
             "benchmarks.html", "api.html"]
    _check_learners_path(good)
    swapped = good.copy()
    swapped[4], swapped[5] = swapped[5], swapped[4]  # tutorial 0 before its stage page
    with pytest.raises(AssertionError):
        _check_learners_path(swapped)
    with pytest.raises(AssertionError):  # the exercises at the end, as a section of their own
        _check_learners_path([p for p in good if "exercises/" not in p] +
                             [p for p in good if "exercises/" in p])


@docs
@pytest.mark.parametrize("language", LANGUAGES)
def test_the_footers_lead_along_the_learners_path(site, language):
    folder = LANGUAGES[language]
    forward = _walk(site, f"{folder}index.html", "next")
    assert all(page.startswith(folder) for page in forward), "the footers leave the language"
    _check_learners_path([page.removeprefix(folder) for page in forward])
    assert _walk(site, forward[-1], "prev") == forward[::-1]


# ---------------------------------------------------------------------------------------------
# Everything fits the column at 1280 px: no code block, output, table or formula scrolls
# sideways or sticks out of the column, and no page scrolls sideways as a whole.

BLOCKS = ("pre", "table", ".md-typeset__scrollwrap", ".jp-OutputArea-output", ".jp-InputArea",
          ".jp-Cell", ".highlight", ".minipaged-source", ".arithmatex")
OVERFLOWS = """
const column = document.querySelector('.md-content') || document.body;  // with its margins
const limit = column.getBoundingClientRect().right;
document.querySelectorAll('details').forEach(d => d.open = true);  // folded answers fit too
const wide = [...document.querySelectorAll(arguments[0].join(','))].filter(e => {
  if (!e.getClientRects().length) return false;  // not shown
  return e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().right > limit + 1;
});
const innermost = wide.filter(e => !wide.some(o => o !== e && e.contains(o)));
const found = innermost.map(e => {
  const name = e.tagName.toLowerCase() + [...e.classList].slice(0, 2).map(c => '.' + c).join('');
  const text = e.textContent.trim().replace(/\\s+/g, ' ').slice(0, 60);
  return `${name} (${e.scrollWidth} px in ${e.clientWidth}): ${text}`;
});
const page = document.scrollingElement;
if (page.scrollWidth > page.clientWidth + 1)
  found.push(`the page scrolls sideways (${page.scrollWidth} px in ${page.clientWidth})`);
return found;
"""


def _overflows(browser, url: str) -> list[str]:
    """What does not fit on the page at ``url``, the browser's window being 1280 px wide."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    wait = WebDriverWait(browser, 30, poll_frequency=0.1)
    wait.until(lambda b: b.execute_script("return document.readyState") == "complete")
    try:  # formulas change the layout once typeset
        wait.until(lambda b: b.execute_script(
            "return !(window.MathJax && MathJax.Hub) || MathJax.Hub.queue.pending === 0"))
    except TimeoutException:
        pass
    return browser.execute_script(OVERFLOWS, list(BLOCKS))


def _site_pages(site: Path) -> list[str]:
    return sorted(str(page.relative_to(site)) for page in site.rglob("*.html"))


@docs
def test_every_page_fits_the_column_at_1280_px(site, served, browser):
    assert browser.execute_script("return window.innerWidth") == 1280
    wide = {}
    for page in _site_pages(site):
        if found := _overflows(browser, f"{served}/{page}"):
            wide[page] = found
    report = "\n".join(f"{page}: {item}" for page, items in wide.items() for item in items)
    assert not wide, f"{sum(map(len, wide.values()))} blocks do not fit the column:\n{report}"


@docs
def test_the_fit_check_finds_what_sticks_out(tmp_path, browser):
    long = "x = " + " + ".join(["value"] * 60)
    page = tmp_path / "wide.html"
    page.write_text(f'<div class="md-content" style="width: 600px"><pre>{long}</pre>'
                    f'<table><tr><td style="white-space: nowrap">{long}</td></tr></table>'
                    f'<pre style="white-space: pre-wrap">{long}</pre></div>', encoding="utf-8")
    found = _overflows(browser, page.as_uri())
    assert [item.split(" ")[0] for item in found] == ["pre", "table", "the"], found


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "scripts" / "site_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_lines_become_lines_of_their_own_with_their_indentation():
    hooks = _hooks()
    code = ('<pre><span></span><span class="k">def</span> f():\n'
            '    <span class="s">"""one\ntwo"""</span>\n\n'
            '    <span class="k">return</span> 1 &lt; 2\n</pre>')
    html = hooks._wrap_lines(code)
    lines = re.findall(r'<span class="line" style="--indent: ([^"]+)">', html)
    assert lines == ["0ch", "4ch", "0ch", "0ch", "4ch"]  # the string's second line starts at 0
    assert hooks._text(html) == hooks._text(code)  # not a character more or less: copying works
    parser = HTMLParser()
    opened = []
    parser.handle_starttag = lambda tag, attrs: opened.append(tag)
    parser.handle_endtag = lambda tag: opened.pop() if opened[-1] == tag else pytest.fail(tag)
    parser.feed(html)
    assert opened == []
    numbered = ('<pre class="x"><span style="padding-left: 5px">12</span>    a\n'
                '<span style="background: y"><span style="padding-left: 5px">13</span>  a\n</span></pre>')
    assert re.findall(r"--indent: ([^\"]+)\"", hooks._wrap_lines(numbered)) == [
        "calc(6ch + 10px)", "calc(4ch + 10px)"]
    assert hooks._wrap_lines(html) == html  # once only


def test_names_in_table_cells_may_break_after_punctuation_only():
    hooks = _hooks()
    html = ('<p><code>a_b.c</code></p><table><tr><td><code>vllm/v1/kv_cache_manager.py</code></td>'
            '<td><a href="x_y.html"><code>f(a, b)</code></a></td></tr></table>')
    assert hooks._breakable_names(html) == (
        '<p><code>a_b.c</code></p><table><tr><td><code>vllm/<wbr>v1/<wbr>kv_<wbr>cache_<wbr>manager.'
        '<wbr>py</code></td><td><a href="x_y.html"><code>f(<wbr>a,<wbr> b)</code></a></td></tr></table>')


def test_a_notebooks_outputs_are_marked_out_of_the_search_whole():
    from material.plugins.search.plugin import Parser

    hooks = _hooks()
    html = ('<div class="jp-Cell"><pre>kept</pre><div class="jp-Cell-outputWrapper"><div class="a">'
            '</div><div><pre>printed 1</pre><div>printed 2</div></div></div></div><p>after</p>')
    marked = hooks._outputs_out_of_search(html)
    parser = Parser()
    parser.feed(marked)
    text = " ".join("".join(section.text) for section in parser.data)
    assert "kept" in text and "after" in text and "printed" not in text
    assert hooks._text(marked) == hooks._text(html)


# ---------------------------------------------------------------------------------------------
# Two languages: English at the root, Chinese under zh/. A page written in Chinese
# (docs/<path>.zh.md) is zh/<path>.html; any other page is the English one in the Chinese
# site's frame (navigation, footers, language). The language switcher leads to the same page
# in the other language, and search finds pages in both.

class _PageLanguage(HTMLParser):
    def __init__(self):
        super().__init__()
        self.lang, self.switcher = None, {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html":
            self.lang = attrs.get("lang")
        if tag == "a" and "md-select__link" in (attrs.get("class") or "") and attrs.get("hreflang"):
            self.switcher[attrs["hreflang"]] = attrs["href"]


CJK = re.compile(r"[\u4e00-\u9fff]")
ARTICLE = re.compile(r'<article class="md-content__inner[^"]*">(.*?)</article>', re.S)


@docs
def test_every_page_leads_to_itself_in_the_other_language(site):
    pages = [page for page in _site_pages(site) if not page.endswith("404.html")]
    assert any(page.startswith("zh/tutorials/") for page in pages)
    for page in pages:
        language = "zh" if page.startswith("zh/") else "en"
        parser = _PageLanguage()
        parser.feed((site / page).read_text(encoding="utf-8"))
        assert parser.lang == language, page
        assert set(parser.switcher) == set(LANGUAGES), page
        same = page.removeprefix(LANGUAGES[language])
        for other, href in parser.switcher.items():
            target = urljoin(f"http://site/{page}", href).removeprefix("http://site/")
            assert target == LANGUAGES[other] + same and (site / target).is_file(), (page, href)


@docs
def test_pages_written_in_chinese_are_shown_in_chinese_and_the_rest_in_english(site):
    translated = sorted(path.relative_to(ROOT / "docs") for path in (ROOT / "docs").rglob("*.zh.md"))
    assert Path("index.zh.md") in translated and Path("glossary.zh.md") in translated
    for source in translated:
        page = str(source).removesuffix(".zh.md") + ".html"
        chinese = ARTICLE.search((site / "zh" / page).read_text(encoding="utf-8")).group(1)
        english = ARTICLE.search((site / page).read_text(encoding="utf-8")).group(1)
        chinese, english = len(CJK.findall(_text_of(chinese))), len(CJK.findall(_text_of(english)))
        assert chinese > 50 and english < chinese / 4, page  # the glossary gives Chinese names
    for page in ("api.html", "tutorials/00_contiguous_kv_cache.html"):
        html = (site / "zh" / page).read_text(encoding="utf-8")
        assert _text_of(ARTICLE.search(html).group(1)) == _text_of(ARTICLE.search(
            (site / page).read_text(encoding="utf-8")).group(1)), page  # the English page
        assert "练习 0" in html and "教程 00" in html  # in the Chinese site's navigation


def _text_of(html: str) -> str:
    from html import unescape

    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html))).strip()


@docs
@pytest.mark.parametrize("page, query, found", [
    ("index.html", "allocator", "stages/1_block_allocator.html"),
    ("zh/index.html", "块分配器", "zh/stages/1_block_allocator.html"),
], ids=["en", "zh"])
def test_search_finds_pages_in_each_language(page, query, found, served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{served}/{page}")
    browser.execute_script("document.querySelector('#__search').checked = true")
    browser.find_element(By.CSS_SELECTOR, "input.md-search__input").send_keys(query)
    results = WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda b: b.execute_script(
        "return [...document.querySelectorAll('.md-search-result__item a')].map(a => a.href)"))
    assert f"{served}/{found}" in [result.split("#")[0] for result in results], results[:8]


@docs
def test_the_search_index_holds_no_notebook_output(site):
    """What a run printed differs between runs and CPUs; the index is the same on every machine."""
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    indexed = {}
    for doc in index["docs"]:
        page = doc["location"].split("#")[0]
        indexed[page] = indexed.get(page, "") + " " + _text_of(doc["text"])
    printed = 0
    for notebook in sorted((site / "tutorials").glob("*.ipynb")):
        page = f"tutorials/{notebook.stem}.html"
        html = (site / page).read_text(encoding="utf-8")
        assert html.count('class="jp-Cell-outputWrapper"') == html.count(
            '<section class="jp-Cell-outputWrapper" data-search-exclude'), page
        cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
        source = " ".join("".join(cell["source"]) for cell in cells)  # what a cell or its text says
        written = re.sub(r"\s+", " ", re.sub(r"[`*]", "", source))
        for cell in cells:
            for output in cell.get("outputs", []):
                for line in "".join(output.get("text", [])).splitlines():
                    line = re.sub(r"\s+", " ", line).strip()
                    if len(line) >= 12 and re.search(r"\d", line) and line not in written:
                        printed += 1
                        assert line not in indexed[page], (page, line)
                        assert line not in indexed[f"zh/{page}"], (page, line)
    if not printed:
        pytest.skip("the site was built from notebooks that were not run")


CJK_CHAR = "[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]"
SPACE_BETWEEN_CJK = re.compile(rf"{CJK_CHAR}\s+{CJK_CHAR}")


class _ProseText(HTMLParser):
    """A page's text outside ``pre``, ``code``, ``script`` and ``style``, each run of it within one
    block (a paragraph, a cell, a list item): what reads as one line of prose."""

    SKIP = {"pre", "code", "script", "style"}
    INLINE = {"a", "em", "strong", "span", "b", "i", "sub", "sup", "mark", "abbr", "wbr", "kbd", "small"}

    def __init__(self):
        super().__init__()
        self.depth, self.parts = 0, []

    def handle_starttag(self, tag, attrs):
        self.depth += tag in self.SKIP
        if tag not in self.INLINE:
            self.parts.append("\0")  # a block's edge, or code: no prose runs across it

    def handle_endtag(self, tag):
        self.depth -= tag in self.SKIP and self.depth > 0
        if tag not in self.INLINE:
            self.parts.append("\0")

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


def spaces_between_cjk(html: str) -> list[str]:
    parser = _ProseText()
    parser.feed(html)
    text = "".join(parser.parts)
    return [text[max(0, m.start() - 8):m.end() + 8] for m in SPACE_BETWEEN_CJK.finditer(text)]


def test_the_cjk_check_finds_a_space_between_two_characters_and_the_hook_joins_the_lines():
    found = spaces_between_cjk("<p>最后是面试官\n接下来</p><pre>代码 代码</pre><code>名 字</code>")
    assert [hit.strip("\0") for hit in found] == ["最后是面试官\n接下来"]
    assert not spaces_between_cjk("<p>用 <code>LLM</code> 生成，中文和 English 之间</p>")
    closed = _hooks().close_cjk_spaces('<p>最后是面试官\n  接下来，<a href="x">块分配器</a> 和 stage 页。 一个</p>'
                                       "<pre>代码 代码</pre><p><code>名 字</code> 用时 约</p>")
    assert closed == ('<p>最后是面试官接下来，<a href="x">块分配器</a>和 stage 页。一个</p>'
                      "<pre>代码 代码</pre><p><code>名 字</code> 用时约</p>")
    assert not spaces_between_cjk(closed)


@docs
def test_no_chinese_page_shows_a_space_between_two_cjk_characters(site):
    """A line break inside a Chinese sentence renders as a space; the site's hooks join those lines."""
    found = {}
    for page in sorted((site / "zh").rglob("*.html")):
        if (hits := spaces_between_cjk(page.read_text(encoding="utf-8"))):
            found[page.relative_to(site).as_posix()] = hits[:3]
    assert not found, found
