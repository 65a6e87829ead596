"""Host side only (no jax): requests, sampling params, pages, scheduler, step plans."""
