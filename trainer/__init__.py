"""Resilient FSDP trainer: model, data, checkpoints, NVRx resilience, launch and tooling."""

import warnings

# torch.cuda imports pynvml, which NVRx's dependency nvidia-ml-py shims with a deprecation warning.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
