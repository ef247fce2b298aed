"""When speculation runs, without a model: the batch-size threshold and a row's draft length with its
back-off after drafts that keep failing."""

from mlxhost.engine.spec.policy import FIRST_PAUSE, MAX_PAUSE, PATIENCE, DraftLength, can_speculate


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
