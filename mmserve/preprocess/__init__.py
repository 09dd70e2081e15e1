"""Stage 1, the preprocessor: chat messages and image URLs -> prompt token ids and processed items."""
