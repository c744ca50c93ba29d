"""User tools: report, inspection, doctor, benchmark, the memory plan's view and CUDA probe, the
dvc.yaml generator. They may import anything below the CLI (docs/architecture.md)."""
