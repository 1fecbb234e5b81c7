"""The node agent: the reconcile loop of DESIGN.md §5 (backend-agnostic), its triggers and signals."""
