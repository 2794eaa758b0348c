"""Compile the pipeline, run it on this machine (``kfp.local``, with the emulated cluster for
``backend=kubernetes``) or upload and submit it to a Kubeflow Pipelines server, and show a local
run's result (``rfsdp pipeline compile|run-local|submit``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kfp import compiler

from pipelines.local_view import steps_to_log
from trainer.errors import ParameterError
from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_ENV

if TYPE_CHECKING:
    from trainer.emulation.cluster import Cluster

from pipelines.resilient_fsdp import (
    DEFAULT_NAMESPACE,
    LOCAL_OVERRIDES,
    PIPELINE_NAME,
    STEPS_LOG,
    check_parameters,
    resilient_fsdp_training,
)


def compile_pipeline(out: Path) -> Path:
    """Compile the pipeline to KFP IR YAML (with the kubernetes platform document).

    Raises:
        ParameterError: ``out``'s folder does not exist (nothing is written).
    """
    if not out.parent.is_dir():
        raise ParameterError("out", f"folder {out.parent} does not exist")
    compiler.Compiler().compile(pipeline_func=resilient_fsdp_training, package_path=str(out))
    return out


@contextlib.contextmanager
def _step_env(**values: str) -> Iterator[None]:
    """Inside, the steps see these environment variables (kfp.local's steps inherit this process's)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _local_cluster(params: Mapping[str, Any], root: Path, workspace: Path) -> Iterator[Cluster | None]:
    """With ``backend=kubernetes``, the emulated cluster the train step's PyTorchJob runs on (None
    otherwise). Its claim ``pvc_name`` is ``workspace``, the folder the steps see as the shared
    volume; its secrets hold the credential variables of this environment, which the steps inherit,
    so steps and workers see the same ones as on a cluster; the steps reach it through ``KUBECONFIG``.
    """
    if params["backend"] != "kubernetes":
        yield None
        return
    from trainer.emulation.cluster import emulated_cluster

    secrets = {name: {k: os.environ[k] for k in keys if k in os.environ} for name, keys in CREDENTIAL_SECRETS.items()}
    with (
        emulated_cluster(
            root / "cluster",
            namespace=params["job_namespace"] or DEFAULT_NAMESPACE,
            claims={params["pvc_name"]: workspace},
            secrets_data={name: data for name, data in secrets.items() if data},
        ) as cluster,
        _step_env(KUBECONFIG=str(cluster.kubeconfig)),
    ):
        yield cluster


def _keep_pytorchjob(cluster: Cluster, params: Mapping[str, Any], name: str, root: Path) -> Path:
    """Write the PyTorchJob as the emulated API server holds it (spec and final status): the
    cluster, and the job with it, ends with ``run_local``.
    """
    import yaml

    path = root / "cluster" / f"{name}.pytorchjob.yaml"
    job = cluster.stored("pytorchjobs", params["job_namespace"] or DEFAULT_NAMESPACE, name)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_local(overrides: Mapping[str, Any], root: Path, *, quiet: bool = False) -> dict[str, Any]:
    """Run the whole pipeline with ``kfp.local`` (SubprocessRunner, this interpreter).

    The local overrides come first: ``backend=local`` and the local MLflow store (or
    ``MLFLOW_TRACKING_URI``); ``overrides`` may change them. The shared volume is
    ``root/workspace``: run dirs live there under their training run's name. With
    ``backend=kubernetes`` the train step's PyTorchJob runs on an emulated cluster
    (``trainer.emulation.cluster``, root only) in ``root/cluster``, started and stopped here.

    Args:
        overrides: pipeline parameters that differ from the defaults.
        root: working directory: the pipeline root (artifacts), the workspace and the emulated
            cluster live under it.
        quiet: the steps' own output (kfp.local's executor logs, the ranks' lines) goes to
            ``root/steps.log``; the terminal shows each step's start and end, the training's
            progress bar and each fault and recovery (``pipelines.local_view``).

    Returns:
        ``training_run``, ``run_dir``, ``metrics`` (the headline figures), ``report`` (path),
        ``mlflow_run_id``, ``mlflow_url``, ``tracking_uri``, ``pytorchjob`` (with
        ``backend=kubernetes``, the path of the job as the API server stored it; else None) and
        ``log`` (the steps' output when ``quiet``; else None).

    Raises:
        ParameterError: a bad parameter, or ``backend=kubernetes`` where the emulated cluster
            cannot run (nothing was started or written).
        RuntimeError: a step failed (kfp.local names it); the exit handler has logged the run.
    """
    import kfp.local

    from trainer.results.tracking import resolve_tracking_uri

    overrides = {**LOCAL_OVERRIDES, "tracking_uri": resolve_tracking_uri(None), **overrides}
    env_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    params = check_parameters(
        overrides, tracking_uri_env=env_uri, steps_run_here=True, model_check="all"
    )  # (the steps' paths are ours)
    if params["backend"] == "kubernetes":
        from trainer.emulation.cluster import cluster_problem

        if problem := cluster_problem():
            raise ParameterError(
                "backend", f"run-local runs kubernetes on the emulated cluster, which {problem}", style="parameter"
            )
    workspace = (root / "workspace").resolve()
    workspace.mkdir(parents=True, exist_ok=True)
    kfp.local.init(
        runner=kfp.local.SubprocessRunner(use_venv=False),
        pipeline_root=str(root.resolve() / "pipeline_root"),
        raise_on_error=True,
    )
    log = root.resolve() / STEPS_LOG if quiet else None
    view = steps_to_log(log, workspace, params["steps"]) if log else contextlib.nullcontext()
    try:
        with view, _step_env(**{WORKSPACE_ENV: str(workspace)}), _local_cluster(params, root, workspace) as cluster:
            task = resilient_fsdp_training(**overrides)
            name = task.outputs["training_run"]
            pytorchjob = _keep_pytorchjob(cluster, params, name, root) if cluster else None
    except RuntimeError as e:
        raise RuntimeError(f"{e} (the steps' output: {log})" if log else str(e)) from e
    finally:
        kfp.local.config.LocalExecutionConfig.instance = None  # the next run configures its own
    out = task.outputs
    return {
        "training_run": name,
        "run_dir": workspace / name / "run",
        "metrics": dict(out["metrics"].metadata),
        "report": out["report"].path,
        "mlflow_run_id": out["mlflow_run_id"],
        "mlflow_url": out["mlflow_url"],
        "tracking_uri": overrides["tracking_uri"],
        "pytorchjob": pytorchjob,
        "log": log,
    }


def submit(
    host: str,
    overrides: Mapping[str, Any],
    *,
    kfp_experiment: str = "resilient-fsdp",
    namespace: str | None = None,
    service_account: str | None = None,
    existing_token: str | None = None,
    package: Path | None = None,
) -> dict[str, str]:
    """Compile, upload (a new pipeline or a new version of it) and start a run on a KFP server.

    Returns:
        ``pipeline_id``, ``version_id``, ``experiment_id`` and ``run_id``.

    Raises:
        ParameterError: a bad parameter (nothing was sent), or ``host`` is not a reachable KFP API.
    """
    import tempfile

    import kfp
    from kfp_server_api.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    params = check_parameters(overrides, model_check="none")  # (a model's path is the cluster's, not this machine's)
    _check_kfp_api(host, existing_token)
    try:
        client = kfp.Client(host=host, namespace=namespace or "kubeflow", existing_token=existing_token)
        with tempfile.TemporaryDirectory() as tmp:
            path = compile_pipeline(package or Path(tmp) / "pipeline.yaml")
            pipeline_id = client.get_pipeline_id(PIPELINE_NAME)
            if pipeline_id is None:  # first upload: the pipeline and its first version
                pipeline_id = client.upload_pipeline(
                    str(path), pipeline_name=PIPELINE_NAME, namespace=namespace
                ).pipeline_id
                versions = client.list_pipeline_versions(
                    pipeline_id, page_size=1, sort_by="created_at desc"
                ).pipeline_versions
                version_id = versions[0].pipeline_version_id
            else:
                name = f"{PIPELINE_NAME}-{time.strftime('%Y%m%d-%H%M%S')}"
                version_id = client.upload_pipeline_version(
                    str(path), name, pipeline_id=pipeline_id
                ).pipeline_version_id
        experiment = client.create_experiment(kfp_experiment, namespace=namespace)
        run = client.run_pipeline(
            experiment_id=experiment.experiment_id,
            job_name=f"{params['training_run'] or 'rfsdp'}-{time.strftime('%Y%m%d-%H%M%S')}",
            params=dict(overrides),
            pipeline_id=pipeline_id,
            version_id=version_id,
            service_account=service_account,
        )
    except (ApiException, HTTPError, OSError) as e:  # the server went away or refused a call: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ParameterError("host", f"the KFP server at {host} failed: {first}") from e
    return {
        "pipeline_id": pipeline_id,
        "version_id": version_id,
        "experiment_id": experiment.experiment_id,
        "run_id": run.run_id,
    }


def _check_kfp_api(host: str, token: str | None) -> None:
    """One quick call to KFP's health endpoint: an unreachable host or another kind of server is
    refused at once (kfp.Client would retry for half a minute, then raise a traceback).

    Raises:
        ParameterError: naming ``--host``.
    """
    import json
    import urllib.error
    import urllib.request

    url = host.rstrip("/") + "/apis/v2beta1/healthz"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        raise ParameterError(
            "host", f"{host} is not a Kubeflow Pipelines API: GET {url} answered HTTP {e.code}"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise ParameterError("host", f"cannot reach {host}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ParameterError(
            "host", f"{host} is not a Kubeflow Pipelines API: GET {url} did not answer KFP's health JSON"
        )


def print_local_result(result: Mapping[str, Any]) -> None:
    """Show what a local pipeline run did: the run's tables, its headline, where everything is."""
    from rich.console import Console
    from rich.table import Table

    from trainer.results.summary import print_run_summary
    from trainer.results.tracking import redact_uri

    run_dir = Path(result["run_dir"])
    print_run_summary(run_dir)
    table = Table(title="headline (the pipeline's Metrics)")
    for column in ("figure", "value"):
        table.add_column(column)
    for name, value in sorted(result["metrics"].items()):  # kfp keeps no order
        table.add_row(name, f"{value:g}")
    Console().print(table)
    # Plain lines, not a table: paths must not be cut to the terminal's width.
    print(f"run dir:           {run_dir}")
    print(f"report:            {result['report']}")
    print(f"MLflow run id:     {result['mlflow_run_id']}")
    print(f"MLflow run:        {result['mlflow_url']}")
    if result["log"]:
        print(f"steps' output:     {result['log']}")
    if result["pytorchjob"]:
        print(f"PyTorchJob:        {result['pytorchjob']} (as the emulated API server stored it)")
        print(f"pod logs:          {Path(result['pytorchjob']).parent / 'pods'}")
    print("next:")
    print(
        f"  mlflow ui --backend-store-uri {redact_uri(result['tracking_uri'])}   "
        "# this run's curves, restarts and checkpoints"
    )
    print("  make compare   # sync vs async checkpoints, with and without faults, in the comparison notebook")
    print("  docs/deployment.md   # build the image and start runs from the Kubeflow UI on a cluster")
