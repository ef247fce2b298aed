"""When speculation runs, without a model: the batch-size threshold and a row's draft length with its
back-off after drafts that keep failing."""

from mlxhost.engine.spec.policy import (
    FIRST_PAUSE,
    MAX_PAUSE,
    PATIENCE,
    PROBE_EVERY,
    AutoPolicy,
    DraftLength,
    can_speculate,
    expected_gain,
)


def test_only_small_batches_speculate():
    assert not can_speculate(0, 4)
    assert all(can_speculate(n, 4) for n in range(1, 5))
    assert not can_speculate(5, 4) and not can_speculate(16, 4)
    assert can_speculate(16, 16)


def test_length_grows_after_full_acceptance_and_shrinks_to_just_past_a_partial_one():
    d = DraftLength(max_k=4)
    assert d.length(0) == 4
    d.update(1, 4, 2)
    assert d.length(2) == 3  # two accepted: draft one more than that next time
    d.update(2, 3, 3)
    d.update(3, 4, 4)
    assert d.length(4) == 4  # capped at max_k
    assert not d.update(4, 0, 0) and d.length(5) == 4  # no draft this step (e.g. nothing to look up): no change


def _miss(d: DraftLength, step: int) -> bool:
    return d.update(step, d.length(step), 0)


def test_sustained_rejection_pauses_drafting_with_exponential_backoff():
    d = DraftLength(max_k=4)
    step = 0
    for _ in range(PATIENCE - 1):
        step += 1
        assert not _miss(d, step)
        assert d.length(step + 1) == 1  # nothing accepted: a single token next time
    step += 1
    assert _miss(d, step)  # the PATIENCE-th miss in a row starts a pause
    pauses = []
    for _ in range(8):
        paused = [s for s in range(step + 1, step + 2 * MAX_PAUSE + 2) if d.length(s) == 0]
        assert paused == list(range(step + 1, step + 1 + len(paused)))  # one contiguous pause
        pauses.append(len(paused))
        step += len(paused) + 1
        assert d.length(step) == 1  # one token tries again
        assert _miss(d, step)  # the retry fails: a longer pause at once
    assert pauses == [min(MAX_PAUSE, FIRST_PAUSE * 2**i) for i in range(8)]
    assert pauses[-1] == MAX_PAUSE


def test_an_accepted_retry_resets_the_backoff():
    d = DraftLength(max_k=4)
    step = 0
    for _ in range(PATIENCE):
        step += 1
        _miss(d, step)
    step += FIRST_PAUSE + 1
    _miss(d, step)  # second pause: 2 * FIRST_PAUSE
    step += 2 * FIRST_PAUSE + 1
    assert d.length(step) == 1
    assert not d.update(step, 1, 1)  # accepted: drafting goes on and grows
    assert d.length(step + 1) == 2
    # Back to PATIENCE misses before the next pause, and that pause is the first length again.
    for _ in range(PATIENCE - 1):
        step += 1
        assert not _miss(d, step)
    step += 1
    assert _miss(d, step)
    assert [d.length(s) for s in range(step + 1, step + FIRST_PAUSE + 2)] == [0] * FIRST_PAUSE + [1]


def test_a_rows_acceptance_follows_its_drafts():
    d = DraftLength(max_k=4)
    assert d.acceptance == 0.5  # the prior: a new row tries
    for step in range(1, 8):
        d.update(step, 4, 4)
    assert d.acceptance > 0.9
    for step in range(8, 20):
        d.update(step, 1, 0)
    assert d.acceptance < 0.2


def test_expected_gain_weights_each_draft_by_the_chance_it_is_reached():
    assert expected_gain(0.0, 4) == 0.0
    assert expected_gain(1.0, 4) == 4.0
    assert expected_gain(0.5, 2) == 0.75


def test_auto_speculates_only_where_the_gain_covers_the_measured_cost():
    policy = AutoPolicy()
    assert policy.pays(1, [0.0])  # nothing measured: try
    policy.costs.record(True, 1, 0.030)
    assert not policy.pays(1, [3.0])  # speculative step measured, plain not yet: one plain step
    policy.costs.record(False, 1, 0.020)
    assert policy.costs.ratio(1) == 1.5
    assert policy.pays(1, [0.6])  # 1 + 0.6 tokens in 1.5 steps' time beats 1 per step
    assert not policy.pays(1, [0.4])
    assert policy.declining(1)
    policy.costs.record(True, 4, 0.030)
    policy.costs.record(False, 4, 0.025)
    assert policy.pays(4, [0.3, 0.3, 0.1, 0.1]) and not policy.pays(4, [0.3, 0.2, 0.1, 0.1])  # 4 * 0.2 = 0.8


def test_auto_probes_now_and_then_while_speculation_does_not_pay():
    policy = AutoPolicy()
    policy.costs.record(False, 2, 0.01)
    policy.costs.record(True, 2, 0.05)
    decisions = [policy.pays(2, [0.1, 0.1]) for _ in range(3 * PROBE_EVERY - 1)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]
    assert not policy.declining(2)  # the next step probes: a head prepares its drafts now
