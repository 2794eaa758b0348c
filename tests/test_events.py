"""The events contract: one module defines every kind, the docs agree with it, nobody else parses events."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT as REPO
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


# ------------------------------------------------------------------ torn lines and foreign bytes
TORN = b'{"event": "step", "step": 7, "loss": 2.5, "note": "\xc3'  # a writer killed mid-write: no newline, cut inside a character


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


def test_an_append_is_whole_or_absent(tmp_path: Path) -> None:
    """A write the file system cuts short (here the file size limit, RLIMIT_FSIZE: a short write,
    then EFBIG, as a full volume gives a short write, then ENOSPC) leaves the file as it was and
    raises an error that names it."""
    log = EventLog(tmp_path, rank=0)
    log.emit(RunStart(config={}, resumed_from_step=0, world_size=1))
    before = log.path.read_bytes()
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from trainer.events import EventLog, Step\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({len(before) + 20}, resource.RLIM_INFINITY))\n"
        "try:\n"
        f"    EventLog(Path({str(tmp_path)!r}), 0).emit(Step(step=1, loss=1.0, step_time_s=0.1))\n"
        "except OSError as e:\n"
        "    print(e)\n"
        "    sys.exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert str(log.path) in proc.stdout  # the error names the file
    assert log.path.read_bytes() == before  # nothing of the event: not even its first 20 bytes


@pytest.mark.slow
def test_a_torn_line_right_before_run_end_leaves_the_outcome_readable(data_dir: Path, tmp_path: Path) -> None:
    """Real writers killed mid-write: the ``corrupt-event`` fault tears a line (no newline, not
    UTF-8) before step 3's event; once rank 1 hangs at step 5 (nobody writes), a process holding
    the lock writes half a line and is SIGKILLed; then rank 1 is killed and, with no restart left,
    the launcher's ``run_end`` follows the torn line. Every complete event is read, the torn lines
    stand alone, and the summary reads the file (before, both glued events were lost and a
    non-UTF-8 byte crashed the readers)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "trainer.cli", "train", "--quiet", "--data", str(data_dir), "--run-dir", str(run), "--steps", "40",
        "--fault", "corrupt-event@3,hang@5:1", "--no-inprocess-restart", "--max-restarts", "0", "--hang-timeout", "3600",
    ]  # fmt: skip
    # (the hang is ended by the kill below, never by its timeout)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not any(isinstance(e, FaultFired) and e.kind == "hang" for e in read_events(run)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        writer = subprocess.run(
            [sys.executable, "-c", "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND); "
             "fcntl.lockf(fd, fcntl.LOCK_EX); os.write(fd, sys.argv[2].encode()); os.kill(os.getpid(), signal.SIGKILL)",
             str(run / EVENTS_FILE), '{"event": "system", "node": 0, "metrics": {"cpu'],
            timeout=60,
        )  # fmt: skip
        assert writer.returncode == -signal.SIGKILL
        os.kill(_worker_of_rank(proc.pid, 1), signal.SIGKILL)  # the hung rank: the job fails, no restart left
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    events = read_events(run)
    assert isinstance(events[-1], RunEnd) and events[-1].status == "failed", events[-3:]
    assert 3 in {e.step for e in events if isinstance(e, Step)}  # the event written after the fault's torn line
    raw = (run / EVENTS_FILE).read_bytes()
    assert raw.endswith(b"\n")
    torn = corrupt_lines(run)
    assert len(torn) == 2 and len(raw.split(b"\n")) - 1 == len(events) + 2  # each torn line on its own
    show = f"from pathlib import Path; from trainer.results.summary import print_run_summary; print_run_summary(Path({str(run)!r}))"
    summary = subprocess.run([sys.executable, "-c", show], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0 and f"2 skipped (line {torn[0]}, {torn[1]})" in summary.stdout, summary.stderr


def _worker_of_rank(train_pid: int, rank: int) -> int:
    """The pid of the worker process ft_launcher started for ``rank`` (its direct child)."""
    for launcher in _children(train_pid):
        if b"ft_launcher" not in Path(f"/proc/{launcher}/cmdline").read_bytes():
            continue
        for pid in _children(launcher):
            with contextlib.suppress(OSError):
                if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    return pid
    raise AssertionError(f"no worker of rank {rank} under {train_pid}")


def _children(pid: int) -> list[int]:
    return [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
