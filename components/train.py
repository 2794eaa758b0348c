from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Output

from components import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train(
    data: Input[Dataset],
    run: Output[Artifact],
    run_spec: Input[Artifact],
) -> None:
    """Run resilient FSDP training: one worker command (ft_launcher + trainer) per replica.

    The run dir lives on the shared volume under the training run's name, so a rerun with the same
    ``training_run`` resumes it and the exit handler finds it however this step ends.
    ``backend=local`` runs one ft_launcher per replica as local processes with the environment
    the training operator injects; ``backend=kubernetes`` runs the same command in a PyTorchJob.
    Every parameter is checked before any process or job starts; a failure is recorded for the
    exit handler. While the job trains, MLflow follows it (the run the exit handler completes).

    Args:
        data: the prepared data set.
        run: where the run lives on the shared volume and its latest checkpoint (with its
            manifest): a reference, not a copy.
        run_spec: the checked run spec the check step hands on (``components.runs.write_run_spec``): every
            pipeline parameter, the KFP run's job name and id, and ``training_run``, the name the
            check step resolved (the PyTorchJob and the run's folder on the shared volume). Each
            parameter is described on the pipeline.
    """
    import dataclasses
    import json
    import signal
    from pathlib import Path

    from components.runs import (
        TRAIN_STEP,
        check_training_completed,
        live_tracking,
        read_run_spec,
        recorded,
        run_descriptor,
        run_root,
    )
    from trainer.errors import ParameterError, as_pipeline_parameters
    from trainer.fsutil import sync_tree
    from trainer.launch.local import (
        BACKENDS,
        check_model_fits,
        check_run_dir,
        hold_run_dir,
        job_from_parameters,
        launch_local,
    )

    def cancelled(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # KFP cancels a step with SIGTERM: stop the processes / delete the job

    signal.signal(signal.SIGTERM, cancelled)
    params = read_run_spec(run_spec.path)
    training_run, backend = params["training_run"], params["backend"]
    tracking = {
        k: params[k]
        for k in ("tracking_uri", "experiment", "training_run", "backend", "pipeline_job", "pipeline_job_id", "image")
    }
    with (
        recorded(training_run, params["pipeline_job_id"], TRAIN_STEP),
        as_pipeline_parameters(),
    ):  # a refusal names the parameter, not the flag
        if backend not in BACKENDS:
            raise ParameterError("backend", f"{backend!r} is not one of {', '.join(BACKENDS)}", style="parameter")
        if backend == "local":
            cfg, spec = job_from_parameters(params, data=data.path, run_dir=str(run_root(training_run) / "run"))
            with live_tracking(Path(cfg.run_dir), **tracking):
                code = launch_local(cfg, spec, progress=False)
            if code:
                for log in sorted((Path(cfg.run_dir) / "logs").glob("*.log")):
                    print(
                        f"--- {log.name} (last lines)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                    )
                raise RuntimeError(
                    f"training failed: the local job exited with code {code} (logs above, "
                    f"all of them in {cfg.run_dir}/logs)"
                )
        else:
            from trainer.launch.k8s import build_pytorchjob, cluster_options, run_pytorchjob, shared_paths

            # The workers see the volume at WORKSPACE_MOUNT; this step sees the same folders at run_root
            # (the same path in a pod; a local folder where the volume is emulated).
            shared_data, shared_run = shared_paths(training_run)
            job_cfg, spec = job_from_parameters(params, data=shared_data, run_dir=shared_run)
            # The local launcher checks the model against the data before any worker starts; a
            # PyTorchJob's workers would find a bad one only once scheduled: check it here, first
            # (it also settles seq_len 0 to the model's default, the same on every worker).
            from trainer.data.shards import load_manifest

            check_model_fits(job_cfg, load_manifest(Path(data.path)))
            job = build_pytorchjob(job_cfg, spec, cluster_options(params))
            cfg = dataclasses.replace(
                job_cfg, data=str(run_root(training_run) / "data"), run_dir=str(run_root(training_run) / "run")
            )
            # A second run under this name is refused while this one lives. Inside that lock, and
            # before the data is copied over the volume's, a rerun under the same training_run must
            # be the same config and data (the data set identified here by the step's input).
            with hold_run_dir(Path(cfg.run_dir)):
                check_run_dir(dataclasses.replace(cfg, data=data.path))
                with live_tracking(Path(cfg.run_dir), **tracking):
                    # A retried step may find its job still training on this data: never truncate a shard it reads.
                    sync_tree(Path(data.path), Path(cfg.data))
                    run_pytorchjob(job)
        # Both backends: a job that ended (exit 0, or Succeeded) without run_end completed was
        # preempted or stopped, and fails the step with how to resume it.
        check_training_completed(training_run, Path(cfg.run_dir))

    # A reference, not a copy: the run stays on the shared volume, which every step mounts, so the
    # bytes the artifact store moves do not grow with the model.
    descriptor = run_descriptor(training_run, Path(cfg.run_dir))
    Path(run.path).write_text(json.dumps(descriptor, indent=1))
    run.metadata.update(
        {**{k: v for k, v in descriptor.items() if k != "manifest"}, "run_dir": cfg.run_dir, "backend": backend}
    )
