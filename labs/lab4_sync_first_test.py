"""Lab 4's grader: SyncFirst installed in tools/sim.py's simulator (the real controller, env managers and
proxies over a timed fake engine; virtual seconds, well under a second of real time a run), measured
against the synchronous (async ratio 0) and the asynchronous (async ratio 2) runs of the same workload."""

import dataclasses
import functools

from labs.grading import Cap, load
from tools.sim import SimConfig, simulate

impl = load("lab4_sync_first")
N, ALPHA = 3, 2
# 2 engines, 4 prompts x 2 samples a step, no redundant prompts and no filtering: exactly B groups a step
SIM = SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=2, redundant=0, filter_groups=False,
                async_ratio=ALPHA, steps=8, warmup=N)
B = SIM.batch_groups


@functools.cache
def measure(policy: str, start_version: int = 0, redundant: int = 0) -> dict:
    """One simulated run: "sync" (async ratio 0), "async" (ratio 2) or "sync_first" (ratio 2, the student's
    SyncFirst for N steps), under the grader's cap (labs/grading.Cap). Per step: staleness_max, seconds,
    and the most places held after an admission."""
    cfg = dataclasses.replace(SIM, async_ratio=0 if policy == "sync" else ALPHA, start_version=start_version,
                              redundant=redundant)
    held: dict[int, int] = {}

    def setup(ctrl):
        if policy == "sync_first":
            ctrl.admission = impl.SyncFirst(ctrl.cfg, N)
            Cap(ctrl, cfg.steps)
        admit = ctrl.admit

        async def admit_and_count(at_least=0):
            n = await admit(at_least)
            step = ctrl.version - ctrl.version0
            held[step] = max(held.get(step, 0), ctrl.groups_holding_places())
            return n
        ctrl.admit = admit_and_count

    rows = simulate(cfg, setup=setup)["rows"]
    ends = [0.0] + [row["t_end"] for row in rows]
    return {"staleness": [row["staleness_max"] for row in rows],
            "seconds": [b - a for a, b in zip(ends, ends[1:])],
            "held": [held[k] for k in range(len(rows))]}


def test_the_first_n_steps_are_synchronous():
    """Steps 1..N admit at most B groups (+ redundant: none here) and train only samples of the current
    version, as the synchronous run does."""
    m = measure("sync_first")
    assert m["held"][:N] == [B] * N, (
        f"the most places held in each of the first {N} steps (synchronous): {m['held'][:N]}, want {B} each "
        f"(B = {B} groups, no redundant ones)")
    assert m["staleness"][:N] == [0] * N, (
        f"the staleness of the first {N} steps: {m['staleness'][:N]}, want 0 each (synchronous)")


def test_the_synchronous_bound_keeps_the_redundant_groups():
    """With R redundant prompts the synchronous steps may hold B + R places, the later ones
    (alpha + 1) * B + R: redundancy is dynamic filtering's head start in both."""
    R = 2
    m = measure("sync_first", redundant=R)
    assert m["held"][:N] == [B + R] * N, (
        f"with {R} redundant prompts, the most places held in each of the first {N} steps: {m['held'][:N]}, "
        f"want B + redundant = {B + R} each")
    assert m["held"][N:] == [(ALPHA + 1) * B + R] * (SIM.steps - N), (
        f"with {R} redundant prompts, the places held after step {N}: {m['held'][N:]}, want "
        f"(async_ratio + 1) * B + redundant = {(ALPHA + 1) * B + R} each")


def test_then_the_async_ratio():
    """From step N + 1 on, (alpha + 1) * B groups hold places and samples up to alpha versions old train."""
    m = measure("sync_first")
    assert m["held"][N:] == [(ALPHA + 1) * B] * (SIM.steps - N), (
        f"the most places held in each step after step {N} (async ratio {ALPHA}): {m['held'][N:]}, want "
        f"(async_ratio + 1) * B = {(ALPHA + 1) * B} each")
    assert max(m["staleness"][N:]) > 0, "no later step trained an older sample: rollout never ran ahead"
    assert max(m["staleness"]) <= ALPHA, f"staleness per step {m['staleness']}: over the async ratio {ALPHA}"


def test_a_resumed_run_counts_its_steps_from_where_it_resumed():
    """A run resumed at version 10 (ctrl.version0 = 10) is synchronous for its own first N steps too."""
    m = measure("sync_first", start_version=10)
    assert m["held"][:N] == [B] * N and m["staleness"][:N] == [0] * N, (
        f"resumed at version 10: places held {m['held']}, staleness {m['staleness']}; count steps from "
        f"ctrl.version0")
    assert m["held"][N:] == [(ALPHA + 1) * B] * (SIM.steps - N), (
        f"resumed at version 10: the places held after its step {N}: {m['held'][N:]}, want {(ALPHA + 1) * B} "
        f"each")


def test_the_seconds_per_step():
    """The synchronous steps cost what the synchronous run's steps cost (the same work, the same engines);
    once async, a step costs much less: rollout no longer waits for training, nor training for rollout."""
    sync, asyn, first = measure("sync"), measure("async"), measure("sync_first")
    print(f"\n{'run':<28}" + "".join(f"{f'step {k + 1}':>9}" for k in range(SIM.steps)) + f"{'after N':>9}")
    for name, m in (("sync (ratio 0)", sync), (f"sync_first (N {N}, ratio {ALPHA})", first),
                    (f"async (ratio {ALPHA})", asyn)):
        after = sum(m["seconds"][N:]) / (SIM.steps - N)
        print(f"{name + ' s':<28}" + "".join(f"{s:>9.1f}" for s in m["seconds"]) + f"{after:>9.1f}")
        print(f"{'  staleness':<28}" + "".join(f"{s:>9}" for s in m["staleness"]))
    for k in range(N):
        assert abs(first["seconds"][k] - sync["seconds"][k]) <= 1e-6 * sync["seconds"][k], (
            f"step {k + 1}: {first['seconds'][k]:.2f} s, the synchronous run's {sync['seconds'][k]:.2f} s")
    later, sync_later = sum(first["seconds"][N:]), sum(sync["seconds"][N:])
    assert later < 0.75 * sync_later, f"after step {N}: {later:.1f} s against the sync run's {sync_later:.1f}"
