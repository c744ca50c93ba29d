"""Where device and host memory go: model shapes, the phases' peaks, the weight-free plan, placement
at run time and host memory settings (docs/architecture.md)."""
