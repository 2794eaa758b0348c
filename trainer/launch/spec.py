"""How a job is laid out: replicas, processes per replica, and the in-job restart budget."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import ParameterError


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How many replicas (nodes) and processes, and the in-job restart budget."""

    nnodes: int = 1
    nproc_per_node: int = 2
    max_restarts: int = 3

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise ParameterError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ParameterError("max_restarts", f"must be at least 0, got {self.max_restarts}")

    @property
    def world_size(self) -> int:
        """Total ranks."""
        return self.nnodes * self.nproc_per_node
