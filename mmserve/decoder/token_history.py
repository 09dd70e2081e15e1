"""What the penalties read of one sequence's tokens, kept as the tokens arrive.

Owns: the distinct ids of the prompt and output together (the repetition penalty's), the distinct ids of the
output with their counts (the frequency and presence penalties'), the output's length and tail (`min_tokens`,
bad words), each brought up to date from the sequence's own token list when read. Does not own: the token
list (the scheduler appends to it) nor what the penalties do with these (penalties.py).

NOTE: a step once rebuilt these from the whole lists (`np.unique` over prompt and output, per row, per
step): a cost growing with the output, so quadratic over a long answer. Kept sorted here, a new token costs
a binary search, and an insertion only when its id is new.
"""

from __future__ import annotations

import numpy as np


class TokenCounts:
    """Distinct token ids, sorted, with how often each came."""

    def __init__(self, tokens: list[int] | None = None) -> None:
        ids, counts = np.unique(np.asarray(tokens or [], dtype=np.int64), return_counts=True)
        self.ids: np.ndarray = ids  # (u,) int64, ascending
        self.counts: np.ndarray = counts.astype(np.int64)  # (u,) int64, each id's count

    def add(self, tokens: list[int]) -> None:
        for token in tokens:
            at = int(np.searchsorted(self.ids, token))
            if at < len(self.ids) and self.ids[at] == token:
                self.counts[at] += 1
            else:
                self.ids = np.insert(self.ids, at, token)
                self.counts = np.insert(self.counts, at, 1)


class TokenHistory:
    """One sequence's prompt and output as the penalties read them. `tokens` is the sequence's own list
    (prompt, then output), read, never written; its first `num_prompt` are the prompt."""

    def __init__(self, tokens: list[int], num_prompt: int) -> None:
        self.tokens, self.num_prompt = tokens, num_prompt
        self._seen = TokenCounts(tokens)  # prompt and output so far
        self._output = TokenCounts(tokens[num_prompt:])
        self._counted = len(tokens)  # tokens counted into both (count)

    @classmethod
    def of(cls, prompt: list[int], output: list[int]) -> TokenHistory:
        return cls([*prompt, *output], len(prompt))

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def output_tail(self, n: int) -> list[int]:
        """The last `n` output tokens (fewer if the output is shorter)."""
        return self.tokens[max(self.num_prompt, len(self.tokens) - n):]

    def seen(self) -> np.ndarray:
        """(u,) int64: the distinct ids of the prompt and the output, ascending."""
        self._catch_up()
        return self._seen.ids

    def output_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(u,) int64 each: the output's distinct ids, ascending, and their counts."""
        self._catch_up()
        return self._output.ids, self._output.counts

    def _catch_up(self) -> None:
        new = self.tokens[self._counted:]
        if new:
            self._seen.add(new)
            self._output.add(new)
            self._counted = len(self.tokens)
