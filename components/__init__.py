"""KFP lightweight components, one per file (``runs.py`` holds what they share); each body imports and
calls ``trainer.*``.
"""

IMAGE = "ghcr.io/resilient-fsdp/resilient-fsdp:0.1.0"
"""Default image of every component (built from the Dockerfile); the pipeline overrides it with
its ``image`` parameter. The image already holds kfp, so no package is installed at run time."""
