"""What every benchmark shares: the data set, launching real jobs, interleaving, statistics,
the results table and the JSON file.

Absolute times on a shared machine are noisy; every benchmark therefore runs the compared
methods in interleaved repetitions (method order rotated each round) and reports ratios.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainer.data import BUILTIN_CORPUS
from trainer.data.shards import builtin_corpus_text, load_manifest, prepare_tokens
from trainer.events import Event, FaultFired, Restart, RunStart, Step
from trainer.launch.local import free_port, launch_local
from trainer.launch.spec import LaunchSpec
from trainer.rank.config import TrainConfig

DEFAULT_WORK = Path("work/bench")


def median(values: Sequence[float]) -> float | None:
    """Median of the values (None when there are none)."""
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, None when either is missing or the denominator is zero."""
    return num / den if num is not None and den else None


def interleaved(methods: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, method)`` pairs: every method once per round, the order rotated each round so
    that no method always runs first (or right after the same other one).
    """
    for r in range(rounds):
        k = r % len(methods)
        for method in [*methods[k:], *methods[:k]]:
            yield r, method


def ensure_data(work: Path) -> Path:
    """The builtin corpus prepared once under ``work/data`` (reused by later runs)."""
    data = work / "data"
    try:
        load_manifest(data)
    except ValueError:
        prepare_tokens(builtin_corpus_text(), data, source=BUILTIN_CORPUS)
    return data


def fresh_dir(path: Path) -> Path:
    """An empty directory at ``path`` (whatever was there is removed)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def run_rfsdp(cfg: TrainConfig, *, max_restarts: int = 3) -> tuple[int, float]:
    """Our stack, exactly as ``rfsdp train`` runs it (ft_launcher per replica, wrapper inside).

    Returns (exit code, wall seconds).
    """
    t0 = time.perf_counter()
    code = launch_local(
        cfg, LaunchSpec(nnodes=1, nproc_per_node=cfg.world_size, max_restarts=max_restarts), progress=False
    )
    return code, time.perf_counter() - t0


def run_torchrun(
    module: str, args: Sequence[str], log: Path, *, nproc: int = 2, max_restarts: int = 0, timeout: float = 1800
) -> tuple[int, float]:
    """``torchrun`` (as ``python -m torch.distributed.run``) running ``python -m module args`` on
    ``nproc`` local ranks with a c10d rendezvous on a free loopback port; output in ``log``.

    Returns (exit code, wall seconds).
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--monitor-interval",
        "0.1",  # the same as our ft_launcher's
        "-m",
        module,
        *args,
    ]
    # By default torchrun's workers share the rendezvous store across restarts; a restarted
    # worker then reads the dead attempt's address of a second gloo group (the trainer's
    # checkpoint group) and fails to connect. A fresh store per restart (ft_launcher's behaviour).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"torchrun -m {module} did not finish within {timeout:.0f} s (log: {log})") from None
        finally:
            if proc.poll() is None:  # timed out or interrupted: take the whole job down
                os.killpg(proc.pid, 9)
                proc.wait()
    return code, time.perf_counter() - t0


def run_torchrun_trainer(cfg: TrainConfig, *, max_restarts: int, timeout: float = 1800) -> tuple[int, float]:
    """The same trainer under plain ``torchrun --max-restarts`` (no ft_launcher, no heartbeats):
    what a user runs without this project. Returns (exit code, wall seconds).
    """
    if cfg.inprocess_restart:
        raise ValueError("torchrun runs the trainer without in-process restart (inprocess_restart=False)")
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    log = Path(cfg.run_dir) / "logs" / "torchrun.log"
    return run_torchrun(
        "trainer.rank.train", cfg.to_argv(), log, nproc=cfg.world_size, max_restarts=max_restarts, timeout=timeout
    )


def fault_recoveries(events: list[Event]) -> list[dict]:
    """Each injected fault of a run, in order, and how the run came back from it.

    Measured from the ``fault``, ``step``, ``restart`` and ``run_start`` events, the same way for every launcher.
    The run is back at the first step of the attempt that followed the fault: the step just
    before the next ``restart`` event (written right after that step), or the first step after
    the next ``run_start`` (a cold restart). Not simply the first step after the fault: a
    surviving rank of the dead attempt may still log the step it was finishing.
    ``recovery_s``: from the fault to that step; ``lost_steps``: the steps completed before it
    and redone after it; ``resumed_from_step``; ``layer``, ``source`` (the checkpoint tier resumed
    from) and ``phases`` (when each stage of the recovery ended, seconds after the fault) from the
    ``restart`` event (``cold``, ``durable`` and None for a cold restart).

    Raises:
        RuntimeError: no step was completed after a fault.
    """
    out = []
    for i, fault in enumerate(events):
        if not isinstance(fault, FaultFired):
            continue
        k, restart = _back_after(events, i)
        if k is None:
            raise RuntimeError(f"no step completed after the fault {fault.kind} at step {fault.step}")
        first = events[k]
        done = max((e.step for e in events[:k] if isinstance(e, Step)), default=0)
        out.append(
            {
                "kind": fault.kind,
                "step": fault.step,
                "rank": fault.rank,
                "recovery_s": first.time - fault.time,
                "lost_steps": max(0, done - (first.step - 1)),
                "resumed_from_step": first.step - 1,
                "layer": restart.layer if restart else "cold",
                "source": restart.source if restart else "durable",
                "phases": restart.phases if restart else None,
            }
        )
    return out


def _back_after(events: list[Event], i: int) -> tuple[int | None, Restart | None]:
    """Where the first step of the attempt that followed the fault ``events[i]`` is in
    ``events``, and its ``restart`` event.
    """
    for j in range(i + 1, len(events)):
        if isinstance(events[j], Restart):
            return _first_step(events, range(j - 1, i, -1)), events[j]
        if isinstance(events[j], RunStart):
            return _first_step(events, range(j, len(events))), None
    # No new attempt (a fault the run rode through): the next step it completed.
    return _first_step(events, range(i, len(events))), None


def _first_step(events: list[Event], indices: range) -> int | None:
    """The first of ``indices`` that holds a ``step`` event."""
    return next((k for k in indices if isinstance(events[k], Step)), None)


def machine() -> dict:
    """What the figures were measured on."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    mem_kb = next(
        (int(line.split()[1]) for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")), 0
    )
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(mem_kb / 2**20, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    """A table cell: a number with its unit, or a dash."""
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: str = "", console: Console | None = None
) -> None:
    """A rich table: first column left-aligned, the rest right-aligned."""
    table = Table(title=title, caption=caption or None, caption_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    (console or Console()).print(table)


def median_stages(timelines: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """Per recovery stage, in the order first seen, the median over the ``restart`` events'
    ``phases`` that have it of when it ended (seconds after the fault); None counts as no stage.
    """
    stages = list(dict.fromkeys(k for t in timelines for k in t or {}))
    return {k: statistics.median(t[k] for t in timelines if t and k in t) for k in stages}


def print_stages(title: str, rows: Sequence[tuple[str, dict[str, float]]]) -> None:
    """One row per label: when each recovery stage ended, its columns in the order of the longest
    timeline (an in-process restart has no process start or imports).
    """
    longest = max((stages for _, stages in rows), key=len, default={})
    columns = list(dict.fromkeys([*longest, *(k for _, stages in rows for k in stages)]))
    print_table(
        title,
        ["fault: method", *columns],
        [[label, *(fmt(stages.get(k), digits=1) for k in columns)] for label, stages in rows],
    )


def target(name: str, value: float | None, limit: float, *, at_least: bool = False) -> dict:
    """One of the issue's targets and whether this run met it."""
    met = value is not None and (value >= limit if at_least else value <= limit)
    return {"target": name, "value": value, "limit": limit, "met": met}


def print_targets(targets: Sequence[dict], console: Console | None = None) -> None:
    """The targets as lines under a table."""
    console = console or Console()
    for t in targets:
        mark = "[green]met[/green]" if t["met"] else "[red]not met[/red]"
        console.print(f"  target {t['target']}: {fmt(t['value'])} (limit {t['limit']:g}) {mark}")


def write_json(path: Path, results: dict) -> None:
    """Write the results (with the machine description) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
