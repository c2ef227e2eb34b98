"""Experiment tracking in MLflow: the tracker, its client, params, what each record logs, the machine's store and the UI."""
