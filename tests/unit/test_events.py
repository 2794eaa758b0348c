"""The events contract: one module defines every kind, the docs agree with it, nobody else parses events.

The log against other processes (a lock held elsewhere, a short write, real writers killed
mid-write): tests/integration/test_events_runs.py.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from trainer.events import (
    EVENT_TYPES,
    EVENTS_FILE,
    EventLog,
    EventTail,
    FaultFired,
    RunEnd,
    RunStart,
    Step,
    corrupt_lines,
    first_run_start_line,
    from_record,
    latest_end,
    parse_event_lines,
    read_events,
    to_record,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("trainer", "bench", "components", "pipelines")


def product_sources() -> list[tuple[str, str]]:
    """(name, Python source) of every module, notebook code cell and script heredoc, except the events module."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out += [(f"{nb.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    for script in sorted((ROOT / "scripts").glob("*.sh")):  # Python heredocs (<<'PY' ... PY)
        out += [
            (f"{script.name} heredoc {i}", src)
            for i, src in enumerate(re.findall(r"<<'PY'\n(.*?)\nPY\n", script.read_text(), re.S))
        ]
    return [(name, src) for name, src in out if not name.startswith("trainer/events/")]


def string_reads_of_events(src: str) -> list[str]:
    """Places that pick events by their on-disk kind string: ``x["event"]``, ``x.get("event")``,
    or a comparison with a kind name (``== "restart"``)."""
    found = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event":
            found.append(f'line {node.lineno}: ["event"]')
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event":
                found.append(f'line {node.lineno}: .get("event")')
        elif isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                if (
                    isinstance(c, ast.Constant)
                    and c.value in EVENT_TYPES
                    and c.value not in ("step", "checkpoint", "mirror")
                ):
                    found.append(f"line {node.lineno}: compares with {c.value!r}")
                elif isinstance(c, ast.Tuple) and any(
                    isinstance(x, ast.Constant) and x.value in EVENT_TYPES for x in c.elts
                ):
                    found.append(f"line {node.lineno}: compares with a tuple of kinds")
    return found


def test_nothing_outside_the_events_module_reads_events_by_string() -> None:
    assert any("heredoc" in name for name, _ in product_sources())  # scripts/gpu_check.sh's report is read too
    offenders = {name: hits for name, src in product_sources() if (hits := string_reads_of_events(src))}
    assert offenders == {}


def test_the_check_catches_a_string_read() -> None:
    assert string_reads_of_events('restarts = [e for e in events if e["event"] == "restart"]')
    assert string_reads_of_events('kind = record.get("event")')
    assert string_reads_of_events('done = e.kind in ("fault", "restart")')
    assert not string_reads_of_events("restarts = select(events, Restart)")


def documented_kinds() -> dict[str, str]:
    """Kind -> its row in docs/events.md's table."""
    text = (ROOT / "docs" / "events.md").read_text()
    table = text.split("<!-- events-table:start -->")[1].split("<!-- events-table:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return {re.match(r"\| `(\w+)`", row)[1]: row for row in rows}


def test_the_docs_table_lists_every_kind_and_field() -> None:
    rows = documented_kinds()
    assert sorted(rows) == sorted(EVENT_TYPES)
    for kind, cls in EVENT_TYPES.items():
        named = set(re.findall(r"`(\w+)`", rows[kind].split("|")[2]))
        fields = {f.name for f in dataclasses.fields(cls)} - {"time", "rank", "host"}
        assert fields <= named, f"{kind}: docs/events.md does not name {sorted(fields - named)}"


@pytest.mark.parametrize("kind", sorted(EVENT_TYPES))
def test_every_kind_round_trips_through_its_json_record(kind: str) -> None:
    cls = EVENT_TYPES[kind]
    samples = {int: 3, float: 1.5, str: "x", dict: {"a": 1}, list: [1, 2]}
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in ("time", "rank", "host"):
            continue
        base = str(f.type).split(" |")[0].split("[")[0]
        values[f.name] = samples[{"int": int, "float": float, "str": str, "dict": dict, "list": list}[base]]
    event = cls(time=12.0, rank=1, **values)
    record = json.loads(json.dumps(to_record(event)))
    assert record["event"] == kind and from_record(record) == event


def test_unknown_kinds_and_incomplete_records_are_skipped() -> None:
    assert from_record({"event": "something_new", "time": 1.0}) is None
    assert from_record({"event": "step", "time": 1.0, "step": 3}) is None  # no loss: torn or foreign
    assert from_record(["not", "a", "record"]) is None


def test_the_log_stamps_time_and_rank_and_the_tail_sees_only_new_events(tmp_path: Path) -> None:
    log = EventLog(tmp_path, rank=1)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=2))
    tail = EventTail(tmp_path)
    written = log.emit(Step(step=1, loss=2.0, step_time_s=0.1))
    with open(log.path, "a") as f:
        f.write('{"event": "fault", "kind": "exce')  # a line being written: not yet an event
    assert written.rank == 1 and written.time > 0
    assert tail.new() == [written]
    with open(log.path, "a") as f:
        f.write('ption", "step": 2, "time": 5.0, "rank": 0}\n')
    assert tail.new() == [FaultFired(kind="exception", step=2, time=5.0, rank=0)]
    assert [type(e) for e in read_events(tmp_path)] == [RunStart, Step, FaultFired]
    assert first_run_start_line(log.path) == log.path.read_bytes().splitlines(keepends=True)[0]


# ------------------------------------------------------------------ torn lines and foreign bytes
# A writer killed mid-write: no newline, cut inside a character.
TORN = b'{"event": "step", "step": 7, "loss": 2.5, "note": "\xc3'


def record_line(event: object) -> bytes:
    return (json.dumps(to_record(event)) + "\n").encode()


def test_a_torn_line_glued_to_a_complete_event_still_yields_that_event(tmp_path: Path) -> None:
    """What an older writer (or another program) leaves: a torn line with the next event right
    after it on the same line. The complete event is read by every reader, the kind-filtered read
    ``rfsdp train`` does after a SIGTERM included (before, it skipped the line by the torn line's
    kind, found no ``run_end`` and the preempted run exited 130)."""
    start = RunStart(config={}, resumed_from_step=0, world_size=2, time=1.0)
    end = RunEnd(status="preempted", step=7, time=2.0)
    (tmp_path / EVENTS_FILE).write_bytes(record_line(start) + TORN + record_line(end))
    assert read_events(tmp_path) == [start, end]
    assert latest_end(read_events(tmp_path, [RunStart, RunEnd])) == end
    assert corrupt_lines(tmp_path) == [2]  # reported: the torn line's own event is lost
    glued = b"\x00\x00" + record_line(start)  # a crash's zero-filled tail, then the next writer's line
    (tmp_path / EVENTS_FILE).write_bytes(glued)
    assert read_events(tmp_path) == [start] and first_run_start_line(tmp_path / EVENTS_FILE) == record_line(start)


def test_every_reader_survives_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    step = Step(step=1, loss=2.0, step_time_s=0.1, time=1.0)
    start = RunStart(config={}, resumed_from_step=0, world_size=2, time=1.0)
    raw = b"\xff\xfe\x80 not an event\n" + record_line(start) + TORN + b"\n" + record_line(step) + b"[[[[\xc3\n"
    path = tmp_path / EVENTS_FILE
    path.write_bytes(raw)
    assert read_events(tmp_path) == [start, step]
    assert read_events(tmp_path, [Step]) == [step]
    assert corrupt_lines(tmp_path) == [1, 3, 5]
    assert first_run_start_line(path) == record_line(start)
    assert EventTail(tmp_path, start=0).new() == [start, step]
    assert list(parse_event_lines(raw)) == [start, step]
    assert list(parse_event_lines(raw.decode(errors="replace"))) == [start, step]


def test_every_append_starts_on_a_new_line(tmp_path: Path) -> None:
    """A line torn by a writer that died mid-write ends where the next append begins."""
    log = EventLog(tmp_path, rank=0)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=1))
    with open(log.path, "ab") as f:
        f.write(TORN)
    written = log.emit(Step(step=1, loss=1.0, step_time_s=0.1))
    lines = log.path.read_bytes().split(b"\n")
    assert lines[1] == TORN and lines[2] == record_line(written)[:-1] and lines[3] == b""
    assert [type(e) for e in read_events(tmp_path)] == [RunStart, Step] and corrupt_lines(tmp_path) == [2]
