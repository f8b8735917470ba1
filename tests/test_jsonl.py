"""gyre.jsonl: every JSONL reader's shared line loop, and the one-line errors the three readers built on it give."""

from __future__ import annotations

import json

import pytest

from gyre.jsonl import json_objects


def test_objects_come_with_their_line_numbers_and_bad_lines_go_to_bad():
    """Blank lines are skipped but counted; a line not JSON and a line not an object each reach `bad` with its number."""
    lines = ['{"a": 1}', "", "   ", "{oops", "[1, 2]", '{"b": 2}']
    seen: list[tuple[int, str]] = []
    got = list(json_objects(lines, lambda n, why: seen.append((n, why))))
    assert got == [(1, {"a": 1}), (6, {"b": 2})], got
    assert [n for n, _ in seen] == [4, 5], seen
    assert seen[0][1].startswith("invalid JSON: ") and "at column 2" in seen[0][1], seen[0]
    assert seen[1][1] == "not a JSON object", seen[1]


def test_a_raising_bad_stops_at_the_first_bad_line():
    """With a `bad` that raises, nothing after the first bad line is read."""
    read: list[int] = []

    def bad(n: int, why: str) -> None:
        raise ValueError(f"f:{n}: {why}")

    with pytest.raises(ValueError, match=r"^f:2: not a JSON object$"):
        for n, _ in json_objects(['{"x": 0}', '"text"', '{"y": 1}'], bad):
            read.append(n)
    assert read == [1], read


def test_the_three_readers_name_file_and_line(tmp_path):
    """A bad line in a request trace, a vLLM run's requests.jsonl and a code task file is one error `path:line: reason`."""
    from gyre.real.tasks.code import read_problems
    from gyre.sim.vllm_check.serving_run import RunError, read_requests
    from gyre.traces.readers import read_request_jsonl
    from gyre.traces.schema import TraceError

    good = json.dumps({"timestamp": 0.0, "input_length": 10, "output_length": 5})
    trace = tmp_path / "t.jsonl"
    trace.write_text(good + "\n[1]\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not a JSON object"):
        read_request_jsonl(trace)
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text("\n{bad\n")
    with pytest.raises(RunError, match=r"requests\.jsonl:2: invalid JSON: "):
        read_requests(reqs)
    probs = tmp_path / "p.jsonl"
    probs.write_text("7\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: not a JSON object"):
        read_problems(probs)
