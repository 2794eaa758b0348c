"""Starting a job: one ft_launcher per replica as local processes, or a PyTorchJob on Kubernetes.

The package itself holds what the pipeline's pods and the workers must agree on; importing it is
cheap (a pipeline compile reads these without torch or the Kubernetes client).
"""

WORKSPACE_MOUNT = "/mnt/rfsdp"
"""Where the shared volume (data + run dirs) is mounted in the train step's pod and in every worker."""
CREDENTIAL_SECRETS: dict[str, tuple[str, ...]] = {
    "rfsdp-s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "rfsdp-mlflow": ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
}
"""Secrets (name -> keys, each key becomes the env variable of that name) given to the pipeline's
pods and to every worker, all optional: credentials never travel as pipeline parameters."""
IMAGE_UID = 1000
"""User id the image runs as (the Dockerfile's ``USER``); pods set the same ``runAsUser``."""
IMAGE_GID = 1000
"""Group id the image runs as; pods set the same ``runAsGroup`` and ``fsGroup`` (the shared volume stays writable)."""
