"""The node agent: the backend-agnostic reconcile loop, its triggers, signals, metrics and health endpoints."""
