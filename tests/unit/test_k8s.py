"""The Kubernetes backend's manifest: the PyTorchJob against the vendored CRD's structural schema
and the operator's webhook rules as the emulated API server applies them (no root needed here),
and one launch contract with the local backend (the operator emulator's injected environment).
Creating, following, cancelling and running the job: tests/e2e/test_cluster.py, on the emulated cluster.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from kubernetes import client as k8s

from pipelines.resilient_fsdp import check_parameters, pytorchjob_manifest
from trainer.checkpoint import SIGNING_KEY_ENV
from trainer.emulation.apiserver import ApiError, CrdSchema, webhook_violations
from trainer.emulation.operator import operator_env as injected_env
from trainer.errors import ParameterError, as_pipeline_parameters
from trainer.launch import CREDENTIAL_SECRETS
from trainer.launch.k8s import build_pytorchjob, cluster_options, shared_paths
from trainer.launch.local import check_run_dir, job_from_parameters, operator_env, worker_command
from trainer.rank.config import TrainConfig

TRACKED = {"tracking_uri": "http://mlflow.example"}  # a kubernetes run needs one


@pytest.fixture(scope="module")
def schema() -> CrdSchema:
    return CrdSchema()


def admitted(schema: CrdSchema, job: dict) -> dict:
    """``job`` as the API server stores it (strict field validation: an unknown field is refused)."""
    job = copy.deepcopy(job)
    schema.admit(job, field_validation="Strict")
    return job


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: dict) -> list[str]:
    """What the Pod Security Standards' "restricted" profile (v1.32) refuses in a pod spec, as the
    admission controller of a namespace labelled ``pod-security.kubernetes.io/enforce=restricted`` does."""
    found = []
    pod_ctx = pod.get("securityContext") or {}
    if any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
        found.append("host namespaces")
    found += [f"volume {v['name']}" for v in pod.get("volumes") or [] if not RESTRICTED_VOLUMES & set(v)]
    for c in pod["containers"] + (pod.get("initContainers") or []):
        ctx, name = c.get("securityContext") or {}, c["name"]
        if ctx.get("privileged"):
            found.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation != false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities not dropped (ALL)")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot != true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"{name}: hostPort")
    return found


CASES = [
    {},
    {"nnodes": 2, "nproc_per_node": 1},
    {"nnodes": 4, "nproc_per_node": 8, "gpus": True, "model": "1b", "job_namespace": "team-a", "grace_period": 120.0},
]


@pytest.mark.parametrize("overrides", CASES)
def test_manifest_validates_against_crd_and_webhook_rules(schema: CrdSchema, overrides: dict) -> None:
    job = pytorchjob_manifest(overrides)
    assert admitted(schema, job) == job  # valid, and nothing pruned or defaulted: stored as sent
    assert webhook_violations(job) == []
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == overrides.get("nnodes", 1) and worker["restartPolicy"] == "OnFailure"
    assert job["spec"]["nprocPerNode"] == str(overrides.get("nproc_per_node", 2))
    assert job["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"
    pod = worker["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"] == {
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert restricted_violations(pod) == []  # a namespace that enforces Pod Security "restricted" admits it
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == (str(overrides["nproc_per_node"]) if overrides.get("gpus") else None)
    # The ranks' time to checkpoint on SIGTERM, plus the launcher's own exit.
    assert pod["terminationGracePeriodSeconds"] == int(overrides.get("grace_period", 30)) + 15
    # Every credential secret, each optional, the checkpoint signing key among them.
    assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": s, "optional": True}} for s in CREDENTIAL_SECRETS]
    assert CREDENTIAL_SECRETS["rfsdp-checkpoint-key"] == (SIGNING_KEY_ENV,)


def test_the_schema_and_rules_catch_bad_manifests(schema: CrdSchema) -> None:
    job = pytorchjob_manifest({})
    typo = copy.deepcopy(job)
    typo["spec"]["elasticPolicy"]["rdzvBackendd"] = "c10d"
    with pytest.raises(ApiError, match='unknown field "spec.elasticPolicy.rdzvBackendd"'):
        admitted(schema, typo)
    bad_user = copy.deepcopy(job)
    bad_user["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["securityContext"]["runAsUser"] = "1000"
    with pytest.raises(ApiError, match="securityContext.runAsUser: Invalid value"):
        admitted(schema, bad_user)
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["nprocPerNode"] = 2  # the webhook needs a string; the schema already refuses it
    with pytest.raises(ApiError, match="spec.nprocPerNode: Invalid value: 2"):
        admitted(schema, wrong_type)
    renamed = copy.deepcopy(job)
    renamed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    assert [v.split(":")[0] for v in webhook_violations(renamed)] == [
        "spec.pytorchReplicaSpecs[Worker].template.spec.containers"
    ]


def test_one_launch_contract_local_and_cluster() -> None:
    """The pod runs exactly the local worker command, and the environment the operator injects
    from the job's elasticPolicy is what the local backend injects."""
    params = check_parameters({"nnodes": 3, "nproc_per_node": 2, "max_restarts": 5, "fault": "sigkill@7:5", **TRACKED})
    data, run_dir = shared_paths("exp-1")
    cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
    job = k8s.ApiClient().sanitize_for_serialization(
        build_pytorchjob(cfg, spec, cluster_options({**params, "training_run": "exp-1"}))
    )
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == worker_command(cfg)
    operator = {e["name"]: e["value"] for e in injected_env(job, "Worker", 1)}
    local = operator_env(spec, rdzv_endpoint=operator["PET_RDZV_ENDPOINT"], job_id="job-uid")
    # The local launcher also names its rendezvous; the operator does only for an elasticPolicy.rdzvId.
    assert {k: v for k, v in local.items() if k != "PET_RDZV_ID"} == operator
    assert operator["PET_RDZV_ENDPOINT"] == "exp-1-worker-0:29400"
    assert {"name": "pytorchjob-port", "containerPort": 29400, "protocol": "TCP"} in container["ports"]


def test_the_operator_env_with_a_master_replica() -> None:
    """Without an elasticPolicy and with a Master, the operator names the master and each pod's
    rank (Workers count from 1) and the world in processes (docs/cluster.md, field notes)."""
    job = pytorchjob_manifest({**TRACKED, "nnodes": 2, "nproc_per_node": 4})
    spec = job["spec"]
    del spec["elasticPolicy"]
    spec["pytorchReplicaSpecs"] = {
        "Master": {**spec["pytorchReplicaSpecs"]["Worker"], "replicas": 1},
        **spec["pytorchReplicaSpecs"],
    }
    env = {e["name"]: e["value"] for e in injected_env(job, "Worker", 1)}
    name = job["metadata"]["name"]
    assert env == {
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": f"{name}-master-0",
        "PET_MASTER_ADDR": f"{name}-master-0",
        "MASTER_PORT": "29400",
        "PET_MASTER_PORT": "29400",  # the container's pytorchjob-port
        "WORLD_SIZE": "12",
        "RANK": "2",
        "PET_NODE_RANK": "2",
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "4",
    }


def test_a_kubernetes_rerun_with_another_config_is_refused_before_the_job_is_submitted(
    data_dir: Path, tmp_path: Path
) -> None:
    """Issue 34, item 5. Reproduction: a 30-step run, then a 40-step rerun of the same run dir on the
    kubernetes backend (no config.json was ever written there): the rerun skipped the old
    checkpoints, trained from step 0 and had its newest checkpoint deleted by retention. The train
    step's check before it submits the PyTorchJob (``check_run_dir``, the local backend's too) now
    records the config on the first run and refuses the rerun, naming the parameter."""

    def train_step_check(steps: int, checkpoint_uri: str = "") -> TrainConfig:
        # What components/train.py does on the kubernetes backend before run_pytorchjob.
        params = check_parameters({"steps": steps, "backend": "kubernetes", **TRACKED})
        data, run_dir = shared_paths("exp-1")
        job_cfg, spec = job_from_parameters(params, data=data, run_dir=run_dir)
        build_pytorchjob(job_cfg, spec, cluster_options({**params, "training_run": "exp-1"}))
        cfg = dataclasses.replace(
            job_cfg, data=str(data_dir), run_dir=str(tmp_path / "run"), checkpoint_uri=checkpoint_uri
        )
        with as_pipeline_parameters():
            check_run_dir(cfg)
        return cfg

    train_step_check(30)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["steps"] == 30  # recorded before any pod starts
    with pytest.raises(
        ParameterError, match=r"^run_dir: .* belongs to another training config \(steps: 30 there, 40 now\)"
    ):
        train_step_check(40)
    train_step_check(30)  # the same run again: accepted

    # Its mirror location is claimed and checked on this backend too.
    mirror = str(tmp_path / "mirror")
    train_step_check(30, mirror)
    assert json.loads((tmp_path / "mirror" / "config.json").read_text())["steps"] == 30
    shutil.rmtree(tmp_path / "run")
    with pytest.raises(ParameterError, match=r"^checkpoint_uri: .* mirrors another run \(steps: 30 there, 40 now\)"):
        train_step_check(40, mirror)


def test_the_restricted_check_refuses_what_the_profile_refuses() -> None:
    """The check above can fail: a pod spec without the container's securityContext and the
    seccomp profile (this project's pods until issue 34) breaks three of the profile's rules."""
    pod = pytorchjob_manifest({})["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    del pod["securityContext"]["seccompProfile"], pod["containers"][0]["securityContext"]
    name = pod["containers"][0]["name"]
    assert restricted_violations(pod) == [
        f"{name}: allowPrivilegeEscalation != false",
        f"{name}: capabilities not dropped (ALL)",
        f"{name}: seccompProfile None",
    ]
    pod["hostNetwork"] = True
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert restricted_violations(pod)[:2] == ["host namespaces", "volume host"]
