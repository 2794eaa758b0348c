# The one image every pipeline step and every PyTorchJob worker runs:
#   docker build --build-arg GIT_COMMIT=$(git rev-parse HEAD) -t ghcr.io/resilient-fsdp/resilient-fsdp:0.1.0 .
# and pass it to the pipeline as `image` (rfsdp pipeline submit --set image=...).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/resilient-fsdp

# The unprivileged user every step and worker runs as; trainer.launch.IMAGE_UID / IMAGE_GID hold the
# same ids for the pods' securityContext (tests/integration/test_image.py checks they agree).
RUN groupadd --gid 1000 rfsdp && useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin rfsdp

# torch first and pinned: on Linux x86_64 this wheel is the CUDA build (NCCL included), the same
# version line as the CPU build the tests use. NVRx 0.4.1 is the newest wheel for Python 3.11.
RUN pip install torch==2.13.0

COPY pyproject.toml README.md ./
COPY trainer trainer
COPY components components
COPY pipelines pipelines
COPY bench bench
# Installs kfp (the components run with install_kfp_package=False), kubeflow-training, NVRx
# (ft_launcher on PATH), mlflow, boto3, and transformers, tokenizers, safetensors and pyarrow
# (your model and corpus); the import check fails the build, not the first run.
RUN pip install . \
 && python -c "import kfp, kubeflow.training, nvidia_resiliency_ext, mlflow, boto3, transformers, tokenizers, safetensors, pyarrow, trainer.rank.train, trainer.models.hf, trainer.launch.k8s, pipelines.resilient_fsdp" \
 && command -v ft_launcher rfsdp

USER 1000:1000
ENV HOME=/home/rfsdp
# The revision MLflow runs are tagged with: docker build --build-arg GIT_COMMIT=$(git rev-parse HEAD) ...
ARG GIT_COMMIT=""
ENV RFSDP_GIT_COMMIT=${GIT_COMMIT}

# KFP runs the components' own command; a bare `docker run` shows the CLI.
CMD ["rfsdp", "--help"]
