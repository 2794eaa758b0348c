"""ft_launcher's rank monitor (in-job restart on hangs): a rank's heartbeats, through NVRx's
fault-tolerance client.
"""

import os

from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

FT_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"


class RankMonitor:
    """Heartbeats to ft_launcher's rank monitor; inert when not running under ft_launcher."""

    _client: RankMonitorClient | None = None  # one connection per process, across in-process restarts

    def __init__(self) -> None:
        if RankMonitor._client is None and os.environ.get(FT_SOCKET_ENV):
            RankMonitor._client = RankMonitorClient()
            RankMonitor._client.init_workload_monitoring()

    def stop(self) -> None:
        """Stop being monitored: training is over, and closing down (final uploads, interpreter
        exit) must not count as a hang.
        """
        if RankMonitor._client is not None:
            RankMonitor._client.shutdown_workload_monitoring()
            RankMonitor._client = None

    def heartbeat(self) -> None:
        """Send the monitor a heartbeat: this rank still makes progress."""
        if self._client is not None:
            self._client.send_heartbeat()

    def state_dict(self) -> dict:
        """The monitor client's state (kept in every checkpoint)."""
        return dict(self._client.state_dict()) if self._client is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the state saved by :meth:`state_dict`."""
        if self._client is not None and state:
            self._client.load_state_dict(state)
