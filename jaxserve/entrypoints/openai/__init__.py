"""OpenAI-compatible HTTP server (Starlette on uvicorn) and its request/response schema."""
