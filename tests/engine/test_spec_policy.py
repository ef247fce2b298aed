"""When speculation runs, without a model: the batch-size threshold, a row's draft length with its
back-off after drafts that keep failing, and `--speculative auto`'s costs, samples and probes."""

from mlxhost.engine.spec.policy import (
    COST_SAMPLES,
    FIRST_PAUSE,
    MAX_PAUSE,
    PATIENCE,
    PLAIN,
    PROBE_EVERY,
    PROBE_LEN,
    SPEC,
    TAP,
    AutoPolicy,
    DraftLength,
    StepClock,
    StepCosts,
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
    assert policy.pays(1, [0.0]) and policy.pays(1, [0.0])  # nothing measured: speculate until a sample
    policy.costs.record(True, 1, 0.030)
    # Speculative step measured, plain not yet: a plain run, its steps but the last without a tap.
    assert [policy.pays(1, [3.0]) for _ in range(PROBE_LEN)] == [False] * PROBE_LEN
    assert not policy.pays(1, [3.0]) and policy.declining(1)  # the run yielded no sample: another
    policy.costs.record(False, 1, 0.020)
    assert policy.costs.ratio(1) == 1.5
    policy.pays(1, [3.0])
    policy.pays(1, [3.0])  # the rest of the second run
    assert policy.pays(1, [0.6])  # 1 + 0.6 tokens in 1.5 steps' time beats 1 per step
    assert not policy.pays(1, [0.4])
    assert policy.declining(1)
    policy.costs.record(True, 4, 0.030)
    policy.costs.record(False, 4, 0.025)
    assert policy.pays(4, [0.3, 0.3, 0.1, 0.1]) and not policy.pays(4, [0.3, 0.2, 0.1, 0.1])  # 4 * 0.2 = 0.8
    # What /v1/status shows: each size's costs and choices.
    assert policy.summary() == {
        "1": {"plain_ms": 20.0, "spec_ms": 30.0, "ratio": 1.5, "decisions": 10, "speculated": 3},
        "4": {"plain_ms": 25.0, "spec_ms": 30.0, "ratio": 1.2, "decisions": 2, "speculated": 1}}


def test_the_cost_is_the_median_of_recent_samples():
    costs = StepCosts()
    costs.record(False, 2, 50.0)  # the first step of a new shape compiles its kernels
    costs.record(False, 2, 1.0)
    assert costs.cost(False, 2) == 1.0  # of two, the lower: outliers are slow
    for seconds in (1.1, 0.9, 1.0, 40.0):
        costs.record(False, 2, seconds)
    assert costs.cost(False, 2) == 1.0
    for _ in range(COST_SAMPLES):
        costs.record(False, 2, 3.0)
    assert costs.cost(False, 2) == 3.0 and costs.count(False, 2) == 6 + COST_SAMPLES  # old samples age out
    assert costs.cost(True, 2) is None and costs.ratio(2) is None


def _steps(clock: StepClock, kinds: str, rows=(0, 1), dt=1.0, t=0.0):
    """Steps of the given kinds ('s' speculative, 'p' plain, 't' plain with a tap), each `dt` long: the
    samples each step's start closed (None: not recorded)."""
    got = []
    for k in kinds:
        got.append(clock.start(t, rows))
        clock.mark({"s": SPEC, "p": PLAIN, "t": TAP}[k])
        t += dt
    got.append(clock.start(t, rows))
    return got[1:]  # one per step: the sample of its own interval


def test_only_steady_state_intervals_are_samples():
    clock = StepClock()
    # A plain step right after a speculative one waits on nothing (too cheap), a speculative one after a
    # plain one pays that step's tail (too dear): only same-kind neighbours count.
    assert _steps(clock, "sspps") == [None, (True, 1.0), None, (False, 1.0), None]
    clock = StepClock()
    assert _steps(clock, "pppsss") == [None, (False, 1.0), (False, 1.0), None, (True, 1.0), (True, 1.0)]


def test_a_plain_step_that_ran_the_tap_is_no_plain_sample():
    clock = StepClock()
    # A tap step's own interval, and the plain step after it (which waits on the tap's work), are dropped.
    assert _steps(clock, "ptpptt") == [None, None, None, (False, 1.0), None, None]


def test_a_change_of_rows_or_a_prefill_is_accounted_for():
    clock = StepClock()
    clock.start(0.0, (0, 1))
    clock.start(1.0, (0, 1))
    assert clock.start(2.0, (0, 1)) == (False, 1.0)
    # A prefill before a step (here the third) spoils the interval it ends and the one it begins: on MLX-CUDA
    # it may wait for the decode forward launched before it.
    assert clock.start(3.0, (0, 1), prefill_s=0.25) is None
    assert clock.start(4.0, (0, 1)) is None
    assert clock.start(5.0, (0, 1)) == (False, 1.0)
    assert clock.start(6.0, (0, 1, 2)) is None  # a row joined: the step is not the batch's steady one
    assert clock.start(7.0, (0, 1, 2)) is None  # its predecessor had other rows
    assert clock.start(8.0, (0, 1, 2)) == (False, 1.0)


def _drive(policy: AutoPolicy, num_rows: int, gains: list[float], num_steps: int, seconds: dict[str, float]):
    """Decode steps at one batch size as the decoder runs them, each kind of step taking `seconds[kind]`:
    the kinds, in order. A plain step without a tap leaves a head no seed: the next step's decision is the
    one `declining` foresaw."""
    clock, t, kinds = StepClock(), 0.0, []
    rows = tuple(range(num_rows))
    for _ in range(num_steps):
        sample = clock.start(t, rows)
        if sample is not None:
            policy.costs.record(sample[0], num_rows, sample[1])
        if policy.pays(num_rows, gains, foreseen=bool(kinds) and kinds[-1] == PLAIN):
            kind = SPEC
        else:
            kind = PLAIN if policy.declining(num_rows) else TAP  # plain_tap: a seed for the next step's drafts
        clock.mark(kind)
        kinds.append(kind)
        t += seconds[kind]
    return kinds


def test_a_fresh_batch_size_measures_both_kinds_then_decides():
    policy = AutoPolicy()
    kinds = _drive(policy, 2, [0.3, 0.3], 20, {SPEC: 2.0, PLAIN: 1.0, TAP: 1.2})
    # Speculation until a sample (two steps), a plain run whose last step seeds the head only if speculation
    # is to follow (here it is not: 0.6 < 2 * (2 - 1)), then plain decoding.
    assert kinds[:6] == [SPEC, SPEC, PLAIN, PLAIN, PLAIN, PLAIN]
    assert policy.costs.ratio(2) == 2.0 and set(kinds[3:]) == {PLAIN}


def test_while_speculation_pays_plain_is_probed_and_its_cost_refreshed():
    policy = AutoPolicy()
    policy.costs.record(False, 1, 10.0)  # plain measured dear (the old bias: tap steps, a compile)
    policy.costs.record(True, 1, 2.0)
    kinds = _drive(policy, 1, [0.5], PROBE_EVERY + PROBE_LEN + 20, {SPEC: 2.0, PLAIN: 1.0, TAP: 1.3})
    first = kinds.index(PLAIN)
    assert first < PROBE_EVERY and set(kinds[:first]) == {SPEC}
    assert kinds[first:first + PROBE_LEN] == [PLAIN] * PROBE_LEN  # no tap: speculation no longer pays
    assert policy.costs.cost(False, 1) == 1.0 and policy.costs.ratio(1) == 2.0
    assert set(kinds[first:]) == {PLAIN}  # 1 + 0.5 tokens in 2 steps' time: plain decoding wins


def test_a_plain_probe_leaves_the_head_a_seed_when_speculation_goes_on():
    policy = AutoPolicy()
    kinds = _drive(policy, 1, [3.0], 3 * PROBE_EVERY, {SPEC: 2.0, PLAIN: 1.0, TAP: 1.3})
    probes = [i for i in range(1, len(kinds)) if kinds[i] != SPEC and kinds[i - 1] == SPEC]
    assert len(probes) >= 3  # the first measurement, then one per PROBE_EVERY decisions at least
    for i in probes[1:]:
        assert kinds[i:i + PROBE_LEN + 1] == [PLAIN] * (PROBE_LEN - 1) + [TAP, SPEC]
    assert all(b - a <= PROBE_EVERY + PROBE_LEN for a, b in zip(probes[1:], probes[2:]))
    assert policy.costs.count(False, 1) == len(probes)  # one steady plain sample per probe


def test_while_declined_speculation_is_probed_in_a_run():
    policy = AutoPolicy()
    policy.costs.record(False, 2, 1.0)
    policy.costs.record(True, 2, 100.0)
    decisions, declining = [], []
    for _ in range(2 * PROBE_EVERY + PROBE_LEN):
        # The head, given no seed after a step foreseen plain, cannot draft: the decoder asks all the same.
        decisions.append(policy.pays(2, [0.1, 0.1], foreseen=bool(declining) and declining[-1]))
        declining.append(policy.declining(2))
    runs = [i for i in range(len(decisions)) if decisions[i] and (i == 0 or not decisions[i - 1])]
    assert len(runs) == 2 and runs[0] < PROBE_EVERY
    for i in runs:
        assert decisions[i:i + PROBE_LEN + 1] == [True] * PROBE_LEN + [False]
        assert not declining[i - 1]  # the step before the probe feeds the head
        assert declining[i + PROBE_LEN - 1]  # the probe's last step: the next declines, no head work
    assert all(declining[i] for i in range(runs[0] - 1))
    assert decisions.count(True) == 2 * PROBE_LEN


def test_a_step_foreseen_plain_stays_plain():
    policy = AutoPolicy()
    policy.costs.record(False, 1, 1.0)
    policy.costs.record(True, 1, 2.0)
    assert not policy.pays(1, [0.5]) and policy.declining(1)
    # The head got no seed, so this step cannot draft whatever its gains: it is decided plain, and counted.
    assert not policy.pays(1, [3.0], foreseen=True)
    assert policy.sizes[1].decisions == 2
    assert not policy.declining(1) and policy.pays(1, [3.0])  # foreseen from these gains: speculate
    assert not policy.declining(1) and not policy.pays(1, [0.5])  # foreseen speculative: the formula decides


def test_a_new_batch_size_goes_by_the_nearest_measured_one():
    """Rows finish one by one, so a batch passes through many sizes: a size learnt from nothing would speculate
    first at each, where speculation never paid next to it."""
    policy = AutoPolicy()
    assert policy.costs.nearest_ratio(15) is None
    policy.costs.record(False, 16, 1.0)
    policy.costs.record(True, 16, 2.0)
    assert policy.costs.nearest_ratio(15) == policy.costs.nearest_ratio(3) == 2.0
    kinds = _drive(policy, 15, [0.3] * 15, 20, {SPEC: 2.0, PLAIN: 1.0, TAP: 1.2})
    assert set(kinds) == {PLAIN}  # 15 * 0.3 = 4.5 extra tokens do not pay for 15 rows' second step
    policy.costs.record(False, 4, 1.0)
    policy.costs.record(True, 4, 1.1)
    policy.costs.record(False, 8, 1.0)
    policy.costs.record(True, 8, 1.5)
    assert policy.costs.nearest_ratio(5) == 1.1 and policy.costs.nearest_ratio(6) == 1.5  # a tie: the larger
    assert policy.costs.nearest_ratio(16) == 2.0  # its own


def test_a_forced_run_cut_short_by_a_change_of_batch_size_is_not_resumed_later():
    policy = AutoPolicy()
    assert policy.pays(2, [1.0])  # nothing measured: speculation first ...
    policy.costs.record(True, 2, 2.0)
    assert not policy.pays(2, [1.0])  # ... then a plain run of PROBE_LEN steps, cut short here
    assert policy.sizes[2].run
    policy.pays(3, [1.0, 1.0, 1.0])  # a row joined
    assert not policy.sizes[2].run and policy.sizes[2].promised is None
