"""Device side: the runner's one entry execute(plan), sampler, KV pool, sharding."""
