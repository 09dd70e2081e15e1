"""Stage 3, the decoder: scheduling, paged KV, the language model's step, sampling and streaming outputs."""
