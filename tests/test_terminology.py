"""One word per concept on the Chinese pages.

``docs/glossary.zh.md`` fixes the terms. Every entry starts with ``* **用词（括号）**``: before the
brackets is what the Chinese pages write (several forms are separated by `` / `` or ``、``); the
brackets hold the term in the other language: the English name of a term the pages write in
Chinese (写时复制（copy-on-write）), or the Chinese gloss of a term they keep in English
(block manager（块管理器）). The rules below are read from those heads, so the glossary is the
one place a term is chosen. In the prose of every Chinese page (code spans and blocks, link
targets, English titles of links and of cited works, anchors, HTML tags and math are not prose):

* every glossary term is used by some page;
* a bracketed form is not written in place of its term. It may stand only as the gloss in
  brackets right after the term, once a page for each form, where the term is explained: the
  first brackets after a use of the term (its word may come before as a plain word, 预留 before
  预留（reserved）). Known variants of a term (持久 batch for 常驻 batch) are rejected the same way,
  and so are the few wordings of ``WORDING``, each with the reason it is not used;
* 块 is a KV block, never a piece of an exercise: an exercise page counts its pieces in 部分;
* a tutorial is linked by its Chinese title, the same on every page, and a stage page's header
  says that the notebook is in English.

``docs/glossary.md`` gives each concept the Chinese page's word in brackets: the word the Chinese
pages write, then, where that word is English, the Chinese gloss after a semicolon
(``**Block manager** (block manager; 块管理器)``). A test holds every bracket to the Chinese
glossary's entry for the concept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.common

DOCS = Path(__file__).resolve().parent.parent / "docs"
GLOSSARY = DOCS / "glossary.zh.md"
ENGLISH_GLOSSARY = DOCS / "glossary.md"
ENTRY = re.compile(r"^\* \*\*(?P<head>[^*]+)\*\*", re.MULTILINE)
HEAD = re.compile(r"^(?P<used>[^（(]+?)\s*(?:[（(](?P<bracket>.+)[）)])?$")
CJK = re.compile(r"[\u4e00-\u9fff]")
SEPARATOR = re.compile(r" / |、|，|, ")

# Variants of a glossary term, rejected like the term's bracketed form: glossary term -> pattern.
VARIANTS: dict[str, str] = {
    "常驻 batch": r"持久化?\s*batch",
    "变长 query": r"变长\s*batch",
    "evictor": r"淘汰队列|淘汰器",
    "block manager": r"块空间管理器",
    "chunked prefill": r"分块\s*prefill",
    "重算": r"(?<![A-Za-z0-9_])recomput(?:es?|ed|ing|ation)(?![A-Za-z0-9_\-])",
    "写时复制": r"(?<![A-Za-z0-9_])CoW(?![A-Za-z0-9_\-])",
    "GQA": r"分组查询",
    "MQA": r"多查询",
    "KV cache": r"KV\s*缓存",
    # swap as a word of the sentence (用 swap 抢占, 把块 swap 到 CPU); "swap 空间" names vLLM's swap_space.
    "换出": r"(?<![A-Za-z0-9_\-])swap(?![A-Za-z0-9_\-]|\s*(?:空间|space))",
}

# A rejected form that also spells a different word: the form -> that word, left alone.
OTHER_WORDS: dict[str, str] = {"束搜索": r"结束搜索"}  # 结束搜索 is "end the search"

# Wordings no glossary entry holds: (pattern, the word to use instead and why).
WORDING: list[tuple[str, str]] = [
    (r"对拍", "逐 token 对齐 / 比对: 对拍 is contest slang"),
    (r"被传入", "拿到 / 构造时传给它: a word-for-word 'is passed'"),
    # GPU memory is 显存; 内存 is left for the CPU's memory and the operating system's pages.
    (r"(?<!CPU )(?<!CPU)(?<!虚拟)(?<!虚拟\*)(?<!物理)(?<!共享)(?<!“)内存(?!页|分页)", "显存 (GPU memory)"),
]

# 块 counting the pieces an exercise lists (共十一块，按这个顺序): a piece is 部分. Counts of KV
# blocks are written in digits (12 块), so a count in Chinese numerals is a count of pieces.
NUMERAL = "一二三四五六七八九十"
PIECES: list[str] = [
    rf"(?<![第这那两{NUMERAL}\d])(?:十[一二三四五六七八九]?|[二三四五六七八九])块",
    r"(?:共|只有)两块",
]
# ... and in a sentence that says which tests turn green (变绿), 第 N 块 or 下一块 is a piece.
GREEN_SENTENCE = re.compile(r"[^。；;\n]*变绿[^。；;\n]*")
PIECE_IN_GREEN = re.compile(rf"第\s*[\d{NUMERAL}]+(?:\s*[、，,和]\s*[\d{NUMERAL}]+)*\s*块|下一块|那几块|这几块")

TUTORIAL_LINK = re.compile(r"\[(?P<title>[^\]\n]*)\]\((?P<target>[^)\s]*tutorials/(?P<notebook>[^)/\s]+)\.ipynb)\)")
# A stage page's header: 教程：[00 · 连续存储的 KV cache](../tutorials/00_contiguous_kv_cache.ipynb)（英文 notebook）
STAGE_HEADER_TUTORIAL = re.compile(
    r"教程：\[(?P<number>\d\d) · (?P<title>[^\]\n]+)\]\(\.\./tutorials/(?P=number)_\w+\.ipynb\)（英文 notebook）"
)


@dataclass(frozen=True)
class Entry:
    """One glossary entry, read from its head."""

    head: str
    used_part: str  # before the brackets: 换出 / 换入
    bracket_part: str  # in them: swap out / swap in
    used: tuple[str, ...]  # the forms the pages write
    bracket: tuple[str, ...]  # the bracket's items

    @property
    def chinese(self) -> bool:
        """Whether the pages write this term in Chinese (its bracket then holds English)."""
        return bool(CJK.search(" ".join(self.used)))

    @property
    def other_language(self) -> tuple[str, ...]:
        """The bracket's items in the language the pages do not write this term in."""
        return tuple(b for b in self.bracket if bool(CJK.search(b)) != self.chinese)

    @property
    def english_names(self) -> set[str]:
        names = {b for b in self.bracket if not CJK.search(b)}
        if self.bracket and not CJK.search(self.bracket_part):
            names.add(self.bracket_part)
        if not self.chinese:
            names |= set(self.used) | {self.used_part}
        return {normal(n) for n in names}

    @property
    def gloss(self) -> tuple[str, ...]:
        """The Chinese gloss of a term the pages keep in English."""
        return () if self.chinese else tuple(b for b in self.bracket if CJK.search(b))


def normal(name: str) -> str:
    return re.sub(r"\s+", " ", SEPARATOR.sub(", ", name)).strip().lower()


@cache
def glossary_entries() -> tuple[Entry, ...]:
    entries = []
    for match in ENTRY.finditer(GLOSSARY.read_text(encoding="utf-8")):
        head = match["head"].strip()
        parts = HEAD.match(head)
        assert parts, f"glossary entry {head!r} is not 用词（括号）"
        used_part, bracket_part = parts["used"], parts["bracket"] or ""
        used = tuple(t.strip() for t in SEPARATOR.split(used_part) if t.strip())
        bracket = tuple(t.strip() for t in SEPARATOR.split(bracket_part) if t.strip())
        entries.append(Entry(head, used_part, bracket_part, used, bracket))
    return tuple(entries)


def glossary_terms() -> list[str]:
    return [t for e in glossary_entries() for t in e.used]


def chinese_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.zh.md"))


def prose(text: str) -> str:
    """The page without code, link targets, anchors, HTML tags and math; line numbers kept."""

    def blank(m: re.Match[str]) -> str:
        return "\n" * m.group().count("\n")

    text = re.sub(r"^([ \t]*)(```|~~~).*?^\1\2[^\n]*$", blank, text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"\$\$.*?\$\$", blank, text, flags=re.DOTALL)
    text = re.sub(r"`(?:[^`\n]|\n(?![ \t]*\n))+`", blank, text)  # a code span, over lines too
    text = re.sub(r"\$[^$\n]+\$|<[^>\n]+>|\{[#:.][^}\n]*\}", "", text)
    text = re.sub(r"^[ \t]*\[[^\]\n]+\]:[ \t]*\S+[^\n]*$", "", text, flags=re.MULTILINE)  # a link's definition
    text = re.sub(r"\*\*[^*\u4e00-\u9fff]+?\s[^*\u4e00-\u9fff]+?[.?]\*\*", blank, text)  # a cited work's English title
    text = re.sub(r"\[[^\]\u4e00-\u9fff\n]*\]\(", "[](", text)  # an English title of what a link opens
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def form_pattern(form: str) -> str:
    """A regular expression for a glossary form: English words whole, plurals and hyphens free."""
    if CJK.search(form):
        return r"\s*".join(re.escape(w) for w in form.split())
    words = re.split(r"[\s\-]+", form)
    last = words[-1]
    if last.endswith("ies"):
        tail = re.escape(last[:-3]) + "(?:y|ies)"
    else:
        tail = re.escape(last.removesuffix("s")) + "(?:e?s)?"
    body = r"[\s\-]+".join([re.escape(w) for w in words[:-1]] + [tail])
    return rf"(?<![A-Za-z0-9_\-]){body}(?![A-Za-z0-9_\-])"


def spans(pattern: str, text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(pattern, text, re.IGNORECASE)]


def inside(span: tuple[int, int], others: list[tuple[int, int]]) -> bool:
    return any(a <= span[0] and span[1] <= b and (a, b) != span for a, b in others)


def longer_terms(pattern: str) -> list[str]:
    """The glossary terms that contain a match of ``pattern`` (投机解码 for 解码)."""
    return [t for t in glossary_terms() if re.search(pattern, t, re.IGNORECASE) and not re.fullmatch(pattern, t, re.I)]


def occurrences(pattern: str, text: str) -> list[tuple[int, int]]:
    """Where ``pattern`` matches ``text``, leaving out its matches inside longer glossary terms."""
    longer = [s for t in longer_terms(pattern) for s in spans(form_pattern(t), text)]
    return [s for s in spans(pattern, text) if not inside(s, longer) and not any(a <= s[0] < b for a, b in longer)]


def gloss_spans(entry: Entry, text: str) -> list[tuple[int, int]]:
    """Where on the page the entry may be glossed: for each of its forms, the first brackets right
    after a use of it (the word may come earlier as a plain word: 预留 before 预留（reserved）)."""
    after = re.compile(r"[*\s]*[（(]([^）)\n]*)[）)]")
    found = []
    for form in entry.used:
        for _, end in occurrences(form_pattern(form), text):
            if m := after.match(text, end):
                found.append(m.span())
                break
    return found


@dataclass(frozen=True)
class Rule:
    pattern: str
    instead: str
    entry: Entry | None = None


@cache
def rules() -> tuple[Rule, ...]:
    found = []
    by_term = {t: e for e in glossary_entries() for t in e.used}
    for entry in glossary_entries():
        for form in entry.other_language:
            found.append(Rule(form_pattern(form), entry.head, entry))
    for term, pattern in VARIANTS.items():
        found.append(Rule(pattern, by_term[term].head, by_term[term]))
    found += [Rule(p, why) for p, why in WORDING]
    found += [Rule(p, "部分: a piece of an exercise; 块 is a KV block") for p in PIECES]
    return tuple(found)


def find_rejected(text: str) -> list[str]:
    """Each rejected word in ``text`` (prose), with its line and the word to use."""
    hits: list[tuple[tuple[int, int], str]] = []
    glossed: list[tuple[int, int]] = []  # forms standing as their term's gloss: block table in 块表（block table）
    for rule in rules():
        allowed = gloss_spans(rule.entry, text) if rule.entry else []
        others = [s for form, word in OTHER_WORDS.items() if re.search(rule.pattern, form) for s in spans(word, text)]
        for span in occurrences(rule.pattern, text):
            if any(a <= span[0] and span[1] <= b for a, b in allowed + others):
                glossed.append(span)
                continue
            hits.append((span, rule.instead))
    for sentence in GREEN_SENTENCE.finditer(text):
        for m in PIECE_IN_GREEN.finditer(sentence.group()):
            start = sentence.start() + m.start()
            hits.append(((start, start + len(m.group())), "部分: the pieces are numbered, not the blocks"))
    hits.sort()
    kept = [h for h in hits if not inside(h[0], [o[0] for o in hits] + glossed)]
    seen, found = set(), []
    for (start, end), instead in kept:
        if (start, end) in seen:
            continue
        seen.add((start, end))
        found.append(f"line {text.count(chr(10), 0, start) + 1}: {text[start:end]!r} (use {instead})")
    return found


def page_prose(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    if page == GLOSSARY:
        text = ENTRY.sub("* ", text)
    return prose(text)


def test_the_glossary_has_its_terms_in_the_machine_readable_form():
    terms = glossary_terms()
    assert len(terms) >= 50
    assert {"KV cache", "块", "块表", "显存", "block manager", "evictor", "常驻 batch", "beam search"} <= set(terms)
    for term in VARIANTS:
        assert term in terms, f"VARIANTS names {term!r}, which is not a glossary term"
    assert len(set(terms)) == len(terms), "a term with two entries"


@pytest.mark.parametrize("page", chinese_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_chinese_page_uses_a_rejected_variant(page: Path):
    found = find_rejected(page_prose(page))
    assert not found, f"{page.relative_to(DOCS)}:\n" + "\n".join(found)


def test_every_glossary_term_is_used_by_a_chinese_page():
    pages = "\n".join(page_prose(p) for p in chinese_pages() if p != GLOSSARY).lower()
    unused = [t for t in glossary_terms() if t.lower() not in pages]
    assert not unused, f"glossary terms no Chinese page uses: {unused}"


def english_glossary() -> list[re.Match[str]]:
    return list(
        re.finditer(
            r"^\* \*\*(?P<name>[^*]+)\*\*(?: \((?P<bracket>[^)]*)\))?",
            ENGLISH_GLOSSARY.read_text(encoding="utf-8"),
            re.MULTILINE,
        )
    )


def expected_bracket(entry: Entry) -> str:
    return entry.used_part + ("; " + " / ".join(entry.gloss) if entry.gloss else "")


def test_the_english_glossary_gives_the_chinese_names_the_pages_use():
    """Each bracket of glossary.md is the Chinese glossary's word for the concept, and its gloss."""
    entries = glossary_entries()
    names = english_glossary()
    assert len(names) >= 40
    wrong, matched = [], []
    for m in names:
        candidates = [e for e in entries if normal(m["name"]) in e.english_names]
        if len(candidates) != 1:
            wrong.append(f"{m['name']}: {len(candidates)} entries in glossary.zh.md")
            continue
        (entry,) = candidates
        matched.append(entry)
        if normal(m["bracket"] or "") != normal(expected_bracket(entry)):
            wrong.append(f"{m['name']} ({m['bracket']}): glossary.zh.md has {expected_bracket(entry)!r}")
    missing = [e.head for e in entries if e not in matched]
    assert not wrong, "glossary.md's brackets differ from glossary.zh.md:\n" + "\n".join(wrong)
    assert not missing, f"glossary.zh.md terms glossary.md does not give: {missing}"


def test_the_english_glossary_check_catches_a_wrong_chinese_name():
    entry = next(e for e in glossary_entries() if "reserved" in e.english_names)
    assert normal("预留浪费") != normal(expected_bracket(entry)) == normal("预留")
    manager = next(e for e in glossary_entries() if "block manager" in e.english_names)
    assert normal(expected_bracket(manager)) == normal("block manager; 块管理器")


@pytest.mark.parametrize("page", chinese_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_a_chinese_page_links_a_tutorial_by_its_chinese_title(page: Path):
    text = re.sub(r"`[^`\n]+`", "", page.read_text(encoding="utf-8"))
    english = [m.group() for m in TUTORIAL_LINK.finditer(text) if not CJK.search(m["title"].split(" · ")[-1])]
    assert not english, f"{page.relative_to(DOCS)} links a tutorial by an English title: {english}"


def test_a_tutorial_has_one_chinese_title():
    titles: dict[str, set[str]] = {}
    for page in chinese_pages():
        for m in TUTORIAL_LINK.finditer(page.read_text(encoding="utf-8")):
            if " · " in m["title"]:  # 教程 03 · 写时复制, 03 · 写时复制
                titles.setdefault(m["notebook"], set()).add(m["title"].split(" · ", 1)[1])
    assert len(titles) >= 13
    several = {n: t for n, t in titles.items() if len(t) > 1}
    assert not several, f"tutorials with several Chinese titles: {several}"


@pytest.mark.parametrize("page", sorted((DOCS / "stages").glob("*.zh.md")), ids=lambda p: p.name)
def test_a_stage_page_header_links_its_tutorial_in_chinese_and_says_it_is_english(page: Path):
    header = page.read_text(encoding="utf-8").split("\n\n")[1]
    m = STAGE_HEADER_TUTORIAL.search(header)
    assert m and CJK.search(m["title"]), f"{page.name}: {header}"


@pytest.mark.parametrize(
    "old",
    [
        "它被传入一个分配器",
        "每个都和参考实现对拍",
        "## 持久化 batch",
        "把这一步的差异应用到持久 batch 上",
        "decode 的瓶颈在内存",
        "淘汰器里的块",
        "新 block 的 id",
        "序列之间还能用 copy-on-write 共享块",
        "这叫 continuous batching（迭代级调度）",
        "swap 或 recompute 抢占",
        "由真实的调度器按先来先服务处理（没有模型，用 swap 抢占）",
        "被抢占的请求要么把块 swap 到 CPU 内存，要么释放掉",
        "只要 swap 里还有在等的就不接纳新请求",
        "或者 **swap 模式总是重算**。",
        "V1 只做 recomputation",
        "调度器接收一个块管理器",
        "它的 prefix caching 分配器",
        "copy-on-write（写时复制）",  # the wrong way round
        "它的**块表**（block）把每个逻辑块映射到物理块",  # a shorter term's name as the gloss
        "共享块要写时才复制一份（copy-on-write）",  # a gloss, but not right after the term
        "写时复制（copy-on-write）之后再写时复制（copy-on-write）",  # glossed twice
        "decode 和 chunk 共用一次前向，即分块预填充",
        "PagedAttention 的 kernel，用 Triton 写分页注意力",
        "变长 query 和变长 batch",
        "共十一块，按这个顺序来。",
        "`BlockAllocator` 的六块，按这个顺序：",
        "只有两块，但每块都包含好几个要点",
        "所以这三个测试在第 4 块之后变绿",
        "*此时变绿（第 4、5 块一起）：*",
        "每一步至少让一组测试变绿，只为下一块服务的那几块除外",
    ],
)
def test_the_check_catches_the_wording_it_rejects(old: str):
    assert find_rejected(prose(old))


@pytest.mark.parametrize(
    "fine",
    [
        "换出到 CPU 内存",
        "用换出做抢占；只要还有被换出的请求在等，就不接纳新请求",
        '`preemption_mode="swap"`，`swap_out`、`blocks_to_swap_in`',
        "换出 / 换入（swap out / swap in）",
        "`num_cpu_blocks`（swap 空间），即 CPU swap 空间",
        "waiting、running 和 swapped 三个队列",
        "操作系统的虚拟内存分页",
        "共享内存页",
        "block manager（块管理器）",
        "它的**块表**（block table）把每个逻辑块映射到物理块",
        "写时复制（copy-on-write）只复制最后一块；之后的写时复制也一样",
        "**水位线**（watermark，1%）",
        "投机解码",
        "slot mapping 和块表",
        "`block_size` 和 [块表](stages/2_block_table.md)",
        "`PrefixCachingAllocator.evictor`",
        "`Scheduler(block_manager, *,\nwatermark)`：",
        "[v0-naive-block]: https://github.com/vllm-project/vllm/blob/v0.6.6/vllm/core/block/naive_block.py",
        "第 **3** 块，也就是它的最后一个满块；第四块没写满",
        "两个序列每步用掉两块，12 块空闲",
        "共十一个部分，按这个顺序来。所以这三个测试在第 4 部分之后变绿",
        "*此时变绿：* 因缺块而丢掉的草稿",
        "所以三种设置会在不同的步结束搜索",
    ],
)
def test_the_check_leaves_the_chosen_wording_alone(fine: str):
    assert not find_rejected(prose(fine))
