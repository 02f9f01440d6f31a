"""Lab 1's grader: fresh() and capacity() on tables of cases and properties, then both inside the real
controller, buffer and env managers (tools/sim.py's simulator, virtual time, well under a second a run). The
simulated runs check the tables first and run under a cap (labs/grading.Cap): a wrong answer fails in
seconds, naming the case."""

import dataclasses
import random

import pytest

from buffer import Freshness
from controller import Admission
from labs.grading import Cap, load
from tools.sim import SimConfig, simulate

impl = load("lab1_freshness")

# (oldest_version, version, async_ratio) -> fresh?
FRESH = [((0, 0, 0), True), ((0, 1, 0), False), ((4, 5, 0), False), ((5, 5, 0), True),
         ((0, 1, 1), True), ((0, 2, 1), False), ((3, 5, 2), True), ((2, 5, 2), False),
         ((7, 10, 3), True), ((6, 10, 3), False), ((10, 10, 8), True), ((1, 10, 8), False)]

# (async_ratio, batch_groups, redundant, holding) -> groups that may still be admitted
CAPACITY = [((0, 4, 0, 0), 4), ((0, 4, 0, 4), 0), ((0, 8, 2, 3), 7), ((1, 4, 0, 0), 8), ((2, 4, 0, 0), 12),
            ((2, 4, 1, 5), 8), ((1, 32, 4, 10), 58), ((4, 16, 16, 0), 96)]


def fresh_case(oldest: int, version: int, alpha: int, want: bool) -> str:
    """'' when fresh() answers this case right, else what is wrong, in words."""
    got = impl.fresh(oldest, version, alpha)
    if got is want:
        return ""
    return (f"fresh(oldest_version={oldest}, version={version}, async_ratio={alpha}) returned {got!r}: "
            f"the sample lags {version - oldest} version(s) behind the trainer and the ratio allows {alpha}, "
            f"so it is {'fresh' if want else 'stale'} ({want})")


def capacity_case(alpha: int, B: int, redundant: int, holding: int, want: int) -> str:
    """'' when capacity() answers this case right, else what is wrong, in words."""
    got = impl.capacity(alpha, B, redundant, holding)
    if got == want:
        return ""
    return (f"capacity(async_ratio={alpha}, batch_groups={B}, redundant={redundant}, holding={holding}) "
            f"returned {got!r}, want {want}: the bound has {(alpha + 1) * B + redundant} places for these "
            f"settings (the async ratio's batches and the redundant prompts), {holding} of them held")


def tables_pass():
    """The pure functions first, before a simulated run: the first wrong case fails here, in words."""
    for (o, v, a), want in FRESH:
        if why := fresh_case(o, v, a, want):
            raise AssertionError(f"the fresh() table fails first: {why}")
    for args, want in CAPACITY:
        if why := capacity_case(*args, want):
            raise AssertionError(f"the capacity() table fails first: {why}")


@pytest.mark.parametrize("args, want", FRESH, ids=[f"v{o}-at-v{v}-ratio{a}" for (o, v, a), _ in FRESH])
def test_fresh_table(args, want):
    assert not (why := fresh_case(*args, want)), why


def test_fresh_properties():
    """For every lag: fresh exactly when the lag is at most the ratio; a sample only ever goes stale as the
    trainer moves on, never fresh again; a larger ratio keeps everything a smaller one keeps."""
    rng = random.Random(0)
    for _ in range(500):
        version, alpha = rng.randrange(0, 50), rng.randrange(0, 6)
        oldest = rng.randrange(0, version + 1)
        assert not (why := fresh_case(oldest, version, alpha, version - oldest <= alpha)), why
        if version - oldest > alpha:
            assert not (why := fresh_case(oldest, version + 1, alpha, False)), (
                f"stale at version {version}, fresh again at {version + 1}: {why}")
        else:
            assert not (why := fresh_case(oldest, version, alpha + 1, True)), (
                f"a larger ratio must keep what a smaller one keeps: {why}")


@pytest.mark.parametrize("args, want", CAPACITY, ids=["ratio{}-B{}-R{}-held{}".format(*a) for a, _ in
                                                     CAPACITY])
def test_capacity_table(args, want):
    assert not (why := capacity_case(*args, want)), why


def test_capacity_properties():
    """Each group holding a place takes exactly one; with nothing held the whole bound is free; once the
    bound is held (or more: after a rule's bound shrank) nothing more may be admitted."""
    rng = random.Random(1)
    for _ in range(300):
        alpha, B, redundant = rng.randrange(0, 6), rng.randrange(1, 64), rng.randrange(0, 16)
        bound = (alpha + 1) * B + redundant
        assert not (why := capacity_case(alpha, B, redundant, 0, bound)), f"with nothing held: {why}"
        holding = rng.randrange(0, bound + 1)
        assert not (why := capacity_case(alpha, B, redundant, holding, bound - holding)), why
        over = bound + rng.randrange(1, 10)
        got = impl.capacity(alpha, B, redundant, over)
        assert got <= 0, (f"capacity(async_ratio={alpha}, batch_groups={B}, redundant={redundant}, "
                          f"holding={over}) returned {got}: {over} groups hold places, over the bound "
                          f"{bound}, so nothing more may be admitted (0 or less)")


# --- inside the real system

class StudentFreshness(Freshness):
    """The project's rule object with the student's fresh(): the assembler asks it of every sample, every
    weight sync carries it to the env managers, which abort running work that fails it."""

    def fresh(self, oldest_version: int, version: int, group_id: str = "") -> bool:
        return impl.fresh(oldest_version, version, self.max_lag)


class StudentAdmission(Admission):
    """The project's admission policy with the student's capacity()."""

    def capacity(self, ctrl) -> int:
        return impl.capacity(ctrl.freshness.max_lag, self.cfg.batch_groups, self.cfg.redundant,
                             ctrl.groups_holding_places())


# 2 engines, 4 prompts x 4 samples a step, 2 redundant prompts, long-tailed answers (as tests/test_sim.py's)
SIM = SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=4, redundant=2, max_num_seqs=8,
                len_median=1000, len_sigma=1.0, max_tokens=8192, chunk=128, steps=6, warmup=1,
                train_tok_s=1000.0)


@pytest.mark.parametrize("alpha", [0, 1, 2])
def test_in_the_simulator_staleness_and_places_stay_within_the_bound(alpha):
    """Plugged into the real controller: after every admission the groups holding places are at most
    (alpha + 1) * B + redundant and reach it (admission really fills the pipeline), and no trained sample
    lags more than alpha versions (with alpha >= 1 some do lag: rollout ran ahead of training)."""
    tables_pass()
    cfg = dataclasses.replace(SIM, async_ratio=alpha)
    bound, held = (alpha + 1) * cfg.batch_groups + cfg.redundant, []

    def setup(ctrl):
        ctrl.freshness = StudentFreshness(alpha)
        ctrl.admission = StudentAdmission(ctrl.cfg)
        admit = ctrl.admit

        async def admit_and_count(at_least=0):          # the places held after each admission
            n = await admit(at_least)
            held.append(ctrl.groups_holding_places())
            return n
        ctrl.admit = admit_and_count
        Cap(ctrl, cfg.steps)

    r = simulate(cfg, setup=setup)
    staleness = [row["staleness_max"] for row in r["rows"]]
    assert max(held) <= bound, f"{max(held)} groups held places, over the bound {bound}"
    assert max(held) == bound, f"admission never filled the pipeline: at most {max(held)} of {bound} places"
    assert max(staleness) <= alpha, f"a step trained samples {max(staleness)} versions old (alpha {alpha})"
    if alpha:
        assert max(staleness) >= 1, "no step trained an older sample: rollout never ran ahead of training"
