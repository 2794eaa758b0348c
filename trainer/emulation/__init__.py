"""Test and demo tooling on one machine: several hosts emulated with network namespaces for node
faults (``netns``), and a Kubernetes cluster with the training operator for the train step's
kubernetes path (``cluster``; docs/emulation.md).
"""
