"""What a run is and where it lives: the config, its validation, stage identity, the store, run
views, file helpers, reproducibility settings and position selection (docs/architecture.md)."""
