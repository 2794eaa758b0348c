"""How a job is laid out (replicas, processes per replica, the in-job restart budget) and what it
is called (the training run's name: its PyTorchJob and its folder on the shared volume).
"""

from __future__ import annotations

import hashlib
import re
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


_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RUN_NAME_MAX = 63 - len("-worker-00")
"""Longest run name whose PyTorchJob pods (``NAME-worker-NN``) are still DNS labels."""


def check_run_name(name: str) -> str:
    """``name`` if it can name a training run (a DNS-1035 label of at most ``RUN_NAME_MAX`` characters):
    the run's folder on the shared volume and its PyTorchJob (``trainer.launch.k8s``), one rule for both.

    Raises:
        ParameterError: naming the pipeline parameter ``training_run``.
    """
    if len(name) > RUN_NAME_MAX or not _DNS_1035.match(name):
        raise ParameterError(
            "training_run",
            f"{name!r} is not a DNS-1035 label of at most {RUN_NAME_MAX} characters "
            "(a-z, 0-9, '-'; starting with a letter)",
            style="parameter",
        )
    return name


def resolve_run_name(training_run: str, pipeline_job: str, pipeline_job_id: str) -> str:
    """The training run's name: ``training_run`` when given (a rerun under it resumes the run), else
    one derived from the KFP run, so that two runs started with the defaults never share a run.

    Args:
        training_run: the pipeline parameter ("" = derive from the KFP run).
        pipeline_job: the KFP run's job name (``dsl.PIPELINE_JOB_NAME_PLACEHOLDER``).
        pipeline_job_id: the KFP run's id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``).

    Raises:
        ParameterError: ``training_run`` is not a usable name.
    """
    if training_run:
        return check_run_name(training_run)
    # A digest: KFP's job names are longer than a label allows and not always DNS-safe.
    return "rfsdp-" + hashlib.sha256(f"{pipeline_job}/{pipeline_job_id}".encode()).hexdigest()[:12]
