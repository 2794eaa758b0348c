"""``rfsdp bench``: run the benchmarks, print their tables, write one JSON file."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType

from rich.console import Console

from bench import checkpoint, crossover, goodput, load, overhead, recovery, soak
from bench.common import DEFAULT_WORK, ensure_data, machine, write_json

BENCHMARKS: dict[str, ModuleType] = {
    "checkpoint": checkpoint,
    "recovery": recovery,
    "overhead": overhead,
    "goodput": goodput,
    "soak": soak,
    "load": load,
    "crossover": crossover,
}


def run_benchmarks(
    names: list[str],
    *,
    quick: bool,
    json_path: Path | None,
    work: Path | None = None,
    options: dict[str, dict] | None = None,
) -> int:
    """Run the named benchmarks one after the other; returns 0 when all of them succeeded.

    The JSON file is rewritten after each benchmark, so a long run leaves partial results. A
    benchmark that fails is recorded with its error and the others still run. ``options``: per
    benchmark name, keyword arguments of its ``run`` (e.g. ``{"soak": {"fault_every": 30.0}}``).
    """
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r} (known: {', '.join(BENCHMARKS)}, all)")
    if json_path is not None:
        json_path = Path(json_path)
        try:
            json_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--json: cannot create {json_path.parent} ({e.strerror})") from None
        if json_path.is_dir() or not os.access(json_path.parent, os.W_OK):
            raise ValueError(f"--json: cannot write {json_path}")
    console = Console()
    work = Path(work or DEFAULT_WORK).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = ensure_data(work)
    results: dict = {
        "command": "rfsdp bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 2
        else "rfsdp bench",
        "quick": quick,
        "machine": machine(),
        "benchmarks": {},
    }
    failed = False
    for name in names:
        console.rule(f"{name}{' (quick)' if quick else ''}")
        t0 = time.perf_counter()
        try:
            result = BENCHMARKS[name].run(quick, work, data, **(options or {}).get(name, {}))
        except RuntimeError as e:  # a run that failed: its logs are under work/
            console.print(f"[red]{name} failed:[/red] {e}")
            result, failed = {"benchmark": name, "error": str(e)}, True
        else:
            BENCHMARKS[name].show(result)
        result["wall_s"] = time.perf_counter() - t0
        results["benchmarks"][name] = result
        if json_path is not None:
            write_json(json_path, results)
    if json_path is not None:
        console.print(f"results written to {json_path}")
    return 1 if failed else 0
