"""encoder/lookups.py: what a stage counts of its lookups, and the recency hints it keeps for its next step."""

from __future__ import annotations

from mmserve.encoder.lookups import TOUCHES_KEPT, Lookups


def test_requests_served_from_the_cache_count_as_hits_and_leave_bounded_hints() -> None:
    lookups = Lookups()
    for i in range(TOUCHES_KEPT + 10):
        assert lookups.served([f"h{i}", f"h{i}"])
    assert (lookups.total_queries, lookups.total_hits) == (2 * (TOUCHES_KEPT + 10),) * 2
    touched = lookups.take_touched()
    assert len(touched) == TOUCHES_KEPT and touched[-1] == f"h{TOUCHES_KEPT + 9}"  # the newest kept
    assert lookups.take_touched() == []


def test_an_entry_made_early_for_a_request_still_to_come_is_not_served_off_the_step() -> None:
    lookups = Lookups()
    assert lookups.looked_up("e", hit=False, early=True) == ()  # the early encode's miss: not counted
    assert not lookups.served(["e"]) and lookups.total_queries == 0
    lookups.encoded_early("e", (("encoder.forward", 5.0),))
    assert lookups.looked_up("e", hit=True, early=False) == (("encoder.forward", 5.0),)  # its request's own miss
    assert (lookups.queries, lookups.hits, lookups.early_found) == (1, 0, 1)
