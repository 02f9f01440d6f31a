"""The core's seams, each plugged in from outside the core by docs/fork.md's code (executed as written there)
and run: a loss, an advantage estimator, an environment, a reward, a weight transport, an admission policy, a
freshness rule. A snippet that no longer plugs in or no longer does what docs/fork.md says fails here."""

import asyncio
import dataclasses
import math
import pathlib
import re
import shutil
import sys
import types

import pytest
import torch

import config
import losses
import rollout
import weight_sync
from controller import ControllerConfig, WholeBatch
from losses import LossConfig, compute_policy_loss, estimate_advantages
from task import Problem

pytestmark = pytest.mark.fast

FORK = pathlib.Path(__file__).resolve().parent.parent / "docs" / "fork.md"


def fork_it_blocks() -> dict[str, str]:
    """The python blocks of docs/fork.md, by the registry each one fills."""
    blocks = re.findall(r"```python\n(.*?)```", FORK.read_text(), re.S)
    out = {}
    for key in ("LOSSES", "ADV_ESTIMATORS", "ENVS", "--reward", "TRANSPORTS", "Admission", "Freshness"):
        hits = [b for b in blocks if key in b]
        assert len(hits) == 1, f"docs/fork.md: {len(hits)} blocks name {key}, expected one"
        out[key] = hits[0]
    return out


REGISTRIES = (losses.LOSSES, losses.ADV_ESTIMATORS, rollout.ENVS, weight_sync.TRANSPORTS, config.EXTENSIONS)


@pytest.fixture
def plug(monkeypatch):
    """Run a docs/fork.md block as a module of its own (`fork_<key>`, in sys.modules while the test runs);
    every registry is as it was afterwards."""
    saved = [dict(r) for r in REGISTRIES]

    def run(key: str, base: dict | None = None) -> types.ModuleType:
        mod = types.ModuleType(f"fork_{key.lower()}")
        mod.__dict__.update(base or {})
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        exec(compile(fork_it_blocks()[key], f"docs/fork.md ({key})", "exec"), mod.__dict__)
        return mod
    yield run
    for r, before in zip(REGISTRIES, saved):
        r.clear()
        r.update(before)


def in_losses() -> dict:
    """What a block written into losses.py sees (docs/fork.md: "in losses.py or an ext/ file")."""
    return {k: v for k, v in vars(losses).items() if not k.startswith("__")}


def test_a_loss_is_one_function_with_its_own_flag(plug, capsys):
    """docs/fork.md's kl_ppo, registered from outside losses.py: --loss takes it, its own flag parses through
    train.py's Config (checked by its dataclass) into compute_policy_loss's keywords, and on toy tensors its
    loss is PPO's per token plus coef * (r - 1 - log r) (by hand), a masked token counting nothing."""
    plug("LOSSES")
    from train import Config
    kw = config.parse_cli(Config, ["--loss", "kl_ppo", "--kl-mu-coef", "0.25"]).train.loss_kwargs()
    assert kw["kl_mu_coef"] == 0.25 and LossConfig(loss="kl_ppo").loss_kwargs()["kl_mu_coef"] == 0.1
    with pytest.raises(SystemExit):
        config.parse_cli(Config, ["--kl-mu-coef", "-1"])
    assert "--kl-mu-coef must be >= 0, got -1" in capsys.readouterr().err
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-1.5, -0.2, -0.7]], requires_grad=True)
    old = logp.detach() - torch.tensor([[0.1, -0.4, 0.5], [0.0, 0.3, -0.1]])      # log r per token
    adv, mask = torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 0, 1]])    # [1, 1]: masked
    loss, metrics = compute_policy_loss(logp, old, adv, mask, "kl_ppo", **kw)
    want = 0.0
    for b, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2)]:
        log_r = logp[b, t].item() - old[b, t].item()
        r, a = math.exp(log_r), adv[b].item()
        want += max(-r * a, -min(max(r, 0.8), 1.28) * a) + 0.25 * (r - 1 - log_r)
    assert loss.item() == pytest.approx(want / 5, rel=1e-6)
    _, ppo_metrics = compute_policy_loss(logp, old, adv, mask, "ppo", **kw)
    assert metrics["clip_frac"] == ppo_metrics["clip_frac"] > 0                   # PPO's extras pass along
    loss.backward()
    assert logp.grad[1, 1] == 0 and logp.grad.abs().sum() > 0


def test_an_advantage_estimator_is_one_function_and_its_entry(plug):
    plug("ADV_ESTIMATORS", in_losses())
    assert LossConfig(adv_estimator="rloo").adv_estimator == "rloo"   # --adv-estimator accepts it
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    got = estimate_advantages(rewards, 4, "rloo")
    want = [r - (sum(g) - r) / 3 for g in (rewards[:4].tolist(), rewards[4:].tolist()) for r in g]
    assert got.tolist() == pytest.approx(want)

    async def train(batch, advantages, version):                     # what the trainer is handed
        return {"advantages": advantages}, None
    backend = WholeBatch(train, 4, estimator="rloo")
    backend.begin(0)
    for k in (0, 4):
        backend.add([types.SimpleNamespace(reward=float(x)) for x in rewards[k:k + 4]])
    metrics, _ = asyncio.run(backend.finish())
    assert metrics["advantages"] == pytest.approx(want)


def test_an_environment_is_one_file(plug):
    """docs/fork.md's plus_one env: --env takes it; the second question is the first's answer plus one, half a
    point for each right answer, two steps."""
    plug("ENVS")
    assert ControllerConfig(env="plus_one").env == "plus_one"               # --env accepts it

    def play(actions):
        env = rollout.ENVS["plus_one"](Problem("2+2=", "4"), seed=0)
        async def main():
            out = [await env.reset(0)]
            for a in actions:
                out.append(await env.step(a))
                if out[-1][2]:
                    break
            return out
        return asyncio.run(main())
    first, right, right_again = play(["4", "5", "9"])
    assert first == "2+2=" and right[:3] == ("\n4+1=", 0.5, False) and right_again[1:3] == (0.5, True)
    assert [step[1] for step in play(["3", "5"])[1:]] == [0.0, 0.5]   # the chain goes on from the true answer
    assert [step[1:3] for step in play(["4", "4"])[1:]] == [(0.5, False), (0.0, True)]


class RecordingRunner:
    """A vLLM model runner's two calls the worker side uses; reload_weights keeps what arrives."""
    device = torch.device("cpu")
    got: list = []

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        self.got = [(n, t.clone()) for n, t in weights_iterator]

    def get_model(self):
        return torch.nn.Module()


def test_a_weight_transport_is_one_file_and_no_core_edit(plug, tmp_path):
    """docs/fork.md's file transport, through the core's two ends: the trainer's sender from TRANSPORTS, the
    engine worker's WeightSyncWorker.receive_weights, which hands the spec's receiver the sync; two syncs,
    bit-exact in the engine's dtype."""
    plug("TRANSPORTS")
    sender = weight_sync.TRANSPORTS["file"].sender(0, "gloo", host="127.0.0.1", port=0, store=None,
                                                   prefix=f"test-{tmp_path.name}", device="cpu",
                                                   timeout_s=30.0, bucket_bytes=1 << 16)
    assert weight_sync.TRANSPORTS["file"].sender(1, "gloo", prefix="x") is None     # rank 0 sends
    worker = weight_sync.WeightSyncWorker()
    worker.model_runner, worker.rank = RecordingRunner(), 0
    g = torch.Generator().manual_seed(1)
    for seq in (1, 2):
        named = [("a.weight", torch.randn(8, 4, generator=g)), ("b.bias", torch.randn(4, generator=g))]
        layout = weight_sync.weight_layout(named, "bfloat16")
        spec = sender.spec(0, 1).with_gen(0, seq)
        sender.send(spec, iter(named), layout)
        out = worker.receive_weights(dataclasses.asdict(spec), 1, layout)
        assert out["tensors"] == 2
        got = worker.model_runner.got
        assert [n for n, _ in got] == ["a.weight", "b.bias"]
        assert all(b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16))
                   for (_, a), (_, b) in zip(named, got))
    shutil.rmtree(sender.path, ignore_errors=True)


def test_an_admission_policy_is_one_file(plug, monkeypatch):
    """docs/fork.md's --admit-burst: its flag parses, its Extension hands the controller its policy, and in a
    simulated run (the real controller, env managers and proxies over the fake engine) no admission admits
    more than N groups while the async ratio's bound still fills: every step trains, some on older samples."""
    mod = plug("Admission")
    assert "admit_burst" in config.EXTENSIONS
    from train import Config
    assert config.parse_cli(Config, ["--admit-burst", "3"]).ext["admit_burst"].admit_burst == 3
    from tools.sim import SimConfig, simulate
    n, admitted, held, staleness = 3, [], [], []
    cfg = SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=2, steps=6, warmup=1,
                    async_ratio=2, redundant=0, filter_groups=False)

    def setup(ctrl):
        ctrl.admission = mod.AdmitBurst(None, mod.BurstConfig(admit_burst=n)).admission(ctrl.cfg)
        assert isinstance(ctrl.admission, mod.Burst)
        admit = ctrl.admit

        async def counted(at_least=0):
            admitted.append(await admit(at_least))
            held.append(ctrl.groups_holding_places())
            return admitted[-1]
        ctrl.admit = counted

    simulate(cfg, setup=setup, observe=lambda ctrl, step: staleness.append(step.info["staleness_max"]))
    assert max(admitted) == n and max(held) == 3 * cfg.batch_groups, (admitted, held)
    assert len(staleness) == cfg.steps and max(staleness) > 0, staleness


def test_a_freshness_rule_is_one_file(plug):
    """docs/fork.md's --max-async-ratio: its flag parses, its Extension hands the controller its rule, and in
    a simulated run from --async-ratio 0 (the trainer waits for rollout every step) the bound grows a version
    a step up to the flag's value; no trained sample lags more than the bound of its step."""
    mod = plug("Freshness")
    assert "adaptive_ratio" in config.EXTENSIONS
    from train import Config
    cfg = config.parse_cli(Config, ["--max-async-ratio", "3"])
    ext = mod.AdaptiveRatio(cfg, cfg.ext["adaptive_ratio"])
    assert mod.AdaptiveRatio.wanted(cfg.ext["adaptive_ratio"])
    from tools.sim import SimConfig, simulate
    sim_cfg = SimConfig(rollout_gpus=2, train_gpus=1, batch_groups=4, group_size=2, steps=6, warmup=1,
                        async_ratio=0, redundant=0, filter_groups=False)
    bounds, staleness = [], []

    def setup(ctrl):
        ctrl.freshness = ext.freshness(ctrl.cfg)

    def observe(ctrl, step):
        bounds.append(ctrl.freshness.max_lag)
        staleness.append(step.info["staleness_max"])
    simulate(sim_cfg, setup=setup, observe=observe)
    assert bounds == [1, 2, 3, 3, 3, 3], bounds
    assert all(s <= b for s, b in zip(staleness, [0] + bounds)) and max(staleness) > 0, staleness


def test_a_negative_reward_reaches_the_advantages(plug):
    """docs/fork.md's --reward penalty:overlong: a long wrong answer's penalty stays in the sample (no clip to
    [0, 1]) and reaches its group's advantages through the env, the trajectory and WholeBatch; a reward of
    NaN fails the sample, naming the env."""
    from buffer import RolloutTask
    from proxy import LLMProxy
    from rollout import PromptFormat, RolloutConfig, inline_reward, run_trajectory
    from tiny_model import build_tokenizer
    from tools.fake_engine import FakeTimedEngine
    mod, tok = plug("--reward"), build_tokenizer()
    problem = Problem("1+1=", "2")
    cfg = RolloutConfig(max_tokens=8, max_model_len=64, max_retries=0)
    fmt = PromptFormat(tok)

    async def sample(reply: str, reward_fn):
        engine = FakeTimedEngine(t0=0.0, k=0.0, respond=lambda ids: tok.encode(reply) + [tok.eos_token_id])
        proxy, failed = LLMProxy(engine), []

        async def on_failure(s):
            failed.append(s)
        s = await run_trajectory(proxy, lambda: rollout.ENVS[""](problem, 0, inline_reward(reward_fn)), fmt,
                                 cfg, RolloutTask("t0.0", "g0", problem), on_failure=on_failure)
        proxy.shutdown()
        return s, failed

    async def main():
        right, _ = await sample("2", mod.overlong)
        long, _ = await sample("3333333", mod.overlong)
        got = []

        async def train(batch, advantages, version):
            got.extend(advantages)
            return {}, None
        backend = WholeBatch(train, 2)
        backend.begin(0)
        backend.add([right, long])
        await backend.finish()
        nan, failed = await sample("2", lambda problem, response: float("nan"))
        return right.reward, long.reward, got, nan, failed
    right, long, advantages, nan, failed = asyncio.run(main())
    assert (right, long) == (1.0, -0.75)
    assert advantages[0] > 0 > advantages[1]
    assert nan is None and "env 'single-turn' step 0 (task t0.0) gave reward nan" in failed[0].meta["error"]
