"""The events contract: one module defines every kind, the docs agree with it, nobody else parses events."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from trainer.events import (
    EVENT_TYPES,
    EventLog,
    EventTail,
    FaultFired,
    RunStart,
    Step,
    first_run_start_line,
    from_record,
    read_events,
    to_record,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("trainer", "bench", "components", "pipelines")


def product_sources() -> list[tuple[str, str]]:
    """(name, Python source) of every module, notebook code cell and script heredoc, except the events module."""
    out = [(str(p.relative_to(ROOT)), p.read_text()) for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out += [(f"{nb.name} cell {i}", "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    for script in sorted((ROOT / "scripts").glob("*.sh")):  # Python heredocs (<<'PY' ... PY)
        out += [(f"{script.name} heredoc {i}", src) for i, src in enumerate(re.findall(r"<<'PY'\n(.*?)\nPY\n", script.read_text(), re.S))]
    return [(name, src) for name, src in out if name != "trainer/events.py"]


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
                if isinstance(c, ast.Constant) and c.value in EVENT_TYPES and c.value not in ("step", "checkpoint", "mirror"):
                    found.append(f"line {node.lineno}: compares with {c.value!r}")
                elif isinstance(c, ast.Tuple) and any(isinstance(x, ast.Constant) and x.value in EVENT_TYPES for x in c.elts):
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
    samples = {int: 3, float: 1.5, str: "x", dict: {"a": 1}}
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in ("time", "rank", "host"):
            continue
        base = str(f.type).split(" |")[0].split("[")[0]
        values[f.name] = samples[{"int": int, "float": float, "str": str, "dict": dict}[base]]
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


def test_an_event_is_appended_under_the_file_lock(tmp_path: Path) -> None:
    """Another process (another host over NFS) holding the lock keeps the append waiting."""
    log = EventLog(tmp_path, rank=0)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=1))
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, os, sys; fd = os.open({str(log.path)!r}, os.O_WRONLY); fcntl.lockf(fd, fcntl.LOCK_EX); "
         "print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "locked"
    writer = threading.Thread(target=log.emit, args=(Step(step=1, loss=1.0, step_time_s=0.1),))
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and [type(e) for e in read_events(tmp_path)] == [RunStart]
    holder.stdin.close()  # the holder exits: its lock goes with it
    holder.wait(10)
    writer.join(10)
    assert [type(e) for e in read_events(tmp_path)] == [RunStart, Step]
