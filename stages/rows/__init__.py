"""Rows and tables that flow between stages: the Parquet contracts and the in-memory hand-on cache,
prompts, rewards and task checkers, reasoning-gym rows, tool-use transcripts, trajectories and verl's
rows (docs/architecture.md)."""
