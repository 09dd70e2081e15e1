"""The OpenAI-compatible edge: request and response schemas, error bodies, stream chunks (pydantic)."""
