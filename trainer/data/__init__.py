"""Preparing data sets (corpus -> checksummed token shards) and reading them on a rank."""
