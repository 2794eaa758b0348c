"""After a run: checkpoint validation, the run summary, MLflow tracking, and the cross-run comparison."""
