"""Code that runs on a rank: the training loop, its config, the model, the process group, and NVRx resilience."""
