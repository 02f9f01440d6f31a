"""bench_agent.py: --agent (ext/agent.py) measured against the in-process env path, side by side in one run.

    .venv/bin/python -m tools.bench_agent calls            # the endpoint's cost per model call (~35 s)
    .venv/bin/python -m tools.bench_agent train            # examples/calc_agent.py vs --env calc (~14 min)
    .venv/bin/python -m tools.bench_agent calls --trajectories 400 --concurrency 64

calls: one rollout rank's EnvManager over the fake timed engine (scripted replies, a 1 ms decode step) runs
the calculator protocol of --env calc (a call, its value, the answer: two model calls per trajectory) two
ways, alternating, --repeats times each: `env`, an in-process Env (reset/step, the same calculator code as
the example, no sandbox: the sandbox's process start would hide what is measured), `agent`,
examples/calc_agent.py through the real openai client the endpoint hands it (in-process transport), and
`agent-http`, the same agent with a client of its own over loopback HTTP to the endpoint's server (one
httpx pool for the arm). Per model call: the
rank process's CPU (user + system), the latency the caller sees (env: the proxy's generate; agent: the
client's create) and, inside it, the engine's generate. Prints one JSON object with the ratios.

train: `torchrun train.py` on the calculator task, --seeds seeds each: `--env calc` (the embedded calc
model, the sandbox) and `--agent examples/calc_agent.py:agent --model <that model>`, the same flags
otherwise. Per run: the reward of the first and the last --window steps; the claim is that the agent
trains like the env (its last-window reward within the env's seed spread).
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def calls_arm(kind: str, n: int, concurrency: int) -> dict:
    """One arm of `calls`: n trajectories of the calculator protocol, `concurrency` at a time."""
    from buffer import Cmd, Command, LocalQueues, RolloutTask, SampleBuffer
    from env_manager import EnvManager, RolloutConfig
    from examples import calc_agent
    from ext.agent import load_agent, register
    from proxy import LLMProxy
    from rollout import ENVS
    from task import make_problems
    from tiny_model import build_tokenizer
    from tools.fake_engine import FakeTimedEngine

    tok = build_tokenizer()
    problems = make_problems(n, seed=1)
    eos = tok.eos_token_id

    def respond(ids):                 # the model: a call first, then the call's value as the answer
        text = tok.decode(ids)
        if text.endswith(" answer:"):
            return tok.encode(text.rsplit("=", 1)[1][:-len(" answer:")], add_special_tokens=False) + [eos]
        return tok.encode(f"calc({text.rstrip('=')})", add_special_tokens=False) + [eos]

    class CalcProtocolEnv:            # --env calc's protocol, in process, the example's calculator
        def __init__(self, problem):
            self.problem, self.calls = problem, 0

        async def reset(self, seed):
            return self.problem.prompt

        async def step(self, action):
            call = calc_agent.CALL.fullmatch(action)
            if call and self.calls < calc_agent.MAX_CALLS:
                self.calls += 1
                value = calc_agent.calculate(call.group(1))
                return (f" ={value} answer:" if value is not None else " error, answer:"), 0.0, False, {}
            return "", float(action.strip() == self.problem.answer), True, {}

    caller, engine_s = [], []

    async def main():
        endpoint = None
        if kind.startswith("agent"):
            import httpx
            import openai
            agent = load_agent(str(ROOT / "examples" / "calc_agent.py") + ":agent")
            pool = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

            async def timed(client, model, problem):   # the client's create, timed around each call
                if kind == "agent-http":      # the same agent over loopback HTTP to the endpoint's server
                    client = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key,
                                                http_client=pool, max_retries=0)
                create = client.chat.completions.create

                async def timed_create(**kw):
                    t = time.perf_counter()
                    try:
                        return await create(**kw)
                    finally:
                        caller.append(time.perf_counter() - t)
                client.chat.completions.create = timed_create
                return await agent(client, model, problem)
            endpoint = register(timed, "calc_agent", "policy")
        else:
            ENVS["bench-calc"] = lambda problem, seed, reward_fn=None: CalcProtocolEnv(problem)
        proxy = LLMProxy(FakeTimedEngine(t0=0.001, k=0.0, respond=respond, vocab_size=len(tok)), rank=0,
                         timeout_s=60)
        generate = proxy.generate

        async def timed_generate(*a, **kw):
            t = time.perf_counter()
            try:
                return await generate(*a, **kw)
            finally:
                engine_s.append(time.perf_counter() - t)
        proxy.generate = timed_generate
        buf = SampleBuffer(LocalQueues(1), "bench", timeout_s=120)
        cfg = RolloutConfig(max_tokens=16, max_model_len=128, max_concurrency=concurrency, max_retries=0)
        mgr = EnvManager(proxy, buf, tok, rank=0, cfg=cfg)
        env = "agent" if kind.startswith("agent") else "bench-calc"
        run = asyncio.create_task(mgr.run())
        if endpoint is not None:
            await endpoint.base_url()                 # (started before the clock, as in a run)
        t0, c0 = time.perf_counter(), time.process_time()
        await buf.put_tasks([RolloutTask(f"t{i}", f"g{i}", p, env=env) for i, p in enumerate(problems)])
        samples = [await buf.get_sample(timeout=120) for _ in problems]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        await buf.send_command(0, Command(Cmd.STOP))
        stats = await asyncio.wait_for(run, 60)
        if endpoint is not None:
            await endpoint.close_server()             # (its counters leave RANK_STATS: the next arm's)
        return samples, stats, wall, cpu
    samples, stats, wall, cpu = asyncio.run(main())
    failed = [s.meta.get("error") for s in samples if s.failed]
    if failed:
        raise SystemExit(f"bench_agent calls ({kind}): {len(failed)} failed samples, e.g. {failed[0]}")
    calls = len(engine_s)
    if kind == "env":
        caller[:] = engine_s
    return {"model_calls": calls, "reward_mean": round(statistics.mean(s.reward for s in samples), 3),
            "wall_s": round(wall, 3), "cpu_ms_per_call": round(1000 * cpu / calls, 3),
            "latency_ms_per_call": round(1000 * statistics.mean(caller), 3),
            "engine_ms_per_call": round(1000 * statistics.mean(engine_s), 3),
            "endpoint_handler_cpu_ms_per_call": (round(1000 * stats["agent"]["handler_cpu_s"] / calls, 3)
                                                 if "agent" in stats else None),
            "stitching": {k: v for k, v in stats.get("agent", {}).items()
                          if k in ("appended", "kept", "restart")}}


def bench_calls(args) -> dict:
    arms = {"env": [], "agent": [], "agent-http": []}
    for rep in range(args.repeats):
        for kind in ("env", "agent", "agent-http") if rep % 2 == 0 else ("agent-http", "agent", "env"):
            r = calls_arm(kind, args.trajectories, args.concurrency)
            print(f"  {kind}: {json.dumps(r)}", flush=True)
            arms[kind].append(r)
    metrics = ("cpu_ms_per_call", "latency_ms_per_call", "engine_ms_per_call")
    med = {k: {m: statistics.median(r[m] for r in rs) for m in metrics} for k, rs in arms.items()}
    return {"trajectories": args.trajectories, "concurrency": args.concurrency, "repeats": args.repeats,
            "median": med, "runs": arms,
            "agent_over_env": {m: round(med["agent"][m] / med["env"][m], 2) for m in med["env"]},
            "agent_minus_env_ms": {m: round(med["agent"][m] - med["env"][m], 3) for m in med["env"]},
            "http_over_in_process": {m: round(med["agent-http"][m] / med["agent"][m], 2) for m in med["env"]}}


def bench_train(args) -> dict:
    from ext.calc import ensure_calc_model
    from tools.jobs import run_to_end, torchrun_cmd
    model = ensure_calc_model(log=print)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--steps", str(args.steps), "--batch-groups", str(args.batch_groups), "--group-size",
             str(args.group_size), "--save-every", "0"]
    arms = {"env": ["--env", "calc"],
            "agent": ["--agent", "examples/calc_agent.py:agent", "--model", str(model), "--max-tokens", "16"]}
    runs = {k: [] for k in arms}
    for seed in args.seeds:
        for kind, extra in arms.items():
            d = out / f"{kind}-seed{seed}"
            t = time.time()
            rows = run_to_end(torchrun_cmd("--out-dir", str(d), "--overwrite", "--seed", str(seed), *flags,
                                           *extra), d, f"bench_agent train ({kind}, seed {seed})", 3600)
            rewards = [r["reward_mean"] for r in rows]
            w = args.window
            r = {"seed": seed, "first": round(statistics.mean(rewards[:w]), 3),
                 "last": round(statistics.mean(rewards[-w:]), 3),
                 "s_per_step": round(statistics.median(r["time_step"] for r in rows), 3),
                 "wall_s": round(time.time() - t, 1)}
            print(f"  {kind}: {json.dumps(r)}", flush=True)
            runs[kind].append(r)
    env_last = [r["last"] for r in runs["env"]]
    agent_last = [r["last"] for r in runs["agent"]]
    return {"steps": args.steps, "window": args.window, "runs": runs,
            "env_last": {"mean": round(statistics.mean(env_last), 3), "min": min(env_last),
                         "max": max(env_last)},
            "agent_last": {"mean": round(statistics.mean(agent_last), 3), "min": min(agent_last),
                           "max": max(agent_last)},
            "agent_within_env_spread": min(env_last) <= statistics.mean(agent_last) <= max(env_last)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["calls", "train"])
    ap.add_argument("--trajectories", type=int, default=200, help="calls: trajectories per arm and repeat")
    ap.add_argument("--concurrency", type=int, default=32, help="calls: trajectories in flight")
    ap.add_argument("--repeats", type=int, default=3, help="calls: runs of each arm, alternating")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train: seeds per arm")
    ap.add_argument("--steps", type=int, default=30, help="train: steps per run")
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--window", type=int, default=5, help="train: steps averaged at the start and the end")
    ap.add_argument("--out-dir", default="runs/bench_agent", help="train: the runs' dirs")
    ap.add_argument("--out", default="", help="also write the JSON here")
    args = ap.parse_args()
    result = bench_calls(args) if args.what == "calls" else bench_train(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
