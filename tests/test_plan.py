"""A run is a transfer plan (coordinator/plan.py): pure functions, no network."""

from __future__ import annotations

import pytest

from fedrelay.coordinator.plan import (FINAL, HOP, UPLOAD, Plan, PlanError, Transfer, chain_plan, chain_visits,
                                       live_visits, pick_aggregator, replan, star_plan)

ORDER = [f"s{i}" for i in range(10)]


def test_a_one_shot_chain_is_n_minus_1_hops_then_the_final_copies():
    plan = chain_plan(["a", "b", "c", "d"])
    assert [(t.purpose, t.index, t.round, t.sender, t.receiver) for t in plan.transfers] == [
        (HOP, 1, 1, "a", "b"), (HOP, 2, 1, "b", "c"), (HOP, 3, 1, "c", "d"),
        (FINAL, 0, 1, "d", "a"), (FINAL, 0, 1, "d", "b"), (FINAL, 0, 1, "d", "c")]
    assert plan.final_site == "d" and len(plan.hops) == 3


def test_few_shot_cycles_plan_t_times_n_minus_1_hops_across_rounds():
    """Supplementary Alg. 1: the last site of round r sends to the first site of round r+1."""
    plan = chain_plan(ORDER, 3)
    hops = plan.hops
    assert len(hops) == 29 and [t.index for t in hops] == list(range(1, 30))
    assert hops[9] == Transfer(HOP, 10, 2, "s9", "s0")  # round 1 -> round 2
    assert hops[19] == Transfer(HOP, 20, 3, "s9", "s0")
    assert all(t.receiver == ORDER[t.index % 10] and t.round == t.index // 10 + 1 for t in hops)
    assert plan.final_site == "s9" and [t.receiver for t in plan.transfers if t.purpose == FINAL] == ORDER[:9]
    # Each site trains once per round; its part holds exactly the hops it sends or receives.
    assert plan.part("s0").visits == (1, 2, 3) and plan.part("s5").visits == (1, 2, 3)
    assert {(t.sender, t.receiver) for t in plan.part("s0").transfers if t.purpose == HOP} == {
        ("s9", "s0"), ("s0", "s1")}
    assert chain_plan(ORDER, 1).transfers == chain_plan(ORDER).transfers  # --rounds 1 is a one-shot run
    assert chain_plan(ORDER, 3) == chain_plan(list(ORDER), 3)  # the same inputs, the same plan


@pytest.mark.parametrize("order,rounds,words", [(["a"], 1, "at least 2"), (["a", "b"], 0, "--rounds")])
def test_impossible_plans_are_refused(order, rounds, words):
    with pytest.raises(PlanError, match=words):
        chain_plan(order, rounds)


def test_routing_around_a_site_keeps_hop_numbers_and_history():
    order = ["a", "b", "c"]
    plan = chain_plan(order, 2)  # visits a1 b1 c1 a2 b2 c2; hops 1..5
    # b2 went down holding the model of hop 4; a2 (visit 3) sends its model again, to c2.
    after = replan(order, 2, plan, {"b"}, plan.visits[3])
    assert [(t.index, t.sender, t.receiver) for t in after.hops] == [(1, "a", "b"), (2, "b", "c"), (3, "c", "a"),
                                                                     (5, "a", "c")]
    assert after.final_site == "c" and [t.receiver for t in after.transfers if t.purpose == FINAL] == ["a"]
    assert after.part("b").visits == (1,) and after.part("a").visits == (1, 2)
    # Hop 5 keeps its number: a reroute changes a hop's sender, never its receiver.
    assert {t.index: t.receiver for t in after.hops}[5] == {t.index: t.receiver for t in plan.hops}[5]


def test_adjacent_visits_of_one_site_collapse_and_no_site_sends_to_itself():
    assert [v.site for v in live_visits(["a", "b"], 3, {"b"})] == ["a"]
    plan = chain_plan(["a", "b", "c"], 2)
    alone = replan(["a", "b", "c"], 2, plan, {"b", "c"}, plan.visits[0])
    assert alone.hops == [] and alone.final_site == "a" and alone.part("a").visits == (1,)
    assert all(t.sender != t.receiver for t in alone.transfers)


def test_a_first_site_lost_before_sending_makes_the_next_live_visit_start_afresh():
    plan = chain_plan(["a", "b", "c"])
    after = replan(["a", "b", "c"], 1, plan, {"a"}, None)
    assert [(t.index, t.sender, t.receiver) for t in after.hops] == [(2, "b", "c")]
    assert after.part("b").visits == (1,) and not [t for t in after.hops if t.receiver == "b"]


def test_visits_are_numbered_across_rounds():
    visits = chain_visits(["a", "b"], 2)
    assert [(v.index, v.round, v.site) for v in visits] == [(0, 1, "a"), (1, 1, "b"), (2, 2, "a"), (3, 2, "b")]


def test_a_star_plan_is_n_minus_1_uploads_then_the_final_copies():
    """The parallel one-shot methods: every site trains in round 1; the others upload to the
    aggregator (index 1 + position, stable), which copies the final model to every site."""
    plan = star_plan(["a", "b", "c", "d"], "c")
    assert [(t.purpose, t.index, t.round, t.sender, t.receiver) for t in plan.transfers] == [
        (UPLOAD, 1, 1, "a", "c"), (UPLOAD, 2, 1, "b", "c"), (UPLOAD, 4, 1, "d", "c"),
        (FINAL, 0, 1, "c", "a"), (FINAL, 0, 1, "c", "b"), (FINAL, 0, 1, "c", "d")]
    assert plan.final_site == "c" and plan.aggregator == "c" and not plan.hops and len(plan.uploads) == 3
    assert all(plan.part(s).visits == (1,) for s in "abcd")
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.part("a").transfers == (Transfer(UPLOAD, 1, 1, "a", "c"), Transfer(FINAL, 0, 1, "c", "a"))


def test_a_star_routed_around_a_site_keeps_an_upload_that_arrived():
    order = ["a", "b", "c", "d"]
    lost = star_plan(order, "a", skipped=["b"])  # b down before its upload
    assert [(t.purpose, t.sender, t.receiver) for t in lost.transfers] == [
        (UPLOAD, "c", "a"), (UPLOAD, "d", "a"), (FINAL, "a", "c"), (FINAL, "a", "d")]
    kept = star_plan(order, "a", skipped=["b"], received=["b"])  # b down after it: no final copy
    assert [(t.purpose, t.index, t.sender) for t in kept.uploads] == [(UPLOAD, 2, "b"), (UPLOAD, 3, "c"),
                                                                       (UPLOAD, 4, "d")]
    assert "b" not in {t.receiver for t in kept.transfers if t.purpose == FINAL}


@pytest.mark.parametrize("aggregator, skipped, words", [
    ("z", (), "is not one of the run's sites"), ("a", ("a",), "was routed around")])
def test_impossible_star_plans_are_refused(aggregator, skipped, words):
    with pytest.raises(PlanError, match=words):
        star_plan(["a", "b"], aggregator, skipped)
    with pytest.raises(PlanError, match="at least 2 sites"):
        star_plan(["a"], "a")


def test_the_default_aggregator_is_fixed_by_the_seed():
    picks = {pick_aggregator(ORDER, seed) for seed in range(40)}
    assert pick_aggregator(ORDER, 3) == pick_aggregator(list(reversed(ORDER)), 3)  # not by the order
    assert len(picks) > 3 and picks <= set(ORDER)  # different seeds spread over the sites
