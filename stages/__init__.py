"""opd-stages: on-policy distillation as content-addressed pipeline stages."""

__version__ = "0.1.0"
