"""The controller election as pure logic: who controls, and that simultaneous claims end in distinct terms."""

from syncd.cluster.election import Election


def test_lowest_live_rank_claims_after_its_grace_period():
    e = Election(0, grace_s=3.0, started=100.0)
    assert e.evaluate([0, 1, 2], 101.0) == (None, False), "too early: a lower rank may not have been heard"
    assert e.evaluate([0, 1, 2], 103.5) == (0, True)
    assert e.term == 1 and e.is_controller
    assert e.evaluate([0, 1, 2], 104.0) == (0, False), "a standing controller does not open new terms"
    assert e.term == 1


def test_a_claim_opens_a_term_above_every_term_seen():
    e = Election(2, grace_s=0.0, started=0.0)
    e.seen_term(7)
    e.seen_term(True)  # not an integer term: ignored
    assert e.evaluate([2, 3], 1.0) == (2, True)
    assert e.term == 8


def test_simultaneous_claims_end_with_the_lowest_rank_in_the_highest_term():
    """Ranks 0 and 1 both claim term 1 before either has heard the other (on a loaded machine one starts late):
    rank 0, hearing rank 1 claim a term as high as its own, claims again; rank 1 steps down."""
    low, high = Election(0, grace_s=0.0, started=0.0), Election(1, grace_s=0.0, started=0.0)
    assert low.evaluate([0], 1.0) == (0, True) and high.evaluate([1], 1.0) == (1, True)
    assert low.term == high.term == 1, "the same term twice: plans of the two controllers would not be ordered"
    low.rival_claim(1, high.max_term)
    assert low.evaluate([0, 1], 2.0) == (0, True), "rank 0 claims again"
    assert low.term == 2
    high.seen_term(low.max_term)
    assert high.evaluate([0, 1], 2.0) == (0, False) and not high.is_controller
    assert low.term > high.term
    low.rival_claim(1, 1)  # a late heartbeat from rank 1's time as controller, with the old term
    assert low.evaluate([0, 1], 3.0) == (0, False) and low.term == 2, "an older rival term changes nothing"


def test_a_rival_claim_is_ignored_by_a_node_that_does_not_control():
    e = Election(1, grace_s=0.0, started=0.0)
    assert e.evaluate([0, 1], 1.0) == (0, False)
    e.rival_claim(0, 5)
    assert e.max_term == 5
    assert e.evaluate([0, 1], 2.0) == (0, False)
    e.rival_claim(1, 9)  # its own rank (a looped-back heartbeat) is never a rival
    assert e.max_term == 9 and not e.is_controller
