"""Token ids typed by a person (kvctl's --tokens, the dashboard's pin form): one parser,
so both take exactly the same text."""

from __future__ import annotations

import json
import re

_TOKEN_ID = re.compile(r"-?[0-9]{1,20}", re.ASCII)  # a sign only to say "out of range" below
MAX_TOKEN_ID = 2**32 - 1


def parse_token_ids(text: str) -> list[int]:
    """Integers separated by commas or spaces, or a JSON list of integers; ValueError
    says what is wrong. ASCII digits only (int() would take 1_000 and other scripts'
    digits), no empty field ("1,,2" is a slip), none outside [0, 2^32), not empty (an
    empty prefix would read as "the whole namespace")."""
    text = text.strip()
    if not text:
        raise ValueError("no tokens given")
    usage = "token ids must be integers, separated by commas or spaces (or a JSON list)"
    if text.startswith("["):
        try:
            values = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError(usage) from None
        # a JSON list holds integers only: 1.9 or true is a mistake, never a token id
        bad = [v for v in values if type(v) is not int] if isinstance(values, list) else [values]
        if bad:
            raise ValueError(f"{usage}; got {json.dumps(bad[0])[:40]}")
        tokens = values
    else:
        parts = re.split(r"\s*,\s*|\s+", text)
        wrong = next((p for p in parts if not _TOKEN_ID.fullmatch(p)), None)
        if wrong is not None:
            raise ValueError(f"{usage}; got {'an empty field' if not wrong else repr(wrong[:40])}")
        tokens = [int(p) for p in parts]
    if not tokens:
        raise ValueError("no tokens given")
    bad = [t for t in tokens if t < 0 or t > MAX_TOKEN_ID]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of range [0, 2^32)")
    return tokens
