"""The ``rfsdp`` commands beside one training run: ``pipeline`` (the Kubeflow pipeline), ``cluster``
(the emulated cluster its PyTorchJob runs on) and ``bench`` (the benchmarks); their arguments and
handlers. :mod:`trainer.cli` adds them to ``rfsdp`` with :func:`add_app_commands`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path


def add_app_commands(sub: argparse._SubParsersAction) -> None:
    """Add the ``pipeline``, ``cluster`` and ``bench`` subcommands to ``rfsdp``'s subparsers ``sub``."""
    p = sub.add_parser(
        "pipeline", help="the Kubeflow pipeline: compile, run locally (kfp.local), submit, show the PyTorchJob"
    )
    actions = p.add_subparsers(dest="action", required=True)
    a = actions.add_parser("compile", help="compile the pipeline to KFP IR YAML")
    a.add_argument("--out", default="resilient_fsdp_training.yaml", help="output file (its folder must exist)")
    a = actions.add_parser(
        "params",
        help="list the pipeline's parameters: type, default, description",
        epilog="example: rfsdp pipeline params --yaml > params.yaml  "
        "(edit it, then: rfsdp pipeline run-local --params params.yaml)",
    )
    a.add_argument(
        "--yaml", action="store_true", help="print a parameters file for --params: every parameter at its default"
    )

    a = actions.add_parser(
        "run-local",
        help="run the whole pipeline locally with kfp.local (SubprocessRunner, this venv; "
        "backend=local, local MLflow); backend=kubernetes runs the PyTorchJob on an emulated cluster (root)",
        epilog="example: rfsdp pipeline run-local --params params.yaml --set fault=exception@15:1,sigkill@30:0",
    )
    _add_parameter_options(a)
    a.add_argument(
        "--root",
        default="work/pipeline",
        help="local working directory: pipeline_root/ (every artifact), workspace/ (the shared volume), "
        "cluster/ (the emulated cluster), steps.log (the steps' output)",
    )
    a.add_argument(
        "--verbose",
        action="store_true",
        help="show the steps' own output (kfp.local's executor logs) instead of steps.log",
    )
    a = actions.add_parser(
        "submit",
        help="upload the pipeline to a KFP server and start a run (token from KFP_TOKEN)",
        epilog="example: rfsdp pipeline submit --host https://kubeflow.example.com/pipeline --params params.yaml",
    )
    a.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    _add_parameter_options(a)
    a.add_argument("--kfp-experiment", default="resilient-fsdp", help="KFP experiment the run goes into")
    a.add_argument("--namespace", help="KFP profile namespace (multi-user deployments)")
    a.add_argument("--service-account", help="service account of the run's pods (needs deploy/rbac.yaml)")
    a = actions.add_parser(
        "manifest",
        help="print the PyTorchJob the train step creates (backend=kubernetes) as YAML",
        epilog="example: rfsdp pipeline manifest --set nnodes=2 --set gpus=true",
    )
    _add_parameter_options(a)
    p.set_defaults(func=_pipeline)

    p = sub.add_parser(
        "cluster",
        help="the emulated Kubernetes cluster on its own (root): "
        "kubectl, the RBAC and `rfsdp pipeline manifest` work against it",
        epilog="example: sudo rfsdp cluster up --root work/cluster   "
        "(then: export KUBECONFIG=work/cluster/state/admin.kubeconfig)",
    )
    p.add_argument("action", choices=["up"], help="up: start it and keep it up until Ctrl-C")
    p.add_argument(
        "--root",
        default="work/cluster",
        help="its folder: state/ (kubeconfigs, pod logs), workspace/ (the shared volume)",
    )
    p.add_argument("--namespace", default="default", help="where deploy/rbac.yaml is applied and the kubeconfigs point")
    p.add_argument(
        "--pvc-name",
        default="rfsdp-workspace",
        help="the claim the workspace folder stands for (the pipeline's pvc_name)",
    )
    p.set_defaults(func=_cluster)

    p = sub.add_parser(
        "bench", help="benchmarks against the alternatives (torch.save, dcp.async_save, torchrun restarts)"
    )
    p.add_argument(
        "which",
        choices=["checkpoint", "recovery", "overhead", "goodput", "soak", "load", "crossover", "all"],
        help="which benchmark to run",
    )
    p.add_argument("--quick", action="store_true", help="everything sized down (a smoke run, not figures to quote)")
    p.add_argument("--json", type=Path, help="write the results (per method: medians and ratios) to this JSON file")
    p.add_argument(
        "--work", type=Path, help="scratch directory for data, checkpoints and run dirs (default: work/bench)"
    )
    p.add_argument(
        "--fault-every",
        type=float,
        metavar="SECONDS",
        help="soak only: seconds of training between faults (default: 60; --quick: 4)",
    )
    p.add_argument(
        "--ckpts-per-fault",
        type=int,
        metavar="N",
        help="soak only: durable checkpoints between two faults (default: 12; "
        "fewer: durable saves as dear as at scale)",
    )
    p.add_argument(
        "--audit",
        action="store_true",
        help="soak only: keep every checkpoint each run publishes and audit it against its ranks' shard digests "
        "(saves audited, mismatches, the digests' cost per save)",
    )
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="checkpoint and overhead only: a --model of yours (hf:PATH, py:...) instead of the built-in sizes",
    )
    p.set_defaults(func=_bench)


def _pipeline(args: argparse.Namespace) -> int:
    import json

    import yaml

    from pipelines import resilient_fsdp as pl
    from pipelines import run

    if args.action == "compile":
        print(f"compiled {run.compile_pipeline(Path(args.out))}")
        return 0
    if args.action == "params":
        print(pl.parameters_yaml() if args.yaml else pl.parameters_text(), end="")
        return 0
    from_file = pl.read_parameters_file(Path(args.params)) if args.params else {}
    overrides = {**from_file, **pl.parse_assignments(args.set)}  # --set overrides the file
    if args.action == "manifest":
        print(yaml.safe_dump(pl.pytorchjob_manifest(overrides), sort_keys=False), end="")
    elif args.action == "run-local":
        try:
            result = run.run_local(overrides, Path(args.root), quiet=not args.verbose)
        except RuntimeError as e:  # a step failed: kfp.local names it, the step's output is in its log
            print(f"rfsdp pipeline run-local: a step failed: {e}; log-to-mlflow recorded the failure", file=sys.stderr)
            return 1
        run.print_local_result(result)
    else:
        ids = run.submit(
            args.host,
            overrides,
            kfp_experiment=args.kfp_experiment,
            namespace=args.namespace,
            service_account=args.service_account,
            existing_token=os.environ.get("KFP_TOKEN"),
        )
        print(json.dumps(ids, indent=2))
    return 0


def _cluster(args: argparse.Namespace) -> int:
    """``rfsdp cluster up``: the emulated cluster on its own, until Ctrl-C (or SIGTERM)."""
    from trainer.emulation.cluster import cluster_problem, emulated_cluster
    from trainer.launch import CREDENTIAL_SECRETS, WORKSPACE_MOUNT

    if problem := cluster_problem():
        print(f"rfsdp cluster: the emulated cluster {problem}", file=sys.stderr)
        return 2
    # Ctrl-C stops it, as it says, also where this process was started with SIGINT ignored (a
    # shell's background job inherits that, and Python then leaves it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    root = Path(args.root).resolve()
    workspace = root / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    # Its secrets hold this environment's credentials, as run-local's cluster does: the workers see the same ones.
    secrets = {name: {k: os.environ[k] for k in keys if k in os.environ} for name, keys in CREDENTIAL_SECRETS.items()}
    secrets = {name: data for name, data in secrets.items() if data}
    with emulated_cluster(
        root / "state", namespace=args.namespace, claims={args.pvc_name: workspace}, secrets_data=secrets
    ) as c:
        print(f"emulated cluster at {c.url}, namespace {c.namespace} (deploy/rbac.yaml applied)")
        print(f"  export KUBECONFIG={c.admin_kubeconfig}    # an admin; the train step's own: {c.kubeconfig}")
        print(f"  claim {args.pvc_name} (mounted at {WORKSPACE_MOUNT}) is {workspace}")
        print("try:")
        print(f"  rfsdp prepare-data --out {workspace}/demo/data")
        print(
            "  rfsdp pipeline manifest --set training_run=demo --set nnodes=2 "
            "--set nproc_per_node=1 | kubectl apply -f -"
        )
        print(
            "  kubectl get pytorchjobs,pods -w        # kubectl logs -f demo-worker-0, kubectl describe pytorchjob demo"
        )
        print("Ctrl-C stops the cluster and every pod.", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated)
            print("stopping the cluster and its pods", flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from bench.runner import BENCHMARKS, run_benchmarks
    from bench.soak import check_ckpts_per_fault, check_fault_every

    names = list(BENCHMARKS) if args.which == "all" else [args.which]
    soak: dict = {}
    soak_options = (
        ("--fault-every", "fault_every", check_fault_every),
        ("--ckpts-per-fault", "ckpts_per_fault", check_ckpts_per_fault),
    )
    for flag, name, check in soak_options:
        value = getattr(args, name)
        if value is None:
            continue
        if "soak" not in names:  # checked before anything runs
            raise ValueError(f"{flag} applies to the soak benchmark only, not to {args.which}")
        try:
            soak[name] = check(value)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    if args.audit:
        if "soak" not in names:
            raise ValueError(f"--audit applies to the soak benchmark only, not to {args.which}")
        soak["audit"] = True
    options = {"soak": soak} if soak else {}
    if args.model:
        if not set(names) <= {"checkpoint", "overhead"}:
            raise ValueError(f"--model applies to the checkpoint and overhead benchmarks only, not to {args.which}")
        from trainer.models import check_model

        check_model(args.model)  # a bad model is refused before anything runs
        options |= {name: {"model": args.model} for name in names}
    return run_benchmarks(names, quick=args.quick, json_path=args.json, work=args.work, options=options)


def _add_parameter_options(a: argparse.ArgumentParser) -> None:
    """``--params FILE.yaml`` and ``--set NAME=VALUE`` of the pipeline actions that start or show a run."""
    a.add_argument(
        "--params",
        metavar="FILE.yaml",
        help="YAML file of pipeline parameters (rfsdp pipeline params --yaml writes one); --set overrides it",
    )
    a.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="pipeline parameter (repeatable; names as in rfsdp pipeline params: steps, nnodes, fault, backend, ...)",
    )
