from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train(
    data: Input[Dataset],
    run: Output[Artifact],
    steps: int,
    ckpt_every: int,
    ckpt_mode: str,
    nnodes: int,
    nproc_per_node: int,
    max_restarts: int,
    inprocess_restart: bool,
    fault: str,
    model: str,
    seed: int,
    hang_timeout: float,
    checkpoint_uri: str,
    backend: str,
    run_name: str,
    image: str,
    namespace: str,
    pvc_name: str,
    gpus: bool,
    cpu: str,
    memory: str,
) -> None:
    """Run resilient FSDP training: one worker command (ft_launcher + trainer) per replica.

    ``backend=local`` runs one ft_launcher per replica as local processes with the environment
    the training operator injects; ``backend=kubernetes`` runs the same command in a PyTorchJob
    whose data and run dir live on the shared volume (a rerun with the same ``run_name``
    resumes there). Every parameter is checked before any process or job starts.

    Args:
        data: the prepared data set.
        run: the run dir (events, checkpoints, logs); its metadata holds the run's summary figures
            (``trainer.events.summarize``: restarts by layer, recovery times, checkpoint stalls, ...).
        steps: total optimizer steps.
        ckpt_every: checkpoint interval in steps.
        ckpt_mode: ``async`` or ``sync``.
        nnodes: replicas (PyTorchJob Worker pods).
        nproc_per_node: worker processes per replica.
        max_restarts: in-job restarts ft_launcher may do.
        inprocess_restart: recover soft faults in-process.
        fault: fault schedule ``KIND@STEP[:RANK],...``.
        model: model size.
        seed: seed.
        hang_timeout: seconds without a heartbeat before a rank counts as hung.
        checkpoint_uri: remote location durable checkpoints are mirrored to ("" none).
        backend: ``local`` or ``kubernetes``.
        run_name: DNS-1035 name of the PyTorchJob and of the run on the shared volume.
        image: worker image (kubernetes).
        namespace: job namespace (kubernetes; "" the step's own).
        pvc_name: the shared volume's claim (kubernetes).
        gpus: one GPU per process (kubernetes).
        cpu: CPU per worker (kubernetes).
        memory: memory per worker (kubernetes).
    """
    params = dict(locals())  # the parameters, taken before anything else is defined here
    import shutil
    import signal
    from pathlib import Path

    from trainer.checkpoint import latest_checkpoint
    from trainer.errors import as_pipeline_parameters
    from trainer.events import read_events, summarize
    from trainer.launch.local import BACKENDS, check_run_dir, hold_run_dir, job_from_parameters, launch_local

    def cancelled(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # KFP cancels a step with SIGTERM: stop the processes / delete the job

    signal.signal(signal.SIGTERM, cancelled)
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    with as_pipeline_parameters():  # a refusal names the pipeline parameter (ckpt_every), not the flag
        if backend == "local":
            cfg, spec = job_from_parameters(params, data=data.path, run_dir=run.path)
            code = launch_local(cfg, spec, progress=False)
            if code:
                for log in sorted((Path(run.path) / "logs").glob("*.log")):
                    print(f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
                raise RuntimeError(f"training failed: the local job exited with code {code} (logs above, all of them in {run.path}/logs)")
        else:
            from trainer.launch.k8s import build_pytorchjob, cluster_options, run_pytorchjob, shared_paths

            shared_data, shared_run = shared_paths(run_name)
            cfg, spec = job_from_parameters(params, data=shared_data, run_dir=shared_run)
            job = build_pytorchjob(cfg, spec, cluster_options(params))
            check_run_dir(cfg)  # a rerun under the same run_name must be the same training config
            with hold_run_dir(Path(shared_run)):  # a second run under this run_name is refused while this one lives
                shutil.copytree(data.path, shared_data, dirs_exist_ok=True)
                run_pytorchjob(job)
            shutil.copytree(shared_run, run.path, dirs_exist_ok=True)

    summary = summarize(read_events(Path(run.path)))
    latest = latest_checkpoint(Path(run.path))
    run.metadata.update({k: v for k, v in summary.items() if v is not None})
    run.metadata.update({"backend": backend, "world_size": spec.world_size, "latest_checkpoint": latest.name if latest else ""})
