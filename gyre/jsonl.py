"""JSON Lines, one object a line, each bad line named by its number: the reading every JSONL input of gyre shares
(rollout and session traces, a vLLM run's requests.jsonl, a code task's problem file).

`json_objects(lines, bad)` yields (line number, object) for each non-blank line, numbered from 1. A line that is
not valid JSON, or is JSON but not an object, goes to `bad(line number, reason)`, which either raises (the
reader's one-line `file:line: reason` error) or records it, and the line is skipped. The reasons are
`json_error`'s 'invalid JSON: <what> at column <n>' and 'not a JSON object'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator

NOT_AN_OBJECT = "not a JSON object"


def json_error(exc: json.JSONDecodeError) -> str:
    """'invalid JSON: <what> at column <n>' (json's "Unterminated string starting at" loses its "at")."""
    msg = exc.msg[: -len(" at")] if exc.msg.endswith(" at") else exc.msg
    return f"invalid JSON: {msg} at column {exc.colno}"


def json_objects(lines: Iterable[str], bad: Callable[[int, str], None]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line that holds a JSON object; every other line goes to `bad`."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            bad(lineno, json_error(exc))
            continue
        if not isinstance(obj, dict):
            bad(lineno, NOT_AN_OBJECT)
            continue
        yield lineno, obj
