"""One word per concept on the Chinese pages.

``docs/glossary.zh.md`` fixes the terms: every entry starts with ``* **用词（括号）**``, where
the part before the brackets is what the Chinese pages write (several forms are separated by
`` / `` or ``、``) and the bracket holds the English name, or the Chinese gloss for a term the
pages keep in English. This file checks both directions: every glossary term is used in the
prose of at least one other Chinese page, and no Chinese page (the glossary included, apart
from its entry heads) uses one of the rejected variants below. Code spans, code blocks, link
targets, English link titles and anchors are not prose and are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.common

DOCS = Path(__file__).resolve().parent.parent / "docs"
GLOSSARY = DOCS / "glossary.zh.md"
ENTRY = re.compile(r"^\* \*\*(?P<head>[^*]+)\*\*", re.MULTILINE)

# (pattern, the word to use instead and why). Patterns are searched in prose only.
REJECTED: list[tuple[str, str]] = [
    (r"块空间管理器", "block manager（块管理器）: nobody calls it 块空间管理器"),
    (r"淘汰器", "evictor（LRU 淘汰队列）: it is a queue of free cached blocks, not a device"),
    (r"持久化", "常驻 batch: 持久化 means written to disk"),
    (r"对拍", "逐 token 对齐 / 比对: 对拍 is contest slang"),
    (r"(?<!结)束搜索", "beam search"),  # 结束搜索 is "end the search"
    (r"序列组", "sequence group"),
    (r"预填充", "prefill"),
    (r"被传入", "拿到 / 构造时传给它: a word-for-word 'is passed'"),
    # GPU memory is 显存; 内存 is left for the CPU's memory and the operating system's pages.
    (r"(?<!CPU )(?<!CPU)(?<!虚拟)(?<!虚拟\*)(?<!物理)(?<!共享)(?<!“)内存(?!页|分页)", "显存 (GPU memory, HBM)"),
    (r"HBM\s*内存", "显存"),
    # Prose says 块, 块表, 块分配器; "block manager" keeps vLLM's English name.
    (r"(?<![A-Za-z_\-])[Bb]locks?(?![A-Za-z_\-])(?! manager)", "块 (块表, 块分配器, 块大小, 块 id)"),
]


def chinese_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.zh.md"))


def prose(text: str) -> str:
    """The page without code, link targets, anchors, HTML tags and math."""

    def blank(m: re.Match[str]) -> str:  # keep the line numbers
        return "\n" * m.group().count("\n")

    text = re.sub(r"^([ \t]*)(```|~~~).*?^\1\2[^\n]*$", blank, text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"\$\$.*?\$\$", blank, text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]+`|\$[^$\n]+\$|<[^>\n]+>|\{[#:.][^}\n]*\}", "", text)
    text = re.sub(r"^[ \t]*\[[^\]\n]+\]:[ \t]*\S+[^\n]*$", "", text, flags=re.MULTILINE)  # a link's definition
    text = re.sub(r"\[[^\]\n]*\]\([^)\s]*\.ipynb\)", "", text)  # a tutorial, by its (English) title
    text = re.sub(r"\[[^\]\u4e00-\u9fff\n]*\]\(", "[](", text)  # an English title of what a link opens
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def glossary_terms() -> list[str]:
    terms = []
    for match in ENTRY.finditer(GLOSSARY.read_text(encoding="utf-8")):
        head = re.split(r"[（(]", match["head"], maxsplit=1)[0]
        terms += [t.strip() for t in re.split(r" / |、", head) if t.strip()]
    return terms


def find_rejected(text: str) -> list[str]:
    found = []
    for pattern, instead in REJECTED:
        for m in re.finditer(pattern, text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"line {line}: {m.group()!r} (use {instead})")
    return found


def test_the_glossary_has_its_terms_in_the_machine_readable_form():
    terms = glossary_terms()
    assert len(terms) >= 50
    assert {"KV cache", "块", "块表", "显存", "block manager", "evictor", "常驻 batch", "beam search"} <= set(terms)


@pytest.mark.parametrize("page", chinese_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_chinese_page_uses_a_rejected_variant(page: Path):
    text = page.read_text(encoding="utf-8")
    if page == GLOSSARY:
        text = ENTRY.sub("* ", text)
    found = find_rejected(prose(text))
    assert not found, f"{page.relative_to(DOCS)}:\n" + "\n".join(found)


def test_every_glossary_term_is_used_by_a_chinese_page():
    pages = "\n".join(prose(p.read_text(encoding="utf-8")) for p in chinese_pages() if p != GLOSSARY).lower()
    unused = [t for t in glossary_terms() if t.lower() not in pages]
    assert not unused, f"glossary terms no Chinese page uses: {unused}"


def test_the_english_glossary_gives_the_chinese_names_the_pages_use():
    """glossary.md's bracketed Chinese names must not be a rejected variant either."""
    names = re.findall(r"^\* \*\*[^*]+\*\* \(([^)]*)\)", (DOCS / "glossary.md").read_text(encoding="utf-8"), re.M)
    assert len(names) >= 40
    bad = [n for n in names if any(re.search(p, n) for p, _ in REJECTED[:4])]
    assert not bad, f"glossary.md names Chinese terms the pages do not use: {bad}"


@pytest.mark.parametrize(
    "old",
    [
        "它被传入一个分配器",
        "每个都和参考实现对拍",
        "## 持久化 batch",
        "decode 的瓶颈在内存",
        "淘汰器里的块",
        "新 block 的 id",
    ],
)
def test_the_check_catches_the_wording_it_rejects(old: str):
    assert find_rejected(prose(old))


@pytest.mark.parametrize(
    "fine",
    [
        "换出到 CPU 内存",
        "操作系统的虚拟内存分页",
        "共享内存页",
        "block manager（块管理器）",
        "`block_size` 和 [块表](stages/2_block_table.md)",
        "`PrefixCachingAllocator.evictor`",
        "[v0-naive-block]: https://github.com/vllm-project/vllm/blob/v0.6.6/vllm/core/block/naive_block.py",
    ],
)
def test_the_check_leaves_the_chosen_wording_alone(fine: str):
    assert not find_rejected(prose(fine))
