"""User-facing entry points: the offline ``LLM``, the OpenAI-compatible server and the CLI."""
