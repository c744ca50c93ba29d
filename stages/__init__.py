"""opd-stages: on-policy distillation as content-addressed pipeline stages.

Importing the package changes nothing in the process: the settings an `opd` process makes before
torch loads (MKL's reproducibility mode, keeping freed host memory) are made by the CLI's entry
point, `stages.cli.process_settings()`, which tests and benchmarks call first too."""

__version__ = "0.1.0"
