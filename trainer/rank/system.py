"""System metrics of a node while it trains (``--system-metrics-every``).

The node's first local rank samples the machine (CPU, memory, ``/dev/shm`` where the async
checkpoint staging buffers live, network, and each GPU that NVML sees) from a background thread
and writes each sample as a ``system`` event. MLflow tracking turns them into
``system/node_<N>/<name>`` metrics, MLflow's own names and layout for multi-node system metrics.
Going through the events keeps MLflow out of the training processes: a sample reaches MLflow when
the tracking server is up, and a server that is down costs the node nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from pathlib import Path

import psutil

from trainer.events import EventLog, SystemSample

SHM = Path("/dev/shm")
_MB = 1e6


class SystemSampler:
    """Writes a ``system`` event of this node every ``every_s`` seconds until stopped.

    Args:
        events: the rank's event log.
        node: the node (replica) rank the samples are labelled with.
        every_s: seconds between samples.
    """

    def __init__(self, events: EventLog, node: int, every_s: float) -> None:
        self.events, self.node, self.every_s = events, node, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="system-metrics", daemon=True)
        self._gpus = _nvml_handles()
        self._net0 = psutil.net_io_counters()
        psutil.cpu_percent()  # the first call only starts the measurement interval

    def start(self) -> SystemSampler:
        """Start sampling (the first sample after ``every_s``)."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop sampling: once this returns, no sample follows (the process may also exit without
        it: the thread is a daemon).
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def sample(self) -> dict[str, float]:
        """The node's figures now (CPU over the time since the previous sample)."""
        memory = psutil.virtual_memory()
        net = psutil.net_io_counters()
        metrics = {
            "cpu_utilization_percentage": psutil.cpu_percent(),
            "system_memory_usage_megabytes": (memory.total - memory.available) / _MB,
            "system_memory_usage_percentage": memory.percent,
            "network_receive_megabytes": (net.bytes_recv - self._net0.bytes_recv) / _MB,
            "network_transmit_megabytes": (net.bytes_sent - self._net0.bytes_sent) / _MB,
        }
        if SHM.is_dir():
            metrics["shm_usage_megabytes"] = psutil.disk_usage(str(SHM)).used / _MB
        for i, handle in enumerate(self._gpus):
            metrics.update(_gpu_metrics(i, handle))
        return metrics

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.events.emit(SystemSample(node=self.node, metrics=self.sample()))
            except Exception as e:  # noqa: BLE001 - a sampler that fails must never cost the training anything
                print(
                    f"rank {self.events.rank}: system metrics stopped: {type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                return


def start_system_sampler(run_dir: Path, every_s: float) -> SystemSampler | None:
    """A started sampler on the node's first local rank when ``every_s`` > 0, else None."""
    if every_s <= 0 or int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return None
    events = EventLog(run_dir, int(os.environ.get("RANK", 0)))
    return SystemSampler(events, int(os.environ.get("GROUP_RANK", 0)), every_s).start()


def _nvml_handles() -> list:
    """One NVML handle per GPU of the node ([] where there is no NVIDIA driver: a CPU node)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the 'pynvml' shim beside nvidia-ml-py warns on import
        import pynvml
    try:
        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError:
        return []


def _gpu_metrics(index: int, handle: object) -> dict[str, float]:
    import pynvml

    metrics = {}
    with contextlib.suppress(pynvml.NVMLError):
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        metrics[f"gpu_{index}_memory_usage_megabytes"] = memory.used / _MB
        metrics[f"gpu_{index}_memory_usage_percentage"] = 100 * memory.used / memory.total
        metrics[f"gpu_{index}_utilization_percentage"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        metrics[f"gpu_{index}_power_usage_watts"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
    return metrics
