"""jaxserve: LLM inference and serving in JAX and Pallas."""
__version__ = "0.1.0"
