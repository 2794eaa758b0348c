"""The events contract: ``RUN_DIR/events.jsonl``, the append-only record every other part reads.

Every event kind is a typed record (``records``: :data:`EVENT_TYPES`); :class:`EventLog` writes
them and :func:`read_events` reads them back (``log``). The questions other parts ask of a run
(each step's final loss, the restarts, the checkpoint stalls, goodput) are answered here
(``history``) and nowhere else, so the trainer, the validator, MLflow tracking, the notebook and
the benchmarks cannot disagree.
``docs/events.md`` documents the same kinds and fields (a test holds the two together).

On disk each line is one JSON object: ``event`` (the kind), ``time`` (unix seconds), ``rank``
(-1: the launcher) and the kind's fields. Lines are appended under a POSIX lock so that several
processes (on several hosts, over NFS too) can share the file. An append is whole or absent, and
starts on a new line even after a line torn by a writer killed mid-write; readers take any bytes
(torn lines, bytes that are not UTF-8) and skip what is not an event. A reserve file beside the
log keeps room for the last words of a run (``fatal``, ``run_end``) on a full volume.
"""

from trainer.events.history import (
    durable_checkpoints,
    fatal_error,
    final_losses,
    final_steps,
    latest_end,
    restarts_with_faults,
    select,
    session_failures,
    session_finished,
    sessions,
    summarize,
)
from trainer.events.log import (
    EventLog,
    EventTail,
    corrupt_lines,
    first_run_start_line,
    iter_events,
    parse_event_lines,
    read_events,
)
from trainer.events.records import (
    CHECKPOINT_TIERS,
    EVENT_TYPES,
    EVENTS_FILE,
    FAILURE_CATEGORIES,
    FATAL_REASONS,
    RESTART_LAYERS,
    RESTART_SOURCES,
    SAVE_PHASES,
    Checkpoint,
    CheckpointFailed,
    E,
    Event,
    Failure,
    Fatal,
    FaultFired,
    Mirror,
    MirrorFailed,
    MirrorRestore,
    NodesPreempted,
    Restart,
    RunEnd,
    RunStart,
    RunWarning,
    Step,
    SystemSample,
    from_record,
    to_record,
)

__all__ = [
    "CHECKPOINT_TIERS",
    "Checkpoint",
    "CheckpointFailed",
    "E",
    "EVENTS_FILE",
    "EVENT_TYPES",
    "Event",
    "EventLog",
    "EventTail",
    "FAILURE_CATEGORIES",
    "FATAL_REASONS",
    "Failure",
    "Fatal",
    "FaultFired",
    "Mirror",
    "MirrorFailed",
    "MirrorRestore",
    "NodesPreempted",
    "RESERVE_BYTES",
    "RESERVE_FILE",
    "RESTART_LAYERS",
    "RESTART_SOURCES",
    "Restart",
    "RunEnd",
    "RunStart",
    "RunWarning",
    "SAVE_PHASES",
    "Step",
    "SystemSample",
    "corrupt_lines",
    "durable_checkpoints",
    "fatal_error",
    "final_losses",
    "final_steps",
    "first_run_start_line",
    "from_record",
    "iter_events",
    "latest_end",
    "parse_event_lines",
    "read_events",
    "restarts_with_faults",
    "select",
    "session_failures",
    "session_finished",
    "sessions",
    "summarize",
    "to_record",
]
