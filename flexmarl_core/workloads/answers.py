"""Answer parsing and matching shared by the rule-based rewards.

Kept strict where the output format is ours to define (arithmetic: the whole output must be
an integer) and lenient where it is not (GSM8K-style free text: the last number counts), so
a tiny model is not rewarded for chatter and a large one is not punished for prose.
"""

from __future__ import annotations

import math
import re
from typing import Literal

MatchMode = Literal["auto", "numeric", "exact"]
MATCH_MODES: tuple[str, ...] = ("auto", "numeric", "exact")

_INT_RE = re.compile(r"-?\d+")
# A number as people write it in GSM8K answers: optional sign, thousands commas, decimals.
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_int(text: str) -> int | None:
    """The integer that `text` is, whole (surrounding whitespace allowed), else None."""
    s = text.strip()
    return int(s) if _INT_RE.fullmatch(s) else None


def parse_number(text: str) -> float | None:
    """`text` as one number ('1,234', '$5', '3.50', '42.'), else None."""
    s = text.strip().removeprefix("$").rstrip(".").replace(",", "")
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_number(text: str) -> float | None:
    """The last number written anywhere in `text` (the usual GSM8K extraction), else None."""
    found = _NUMBER_RE.findall(text)
    for raw in reversed(found):
        value = parse_number(raw)
        if value is not None:
            return value
    return None


def normalize_text(text: str) -> str:
    """Collapse whitespace and strip; case is kept (it can matter for the answer)."""
    return " ".join(text.split())


def resolve_mode(mode: MatchMode, answer: str) -> Literal["numeric", "exact"]:
    """`auto` compares numerically when the reference answer is a number."""
    if mode == "auto":
        return "numeric" if parse_number(answer) is not None else "exact"
    return mode


def answers_match(output: str, answer: str, mode: MatchMode = "auto") -> bool:
    """Whether `output` states `answer` under `mode` (numeric: last number, 1e-6 tolerance)."""
    if resolve_mode(mode, answer) == "numeric":
        want = parse_number(answer)
        got = last_number(output)
        return (
            want is not None and got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
        )
    return normalize_text(output) == normalize_text(answer)


def answer_well_formed(output: str, answer: str, mode: MatchMode = "auto") -> bool:
    """Format check for an answer-writing agent: a number (numeric) or one non-empty line."""
    if resolve_mode(mode, answer) == "numeric":
        return last_number(output) is not None
    s = output.strip()
    return bool(s) and "\n" not in s
