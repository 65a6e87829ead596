"""Kernels of jaxserve: paged attention, the Gated DeltaNet rule over a state pool, batched LoRA.

Imports jax only, never jaxserve."""
