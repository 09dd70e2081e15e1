"""token_history.py against the whole-list definitions (`np.unique` over prompt and output), read at random
points while the sequence's own list grows."""

from __future__ import annotations

import random

import numpy as np

from mmserve.decoder.token_history import TokenHistory


def test_what_the_penalties_read_equals_the_whole_lists_at_every_point() -> None:
    rng = random.Random(3)
    for _ in range(200):
        prompt = [rng.randrange(40) for _ in range(rng.randrange(0, 12))]
        tokens = [*prompt, *(rng.randrange(40) for _ in range(rng.randrange(0, 3)))]
        history = TokenHistory(tokens, len(prompt))  # NOTE: reads the sequence's list, as the decoder's does
        for _ in range(rng.randrange(1, 30)):
            tokens.append(rng.randrange(50))
            if rng.random() < 0.4:
                continue  # NOTE: read now and then: what arrived meanwhile is counted at the next read
            output = tokens[len(prompt):]
            assert history.seen().tolist() == np.unique(tokens).tolist()
            ids, counts = history.output_counts()
            want_ids, want_counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            assert ids.tolist() == want_ids.tolist() and counts.tolist() == want_counts.tolist()
            assert history.num_output == len(output)
            assert history.output_tail(3) == output[-3:] and history.output_tail(0) == []
