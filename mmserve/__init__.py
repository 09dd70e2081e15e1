"""mmserve: a multimodal LLM serving engine (pure Python; the Ray Serve layer lives in deployments/)."""
