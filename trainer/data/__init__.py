"""Preparing data sets (corpus -> checksummed token shards) and reading them on a rank."""

BUILTIN_CORPUS = "builtin:python-docs"
"""The corpus that ships with Python (its documentation), used when no corpus is given."""
