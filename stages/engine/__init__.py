"""Compute on loaded weights: the rollout engine (decoder, sampler, kernels, CUDA graphs), the LM
head in position chunks and batching (docs/architecture.md)."""
