"""Attention kernels over the paged KV pool. Imports jax only, never jaxserve."""
