"""Failure patterns of the zoo (filled from the survey)."""
from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass
class Pattern:
    key: str
    regex: str
    what: str
    repro: str


PATTERNS: list = []


def classify(row: dict) -> str:
    if row.get("result") in ("pass", "skip"):
        return ""
    text = row.get("detail", "")
    for p in PATTERNS:
        if re.search(p.regex, text):
            return p.key
    return ""
