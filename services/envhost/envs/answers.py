"""Reading a number out of a model's reply, shared by the built-in verifiers."""

from __future__ import annotations

import re

# An optional sign, then either comma-grouped thousands ("1,234") or plain digits,
# then an optional decimal part. A leading "$" is skipped by the search itself.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_MARK = "####"


def _value(token: str) -> float:
    return float(token.replace(",", ""))


def first_number(text: str) -> float | None:
    """The first number in `text` (after stripping), or None when there is none.

    "42", " 42.", "The answer is 42" and "$1,200" read as 42, 42, 42 and 1200;
    "3 + 4 = 7" reads as 3: a verifier that takes the first number does not reward a
    reply that merely mentions the answer after restating the question.
    """
    m = _NUMBER.search(text.strip())
    return _value(m.group()) if m else None


def final_number(text: str) -> float | None:
    """The answer a reply ends on: the first number after the last "####" if the reply
    uses GSM8K's answer mark, otherwise the last number in the reply; None if none."""
    if _MARK in text:
        return first_number(text.rsplit(_MARK, 1)[1])
    found = _NUMBER.findall(text)
    return _value(found[-1]) if found else None


def same_number(got: float | None, want: float) -> bool:
    """Numeric equality with a tolerance for float noise ("72.0" == 72)."""
    return got is not None and abs(got - want) <= 1e-6 * max(1.0, abs(want))
