"""Where runs and data sets live: local directories and S3 (the only boto3 user), and the background mirror of
published checkpoints.
"""
