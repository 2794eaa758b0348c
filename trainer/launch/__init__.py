"""Starting a job: one ft_launcher per replica as local processes, or a PyTorchJob on Kubernetes.

The package itself holds what the pipeline's pods and the workers must agree on; importing it is
cheap (a pipeline compile reads these without torch or the Kubernetes client).
"""

import os
from pathlib import Path

WORKSPACE_MOUNT = "/mnt/rfsdp"
"""Where the shared volume (data + run dirs) is mounted in the pipeline's pods and in every worker."""
WORKSPACE_ENV = "RFSDP_WORKSPACE"
"""Names a local folder that stands in for the shared volume where none is mounted (``kfp.local``)."""
CREDENTIAL_SECRETS: dict[str, tuple[str, ...]] = {
    "rfsdp-s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "rfsdp-mlflow": ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
    "rfsdp-checkpoint-key": ("RFSDP_CHECKPOINT_KEY",),  # trainer.checkpoint.SIGNING_KEY_ENV (that module loads torch)
    "rfsdp-hf": ("HF_TOKEN",),  # a hub model (--model hf:org/name) that needs a token
}
"""Secrets (name -> keys, each key becomes the env variable of that name) given to the pipeline's
pods and to every worker, all optional: credentials never travel as pipeline parameters. The
MLflow secret may also name the cluster's tracking server, so runs started from the UI need no
``tracking_uri``; the checkpoint key signs every manifest the workers write and is required of
every checkpoint the workers and the validate step load (docs/checkpoints.md, "What is trusted")."""
IMAGE_UID = 1000
"""User id the image runs as (the Dockerfile's ``USER``); pods set the same ``runAsUser``."""
IMAGE_GID = 1000
"""Group id the image runs as; pods set the same ``runAsGroup`` and ``fsGroup`` (the shared volume stays writable)."""


def workspace() -> Path:
    """The shared volume as this process sees it: ``$RFSDP_WORKSPACE`` if set, else ``WORKSPACE_MOUNT``."""
    return Path(os.environ.get(WORKSPACE_ENV) or WORKSPACE_MOUNT)
