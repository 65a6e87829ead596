"""The engine: core loop, input/output processing, the clients server and LLM use."""
