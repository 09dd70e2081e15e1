"""How often a request's outputs leave the decoder: the stream interval, stretched under load.

Owns: the rule. Each output sent is a message through Serve (decoder -> ingress -> proxy -> client),
and each hop costs CPU per message in processes that share the machine with the step; so a stream's
outputs go at most once per interval, merged (`merge_outputs`), the first at once. Alone, a stream
gets the floor interval; with many streams the interval grows so that the replica's streams together
send about `messages_per_s`, but never past the ceiling, so that a reader still sees text arrive
several times a second. A caller that reads only the whole answer (`SamplingParams.final_only`) gets
its first output (its errors still get their HTTP status) and then one message at its end.
Does not own: the merging or the waiting (runtime.output_channel.read), nor counting streams
(the decoder service).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamPacing:
    floor_s: float = 0.0  # a stream's outputs at most this often, however few streams (s)
    messages_per_s: float = 0.0  # all streams together, about (messages/s); 0 = no budget, every stream at the floor
    ceiling_s: float = math.inf  # the budget never stretches an interval past this (s)

    def interval_s(self, streams: int, *, final_only: bool = False) -> float:
        """Seconds between one stream's messages while `streams` streams are live (this one included)."""
        if final_only:
            return math.inf
        if self.messages_per_s <= 0:
            return self.floor_s
        return max(self.floor_s, min(streams / self.messages_per_s, self.ceiling_s))
