"""--domains (ext/domains.py): the file's bad input refused by name; the quota policy holding each domain's
share of every step's batch (the simulator: the real controller, buffer and env managers, virtual time) while
admission by weight alone drifts; a domain every group of which is filtered is warned about and not waited
for, one whose samples all fail stops the run; each domain's env, reward and budget on the rollout side; the
per-domain figures; one short real run (one process, the plain-torch engine)."""

import asyncio
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from ext import domains as dm
from task import Problem
from test_sim import holding_bound_recorder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "domains.yaml"


@pytest.fixture(autouse=True)
def envs_restored():
    """A run with --domains adds ENVS["domain:NAME"] in its process: each test here leaves rollout.ENVS as it
    found it (another file's test builds every env of the registry)."""
    from rollout import ENVS
    before = dict(ENVS)
    yield
    ENVS.clear()
    ENVS.update(before)


def write(tmp_path, text: str, name: str = "d.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def two(**second) -> str:
    """A file of two domains, the second's fields as given (None: left out)."""
    fields = {"name": "b", "source": "embedded", "weight": 1, **second}
    body = "".join(f"    {k}: {v}\n" for k, v in fields.items() if v is not None)
    return "domains:\n  - name: a\n    source: embedded\n    weight: 1\n  -\n" + body


NO_JUDGE = SimpleNamespace(ext={"judge": SimpleNamespace(judge="")})

E2 = "entry 2 (b): "
BAD = {   # case -> (the second entry's fields, what the error names after the file)
    "unknown source": ({"source": "web:pages"}, E2 + "field source: 'web:pages' is not a source"),
    "unknown reward": ({"reward": "no_such_module_x:fn"}, E2 + "field reward: 'no_such_module_x:fn'"),
    "missing data file": ({"source": "data:/no/such.jsonl"},
                          E2 + "field source: /no/such.jsonl: no such file"),
    "missing eval file": ({"eval": "/no/such.jsonl"}, E2 + "field eval: /no/such.jsonl: no such file"),
    "zero weight": ({"weight": 0}, E2 + "field weight: 0 is not a positive number"),
    "negative weight": ({"weight": -0.5}, E2 + "field weight: -0.5 is not a positive number"),
    "weight not a number": ({"weight": "heavy"}, E2 + "field weight: 'heavy' is not a positive number"),
    "weight a bool": ({"weight": "true"}, E2 + "field weight: True is not a positive number"),
    "weight nan": ({"weight": ".nan"}, E2 + "field weight: nan is not a positive number"),
    "duplicate name": ({"name": "a"}, "entry 2 (a): field name: 'a' is a duplicate"),
    "no such env": ({"source": "env:nosuch"}, E2 + "field source: 'env:nosuch': env 'nosuch' does not exist"),
    "agent that does not load": ({"source": "agent:no_such_x:fn"},
                                 E2 + "field source: 'agent:no_such_x:fn': cannot load no_such_x"),
    "judge without --judge": ({"reward": "judge"},
                              E2 + "field reward: judge needs the run's judge: --judge DIR --judge-gpus K"),
    "a reward for an env that scores itself": ({"source": "env:guess", "reward": "none"},
                                               E2 + "field reward: env:guess scores its own"),
    "unknown field": ({"colour": "red"}, E2 + "unknown field(s) colour"),
    "missing field": ({"weight": None}, E2 + "field weight is missing"),
    "max_tokens not positive": ({"max_tokens": 0}, E2 + "field max_tokens: 0 is not a positive integer"),
}


@pytest.mark.fast
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_naming_the_file_the_entry_and_the_field(case, tmp_path):
    fields, says = BAD[case]
    path = write(tmp_path, two(**fields))
    with pytest.raises(ValueError) as e:
        dm.load_domains(path, NO_JUDGE)
    assert str(e.value).startswith(f"--domains {path}: ") and says in str(e.value), str(e.value)


@pytest.mark.fast
def test_a_missing_or_malformed_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"--domains /no/such\.yaml: no such file"):
        dm.load_domains("/no/such.yaml")
    for text in ("[1, 2]\n", "domains: []\n", "domains:\n  - a\n", "domains: [\n"):
        path = write(tmp_path, text)
        with pytest.raises(ValueError, match=f"--domains {path}: "):
            dm.load_domains(path)


def test_a_reasoning_gym_task_that_does_not_exist_is_refused(tmp_path):
    path = write(tmp_path, two(source="task:no_such_task"))
    with pytest.raises(ValueError, match=r"entry 2 \(b\): field source: 'task:no_such_task': not a "
                                         r"reasoning-gym task"):
        dm.load_domains(path)


@pytest.mark.fast
def test_the_example_reads_and_its_weights_are_normalised():
    doms = dm.load_domains(str(EXAMPLE))
    assert [(d.name, d.source) for d in doms] == [("arith", "embedded"), ("chain", "env:chain")]
    assert math.isclose(sum(d.weight for d in doms), 1.0) and math.isclose(doms[0].weight, 0.6)


def test_a_run_refuses_domains_beside_a_single_source_and_a_judge_reward_without_judge(tmp_path, capsys):
    """At parse time (every rank, before anything starts): a usage error naming both flags, or the entry."""
    from config import parse_cli
    from train import Config
    for flags in (["--data", str(tmp_path / "x.jsonl")], ["--env", "guess"], ["--reward", "none"],
                  ["--tail-batching"]):
        with pytest.raises(SystemExit):
            parse_cli(Config, ["--domains", str(EXAMPLE), *flags])
        assert f"--domains {EXAMPLE} and {flags[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_cli(Config, ["--domains", write(tmp_path, two(reward="judge"))])
    assert "entry 2 (b): field reward: judge needs the run's judge" in capsys.readouterr().err
    cfg = parse_cli(Config, ["--domains", str(EXAMPLE), "--domain-mix", "admit"])
    assert cfg.ext["domains"].domain_mix == "admit"


# ---------------------------------------------------------------------------------------------
# the policy, on its own


def doms(*weights) -> list:
    total = sum(weights)
    return [dm.Domain(f"d{i}", "embedded", w / total, index=i) for i, w in enumerate(weights)]


def ctrl_cfg(**kw):
    from controller import ControllerConfig
    return ControllerConfig(**{"batch_groups": 32, "group_size": 4, **kw})


@pytest.mark.fast
@pytest.mark.parametrize("weights,B", [((0.6, 0.4), 32), ((1, 1, 1), 32), ((0.7, 0.2, 0.1), 7), ((1, 9), 4)])
def test_each_steps_quota_is_within_one_group_of_the_ideal_and_exact_over_steps(weights, B):
    policy = dm.DomainMix(ctrl_cfg(batch_groups=B), doms(*weights))
    for step in range(1, 41):
        policy.steps = step
        q = policy.plan(B)
        assert sum(q.values()) == B
        assert all(abs(q[n] - w * B) < 1 for n, w in policy.w.items()), q
        policy.trained.update(q)
        assert all(abs(policy.trained[n] - w * B * step) < 1 for n, w in policy.w.items())


@pytest.mark.fast
def test_a_step_may_take_each_domains_quota_of_its_ready_groups_in_their_order():
    """eligible(): the ready groups (the assembler's order) up to each domain's quota less what this step
    took; admit mode: all of them."""
    policy = dm.DomainMix(ctrl_cfg(batch_groups=4), doms(1, 1))
    policy.domain_of = {f"g{i}": ("d0" if i < 5 else "d1") for i in range(8)}
    ready = [[SimpleNamespace(group_id=f"g{i}")] for i in (0, 5, 1, 2, 6, 3, 7)]
    policy.quota = {"d0": 2, "d1": 2}
    assert [g[0].group_id for g in policy.eligible(ready)] == ["g0", "g5", "g1", "g6"]
    policy.taken("g0"), policy.taken("g1")
    assert [g[0].group_id for g in policy.eligible(ready)] == ["g5", "g6"]
    policy.mode = "admit"
    assert policy.eligible(ready) is ready


# ---------------------------------------------------------------------------------------------
# the policy in the simulator: the real controller, buffer and env managers on fake timed engines


def small(alpha: int, steps: int = 10, batch_groups: int = 16):
    """4 engines + 4 trainer GPUs, B x G = 16 x 8 + 4 redundant, and the workloads: long (median 1k tokens,
    long-tailed) and short (median 64)."""
    from tools import sim
    run = sim.SimConfig(rollout_gpus=4, train_gpus=4, batch_groups=batch_groups, group_size=8, redundant=4,
                        max_num_seqs=32, max_concurrency=48, len_median=1000, len_sigma=1.0, max_tokens=8192,
                        chunk=128, steps=steps, warmup=min(3, steps - 1), async_ratio=alpha, reward_s=1.0,
                        reward_std_s=0.3)
    return run, [run, replace(run, len_median=64, len_sigma=0.3, len_sigma_prompt=0.2, max_tokens=512)]


LONG_SHORT = [dm.Domain("long", "embedded", 0.5, index=0), dm.Domain("short", "embedded", 0.5, index=1)]


@pytest.mark.parametrize("alpha", [0, 2])
def test_the_quota_holds_every_steps_mix_and_admission_by_weight_drifts(alpha):
    """quota: every step trains 8 groups of each domain (16 x 0.5), both domains in every row with their time,
    staleness within alpha, the admission bound kept. admit (same seed, same workloads): the mix drifts, its
    share error larger on average than the quota's, which is 0."""
    from tools.domains_study import simulate_mix
    run, workloads = small(alpha, steps=8)
    held, shares = [], {}
    for mix in ("quota", "admit"):
        r = simulate_mix(run, LONG_SHORT, workloads, mix, setup=holding_bound_recorder(held) if mix == "quota"
                         else None)
        rows = r["domains"]
        assert len(rows) == run.steps
        assert all(f"domain/{n}/{k}" in row for row in rows for n in ("long", "short")
                   for k in ("share", "reward_mean", "length_mean", "staleness_mean", "failed", "time_mean"))
        shares[mix] = [row["domain/long/share"] for row in rows]
        if mix == "quota":
            assert all(row["domain/long/groups"] == row["domain/short/groups"] == 8 for row in rows)
            assert all(row["domain/long/staleness_mean"] <= alpha for row in rows)
            # the long domain's trajectories take longer than the short one's
            assert sum(row["domain/long/length_mean"] for row in rows) > 3 * sum(
                row["domain/short/length_mean"] for row in rows)
    assert max(held) <= (alpha + 1) * run.batch_groups + run.redundant
    assert all(s == 0.5 for s in shares["quota"])
    assert sum(abs(s - 0.5) for s in shares["admit"]) > 0.02 * run.steps, shares["admit"]


@pytest.mark.parametrize("case", ["batch rollout", "streaming trainer", "env redundancy", "max gen batches"])
def test_the_quota_holds_with_the_controllers_other_modes(case):
    """Batch rollout (the barrier), the streaming trainer (groups committed as they complete), redundant
    trajectories of an env domain (G + 2 run, the first G kept), --max-gen-batches 1 --on-max-gen-batches
    train (short steps): no step trains more than a domain's quota, and a full step exactly it."""
    from tools.domains_study import simulate_mix
    run, workloads = small(1, steps=4, batch_groups=8)
    over = {"batch rollout": dict(rollout_mode="batch"), "streaming trainer": dict(stream_train=True),
            "env redundancy": dict(env_redundancy=2),
            "max gen batches": dict(max_gen_batches=1, on_max_gen_batches="train")}[case]
    d = [dm.Domain("long", "embedded", 0.5, index=0),
         dm.Domain("short", "env:guess" if case == "env redundancy" else "embedded", 0.5, index=1)]
    r = simulate_mix(replace(run, **over), d, workloads)
    rows = r["domains"]
    assert all(row[f"domain/{n}/groups"] <= 4 for row in rows for n in ("long", "short"))
    full = [row for row in rows if row["domain/long/groups"] + row["domain/short/groups"] == 8]
    assert full and all(row["domain/long/groups"] == 4 for row in full)
    if case == "env redundancy":
        assert sum(x["samples_surplus"] for x in r["rows"]) > 0
    if case == "max gen batches":
        assert len(full) < len(rows)             # (this workload filters about a fifth: some steps end short)


def test_a_resumed_run_admits_its_prompts_in_flight_again_in_their_domains():
    """The checkpoint's prompts in flight (AsyncController.state, as train.py saves it) carry their domain and
    env: a run restored from it admits them first, into their own domains, and holds the mix."""
    from tools.domains_study import simulate_mix
    run, workloads = small(2, steps=3, batch_groups=8)
    saved = {}
    simulate_mix(run, LONG_SHORT, workloads, observe=lambda ctrl, step: saved.update(ctrl.state()))
    in_flight = saved["admission"]["in_flight"]
    assert in_flight and {p["meta"]["domain"] for p in in_flight} == {"long", "short"}
    assert {p["env"] for p in in_flight} == {"domain:long", "domain:short"}
    admitted = []

    def setup(ctrl):
        ctrl.restore(saved)
        admit = ctrl.admit

        async def admit_and_record(at_least=0):
            n = await admit(at_least)
            admitted.extend(p.prompt for p in ctrl.problem_of.values())
            return n
        ctrl.admit = admit_and_record
    r = simulate_mix(replace(run, start_version=3), LONG_SHORT, workloads, setup=setup)
    assert {p["prompt"] for p in in_flight} <= set(admitted)
    assert all(row["domain/long/groups"] == row["domain/short/groups"] == 4 for row in r["domains"])


def test_a_domain_every_group_of_which_is_filtered_is_named_once_and_not_waited_for():
    """Domain hard's pass rate is 0: all its groups are filtered. The quota gives its place to the other
    domain once --domain-patience of its groups in a row ended untrained (a warning, once, naming it and the
    flag), so every step still trains B groups, all of the other domain's."""
    from tools.domains_study import simulate_mix
    run, workloads = small(1, steps=3, batch_groups=8)
    d = [dm.Domain("easy", "embedded", 0.5, index=0), dm.Domain("hard", "embedded", 0.5, index=1)]
    r = simulate_mix(run, d, workloads, "quota", patience=4, pass_rates={1: 0.0})
    rows = r["domains"]
    assert all(row["domain/easy/groups"] == 8 and row["domain/hard/groups"] == 0 for row in rows)
    assert all(row["domain/hard/short"] == 1 for row in rows)
    warned = [x for x in r["log"] if x.startswith("domain hard:")]
    assert len(warned) == 1 and "--domain-patience 4" in warned[0] and "filtered" in warned[0]
    assert r["counters"]["domains"]["hard"]["steps_short"] == run.steps


class AlwaysFails:
    """An env whose reset raises: every sample of its domain fails."""

    def __init__(self, problem, seed, reward_fn=None):
        pass

    async def reset(self, seed):
        raise RuntimeError("this env always fails")


def test_a_domain_whose_samples_all_fail_stops_the_run_naming_it():
    """One domain of two fails every sample: the run-wide breaker never sees 95% (half the samples are
    fine), the domain's own does: the run stops, naming the domain and the reason."""
    from rollout import ENVS
    from tools.domains_study import simulate_mix
    ENVS["always_fails_for_test"] = AlwaysFails
    try:
        run, workloads = small(1, steps=4)
        d = [dm.Domain("good", "embedded", 0.5, index=0), dm.Domain("bad", "env:always_fails_for_test", 0.5,
                                                                     index=1)]
        with pytest.raises(RuntimeError, match=r"sim: domain bad: \d+ of the last \d+ samples failed .*this "
                                               r"env always fails"):
            simulate_mix(run, d, workloads, "quota")
    finally:
        ENVS.pop("always_fails_for_test", None)


# ---------------------------------------------------------------------------------------------
# the rollout side and the figures


async def _reward_of(env, text="5"):
    await env.reset(0)
    return (await env.step(text))[1]


@pytest.mark.fast
def test_each_domain_runs_in_its_env_with_its_reward_and_reply_budget():
    """ENVS["domain:NAME"]: the source's env; the reward the source's own (the task's verifier, even on a
    judged rank), the judge's (what the rank gives: its scorer, or in held-out evaluation the verifier), a
    module's, or none; max_tokens as every turn's budget; the sample finisher notes the domain and time."""
    from proxy import Sampling
    from rollout import ENVS
    d = [dm.Domain("own", "embedded", 0.25), dm.Domain("judged", "embedded", 0.25, reward="judge"),
         dm.Domain("mine", "embedded", 0.25, reward="tests.reward_fixtures:sleep_then", max_tokens=3),
         dm.Domain("game", "env:guess", 0.25)]
    dm.register_envs(d, judged=True)
    p = Problem("2+3=", "5")

    async def judge(problem, response):
        return 0.25

    async def go():
        assert await _reward_of(ENVS["domain:own"](p, 0, reward_fn=judge)) == 1.0       # the verifier
        assert await _reward_of(ENVS["domain:judged"](p, 0, reward_fn=judge)) == 0.25   # the judge
        mine = ENVS["domain:mine"](p, 0, reward_fn=judge)
        assert await _reward_of(mine, "0|0.75") == 0.75                                   # its module's
        assert mine.sampling(Sampling(max_tokens=8)).max_tokens == 3
        assert type(ENVS["domain:game"](p, 0)).__name__ == "GuessEnv"                  # its env's
        s = SimpleNamespace(meta={})
        await dm.finish(s)
        return s
    s = asyncio.run(go())
    assert s.meta["domain"] == "game" and s.meta["domain_s"] >= 0


@pytest.mark.fast
def test_the_figures_per_domain_and_the_held_out_set(tmp_path):
    """Tracker.metrics: share of the trained samples, reward, length, staleness, failures (from the tap),
    trajectory time; the held-out set is each domain's own, tagged with its env; a held-out round's figures
    per domain."""
    from buffer import Sample
    policy = dm.DomainMix(ctrl_cfg(), doms(3, 1))
    policy.domain_of = {"g0": "d0", "g1": "d1"}

    def sample(gid, reward, n, version, failed=False):
        return Sample(f"{gid}.0", gid, [1], [2] * n, [0.0] * n, [1] * n, [version] * n, reward, failed=failed,
                      meta={"domain_s": 2.0})
    tracker = dm.Tracker(doms(3, 1), policy, ctrl_cfg())
    asyncio.run(tracker.tap(sample("g1", 0.0, 1, 0, failed=True)))
    batch = [sample("g0", 1.0, 4, 5)] * 3 + [sample("g1", 0.0, 2, 3)]
    m = tracker.metrics(batch, 6)
    assert m["domain/d0/share"] == 0.75 and m["domain/d1/share"] == 0.25
    assert m["domain/d0/reward_mean"] == 1.0 and m["domain/d1/length_mean"] == 2
    assert m["domain/d0/staleness_mean"] == 1 and m["domain/d1/staleness_mean"] == 3
    assert m["domain/d1/failed"] == 1 and m["domain/d0/failed"] == 0 and m["domain/d0/time_mean"] == 2.0
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    path = write(tmp_path, f"domains:\n  - {{name: m, source: 'data:{data}', weight: 1}}\n"
                           f"  - {{name: g, source: 'env:chain', weight: 1}}\n")
    cfg = SimpleNamespace(ext={"domains": SimpleNamespace(domains=path)})
    held = dm.held_out(cfg, 0, 3)
    assert [(p.meta["domain"], p.env) for p in held] == [("m", "domain:m")] * 3 + [("g", "domain:g")] * 3
    assert [p.prompt for p in held[:3]] == ["q7", "q8", "q9"]
    rows, _ = dm.load_domains(path)[0].problems(0, held=3)
    assert [p.prompt for p in rows] == [f"q{i}" for i in range(7)]           # kept out of training
    samples = [SimpleNamespace(task_id="eval1.0.greedy", reward=1.0, meta={"domain": "m"}),
               SimpleNamespace(task_id="eval1.0.t0", reward=0.5, meta={"domain": "m"})]
    assert dm.domain_round_metrics(samples) == {"domain/m/eval_greedy": 1.0, "domain/m/eval_sampled": 0.5}


# ---------------------------------------------------------------------------------------------
# a real run


@pytest.fixture(scope="module")
def example_run(tmp_path_factory, tiny_model_dir):
    """(out dir, metrics rows, stdout) of python train.py (one process, the plain-torch engine) with
    examples/domains.yaml, 6 steps."""
    out = tmp_path_factory.mktemp("example") / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    flags = ["--domains", str(EXAMPLE), "--steps", "6", "--batch-groups", "10", "--group-size", "4",
             "--eval-every", "6", "--eval-prompts", "4", "--eval-k", "1", "--no-filter-groups",
             "--save-every", "0", "--out-dir", str(out)]
    r = subprocess.run([sys.executable, "train.py", *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out, [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()], r.stdout


def test_a_short_run_of_the_example_tracks_every_domain_in_every_row(example_run):
    """python train.py (one process, the plain-torch engine) with examples/domains.yaml: every row has both
    domains, each step's trained share within one group of the weight (quota), no failed sample, held-out
    figures per domain, the summary's domain lines; tools.plot draws a panel per domain."""
    out, rows, stdout = example_run
    assert len(rows) == 6
    for row in rows:
        assert abs(row["domain/arith/share"] - 0.6) < 1 / 10 and abs(row["domain/chain/share"] - 0.4) < 1 / 10
        assert row["domain/arith/failed"] == row["domain/chain/failed"] == 0
        assert row["domain/chain/time_mean"] > 0 and row["domain/arith/length_mean"] > 0
    assert {"domain/arith/eval_greedy", "domain/chain/eval_greedy"} <= set(rows[-1])
    assert "domains (" in stdout and "  domain     arith: share" in stdout and "arith 0.6" in stdout
    from tools.plot import PlotConfig, plot_run
    written = plot_run(PlotConfig(run_dir=str(out)))
    titles = written[str(out / "domains.png")]
    assert [t.split(":")[0] for t in titles] == ["arith", "chain"]


def test_the_study_writes_its_tables_from_its_runs(example_run, tmp_path, monkeypatch):
    """python -m tools.domains_study as its command runs, small: the simulator part at 16 groups a step, and
    the real part's torchrun jobs, each checked against train.py's parser and answered with the example
    run's rows (what the study reads back is what train.py writes today): both tables, the cost lines, the
    picture, every run in the JSON."""
    import contextlib
    import io

    import tools.jobs
    from config import parse_cli
    from tools import domains_study
    from train import Config
    _, rows, _ = example_run
    launched = []

    def run_to_end(cmd, out, who, timeout_s):
        cfg = parse_cli(Config, cmd[cmd.index("train.py") + 1:])
        launched.append((cfg.controller.async_ratio, cfg.ext["domains"].domain_mix))
        return rows
    monkeypatch.setattr(tools.jobs, "run_to_end", run_to_end)
    out = tmp_path / "domains"
    with contextlib.redirect_stdout(io.StringIO()):
        domains_study.main(["--ratios", "0", "2", "--steps", "5", "--batch-groups", "16", "--real-steps", "6",
                            "--out", str(out)])
    assert launched == [(0, "quota"), (0, "admit"), (2, "quota"), (2, "admit")]
    results = json.loads(out.with_suffix(".json").read_text())
    assert [(r["part"], r["ratio"], r["mix"]) for r in results] == (
        [("sim", r, m) for r in (0, 2) for m in ("quota", "quota/weight", "admit")]
        + [("real", r, m) for r in (0, 2) for m in ("quota", "admit")])
    for r in results:
        assert set(r["domains"]) == ({"long", "short"} if r["part"] == "sim" else {"arith", "chain"})
        assert math.isfinite(r["step_s"]) and r["step_s"] > 0
        assert all(0 <= d["share"] <= 1 and 0 <= d["share_err_mean"] <= d["share_err_max"] <= 1
                   for d in r["domains"].values())
    md = out.with_suffix(".md").read_text()
    assert "## Simulator, 128 GPUs" in md and "## Real CPU engines" in md
    assert md.count("- ratio 0: the quota costs") == 2 and md.count("- ratio 2: the quota costs") == 2
    assert out.with_suffix(".png").stat().st_size > 10_000
