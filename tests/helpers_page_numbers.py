"""Every number on a documentation page computed, and standing in its own sentence.

A page's section is checked against fragments of its sentences, each fragment holding computed
numbers: a fragment must appear in the section as computed, and once every fragment is taken out
of it no number may be left, in digits or as a multiple written in words ("two to four times",
"twice", 两到四倍), so none goes unchecked. ``mutants`` and ``assert_refuses_mutants`` prove the
check refuses a fragment with one computed number off by a digit, or with two of its numbers
traded.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Iterable, Iterator, Mapping

NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
# A multiple written in words: "two to four times", "twice", 两到四倍.
_EN_WORD = r"(?:one|two|three|four|five|six|seven|eight|nine|ten)"
NUMBER_WORDS = re.compile(rf"\b{_EN_WORD}(?:\s+(?:to|or)\s+{_EN_WORD})?\s+times\b|\btwice\b"
                          r"|[一二两三四五六七八九十]+(?:到[一二两三四五六七八九十]+)?倍", re.IGNORECASE)
_CJK = "\u2e80-\u9fff\u3000-\u303f\uff00-\uffef“”"


def normalised(text: str) -> str:
    """One line; a line break between Chinese characters is no space, as in Chinese prose."""
    text = re.sub(rf"(?<=[{_CJK}])[ \t]*\n\s*(?=[{_CJK}])", "", text)
    return " ".join(text.split())


def section_problems(body: str, fragments: list[str], names: re.Pattern[str], prefix: str = "") -> list[str]:
    """What is wrong with one section's numbers: a fragment (already formatted) not found in it, or a
    number (in digits, or a multiple in words) that no fragment accounts for once the fragments and
    the page's ``names`` (names whose digits are not numbers of the argument) are taken out."""
    found = [f"{prefix}not found: {f!r}" for f in fragments if f not in body]
    for fragment in sorted(fragments, key=len, reverse=True):
        body = body.replace(fragment, " | ")
    rest = names.sub(" ", body)
    left = NUMBER.findall(rest) + NUMBER_WORDS.findall(rest)
    return found + [f"{prefix}no fragment accounts for {number!r}" for number in left]


def mutants(templates: Iterable[tuple[str, str]], n: Mapping[str, str]) -> Iterator[tuple[str, str, str, str]]:
    """For each (section, template): the template with one computed number off by a digit (or, for a
    number in words, with a letter added), and with its first number traded for the first that
    differs from it; as (section, what, original, mutant)."""
    for name, template in templates:
        fields = list(dict.fromkeys(field for _, field, _, _ in string.Formatter().parse(template) if field))
        original = template.format(**n)
        for field in fields:
            value = n[field]
            wrong = value[:-1] + str((int(value[-1]) + 1) % 10) if value[-1].isdigit() else value + "x"
            yield name, f"{field} changed", original, template.format(**{**n, field: wrong})
        distinct = [f for f in fields if n[f] != n[fields[0]]] if fields else []
        if distinct:
            a, b = fields[0], distinct[0]
            yield name, f"{a} and {b} swapped", original, template.format(**{**n, a: n[b], b: n[a]})


def assert_refuses_mutants(by_section: Mapping[str, str], problems: Callable[[Mapping[str, str]], list[str]],
                           changed: Iterable[tuple[str, str, str, str]], more_than: int, label: str) -> None:
    """The page, by section, passes ``problems``; each of the ``changed`` fragments, put in its
    section in place of the original, is refused; and there are more than ``more_than`` of them."""
    assert not problems(by_section)
    count = 0
    for name, what, original, mutant in changed:
        assert original in by_section[name]
        wrong = {**by_section, name: by_section[name].replace(original, mutant)}
        assert problems(wrong), f"{label}: {what} in {original!r} is not caught"
        count += 1
    assert count > more_than
