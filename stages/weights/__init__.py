"""Models on disk and in memory: loading and converting, LoRA, adapter files, deferred imports and
reading weights ahead (docs/architecture.md)."""
