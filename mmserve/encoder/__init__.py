"""Stage 2, the encoder: the vision tower's forwards, batched, behind the encoder cache."""
