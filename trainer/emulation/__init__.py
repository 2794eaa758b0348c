"""Test and demo tooling: several hosts emulated on one machine (network namespaces) for node faults."""
