"""The committed figures are the ones ``scripts/doc_figures.py`` draws from the code as it is.

Every figure in docs/figures is drawn by the script from minipaged's own classes and numbers.
Here each is drawn again, into a temporary folder, and compared with the committed file: its
texts (every label, tick and number, in order), then its bytes, which the script makes
reproducible (the ids of an SVG come from a fixed salt, and it carries no date). A figure
left stale after its code or its numbers changed fails; ``python scripts/doc_figures.py``
draws it again. The home page's paragraph under its figure is checked against the numbers
the figure is drawn from.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import re
from pathlib import Path

import matplotlib
import pytest
import torch

pytestmark = pytest.mark.tooling

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
COMMITTED = sorted(path.name for path in FIGURES.glob("*.svg"))
TEXT = re.compile(r"<text\b[^>]*>(.*?)</text>|<!-- (.*?) -->", re.DOTALL)  # as text, or drawn as glyphs
CREATOR = re.compile(r"<dc:title>Matplotlib v(\S+), ")


@pytest.fixture(scope="module")
def script():
    """scripts/doc_figures.py as a module, its settings in force until this file's tests end."""
    threads = torch.get_num_threads()
    with matplotlib.rc_context():
        spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "scripts" / "doc_figures.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    torch.set_num_threads(threads)


def draw(script, into: Path, *figures) -> dict[str, bytes]:
    """Draw ``figures`` (all of them by default) into the folder ``into``; their files by name."""
    into.mkdir(parents=True, exist_ok=True)
    committed_to, script.OUT = script.OUT, into
    try:
        for figure in figures or script.FIGURES:
            figure()
    finally:
        script.OUT = committed_to
    return {path.name: path.read_bytes() for path in into.glob("*.svg")}


@pytest.fixture(scope="module")
def drawn(script, tmp_path_factory):
    return draw(script, tmp_path_factory.mktemp("figures"))


def texts(svg: bytes) -> list[str]:
    return [html.unescape(re.sub(r"<[^>]+>", "", a or b)) for a, b in TEXT.findall(svg.decode("utf-8"))]


def missing_here(script, name: str) -> str | None:
    """Why this machine cannot draw the figure ``name``, if it is one the script leaves as it is there."""
    if name == "split_kv.svg" and importlib.util.find_spec("triton") is None:
        return "split_kv.svg takes its partition size from the Triton kernels; Triton is not installed"
    if name.endswith(".zh.svg") and script.cjk_font() is None:
        return f"{name} is drawn in {script.CJK_FAMILY} (Debian's fonts-noto-cjk), which is not installed"
    return None


@pytest.mark.parametrize("name", COMMITTED)
def test_the_committed_figure_is_the_one_the_code_draws(script, drawn, name):
    reason = missing_here(script, name)
    if reason:
        pytest.skip(reason)
    assert name in drawn, f"docs/figures/{name} is drawn by none of scripts/doc_figures.py's FIGURES"
    committed = (FIGURES / name).read_bytes()
    written_by = CREATOR.search(committed.decode("utf-8"))[1]
    if written_by != matplotlib.__version__:  # another version places the same shapes a little differently
        assert texts(drawn[name]) == texts(committed), f"docs/figures/{name} is stale"
        pytest.skip(f"{name} was drawn with matplotlib {written_by}, this is {matplotlib.__version__}: "
                    "its texts agree; its bytes are compared with the locked version only")
    stale = f"docs/figures/{name} is stale: run python scripts/doc_figures.py"
    assert texts(drawn[name]) == texts(committed), stale  # a label or a number first: the readable difference
    assert drawn[name] == committed, stale  # then every shape


def test_every_figure_the_script_draws_is_committed(drawn):
    assert set(drawn) <= set(COMMITTED)  # and each committed one is drawn: the test above
    assert {"decode_throughput.svg", "paged_memory.svg"} <= set(drawn)


def test_a_figure_drawn_from_other_numbers_is_told_apart(script, tmp_path, monkeypatch):
    """The comparison bites: a curve off by 2% between its marked points keeps every label (a check
    of the labels alone passes) and still differs; another context length changes the labels too."""
    committed = (FIGURES / "decode_throughput.svg").read_bytes()
    context = script.DECODE_CONTEXT
    marked = {round(script.decode_bend(context)), *(script.requests_that_fit(context, layout)
                                                     for layout in ("max", "paged"))}  # their numbers are written

    def off(batch, context, **kwargs):
        bound = script_decode_bound(batch, context, **kwargs)
        if kwargs or batch in marked:  # the ceiling (weights not read), and the marked points
            return bound
        return dataclasses.replace(bound, tokens_per_s=1.02 * bound.tokens_per_s)

    def english():
        script._decode_throughput("en")

    script_decode_bound = script.decode_bound
    monkeypatch.setattr(script, "decode_bound", off)
    curve_only = draw(script, tmp_path / "curve", english)["decode_throughput.svg"]
    assert texts(curve_only) == texts(committed) and curve_only != committed

    monkeypatch.setattr(script, "decode_bound", script_decode_bound)
    monkeypatch.setattr(script, "DECODE_CONTEXT", 1024)
    longer = draw(script, tmp_path / "longer", english)["decode_throughput.svg"]
    assert texts(longer) != texts(committed)
    assert draw(script, tmp_path / "again", english)["decode_throughput.svg"] == longer  # drawn twice, the same bytes


def paragraph_under(page: Path, image: str) -> str:
    """The paragraph that follows the image ``image`` on ``page``, its lines joined."""
    text = page.read_text(encoding="utf-8")
    start = text.index("\n\n", text.index(image)) + 2
    lines = text[start:text.index("\n\n", start)].splitlines()
    joiner = "" if page.name.endswith(".zh.md") else " "
    return joiner.join(line.strip() for line in lines)


def test_the_home_page_says_the_numbers_its_figure_is_drawn_from(script):
    cache = script.home_contiguous()  # the contiguous half: real slabs, placed by stage 0's cache
    slabs = list(cache.slabs.values())
    (slab,) = {s.size for s in slabs}  # policy max: every slab the longest a request may become
    slots, reserved, held = cache.num_slots, sum(s.size for s in slabs), sum(s.num_tokens for s in slabs)
    free = slots - reserved
    assert len(slabs) == len(script.HOME_TOKENS) == 3 and held < reserved
    assert script.HOME_BLOCKS * script.HOME_BLOCK_SIZE == slots  # the paged half: the same memory
    assert cache.holes() == [(reserved, free)] and free < slab and not cache.can_allocate(1, 0)  # no fourth slab

    en = paragraph_under(ROOT / "docs" / "index.md", "figures/paged_memory.svg")
    for said in (f"in the same {slots} slots", f"a slab as long as the longest request may become ({slab} slots)",
                 f"only {held} of the {reserved} reserved slots hold K/V", f"The {free} free slots at the end"):
        assert said in en, f"docs/index.md, under the figure: {said!r}"
    zh = paragraph_under(ROOT / "docs" / "index.zh.md", "figures/paged_memory.svg")
    for said in (f"同样 {slots} 个槽位", f"slab（{slab} 个槽位）", f"预留的 {reserved} 个槽位里只有 {held} 个存着 K/V",
                 f"末尾空闲的 {free} 个槽位"):
        assert said in zh, f"docs/index.zh.md, under the figure: {said!r}"
