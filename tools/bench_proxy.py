"""bench_proxy.py: what the proxy costs. Same requests through LLMProxy vs straight into AsyncLLM,
on one real vLLM engine, interleaved in one run; plus the weight update time.

    .venv/bin/python -m tools.bench_proxy               # tiny model, 512 requests x 64 tokens, 6 rounds
    .venv/bin/python -m tools.bench_proxy --model DIR --num-requests 512 --max-tokens 128

Prints one JSON object: raw and proxy tokens/s per round, proxy/raw throughput ratio (median of
rounds), and the weight update phases (suspend, load, resume) in ms, median over updates; load is the
engine receiving the weights over the weight-sync group (gloo, from this process) and loading them.
"""

import argparse
import asyncio
import json
import statistics
import time


async def run_raw(llm, prompts, max_tokens, tag):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # the same request the proxy sends: per-token logprobs, streamed deltas
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0,
                            output_kind=RequestOutputKind.DELTA)

    async def one(i, p):  # keep what any caller needs: the tokens and their logprobs
        ids, lps = [], []
        async for out in llm.generate({"prompt_token_ids": p}, params, f"{tag}-{i}"):
            o = out.outputs[0]
            ids += o.token_ids
            lps += [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)]
        return len(ids)
    return sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))


async def run_proxy(proxy, prompts, max_tokens):
    from proxy import Sampling

    cs = await asyncio.gather(*[proxy.generate(p, Sampling(max_tokens=max_tokens, ignore_eos=True))
                                for p in prompts])
    return sum(len(c.token_ids) for c in cs)


async def main(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from proxy import LLMProxy
    from tools.local import push
    from weight_sync import Sender

    if not args.model:
        import tiny_model
        args.model = str(tiny_model.ensure_tiny_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    import task
    prompts = [tok.encode(p.prompt) for p in task.make_problems(args.num_requests, seed=0)]
    proxy = await LLMProxy.start_vllm(args.model, rank=0, max_num_seqs=args.num_requests)
    llm = proxy.engine.llm
    await run_proxy(proxy, prompts[:8], 4)                      # warm-up
    raw_tps, proxy_tps = [], []
    for r in range(args.rounds):              # interleaved, order alternating, so drift hits both alike
        for which in (("raw", "proxy") if r % 2 == 0 else ("proxy", "raw")):
            t = time.perf_counter()
            if which == "raw":
                n = await run_raw(llm, prompts, args.max_tokens, f"raw{r}")
                raw_tps.append(n / (time.perf_counter() - t))
            else:
                n = await run_proxy(proxy, prompts, args.max_tokens)
                proxy_tps.append(n / (time.perf_counter() - t))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sender = Sender(timeout_s=300)            # weight-sync rank 0 (the trainer's side), on a store of its own
    phases = {"suspend_ms": [], "load_ms": [], "resume_ms": [], "total_ms": []}
    for v in range(1, args.updates + 1):
        t0 = time.perf_counter()
        await proxy.suspend("keep")
        t1 = time.perf_counter()
        await push([proxy], sender, named, v)     # the first update also forms the group
        t2 = time.perf_counter()
        await proxy.resume()
        t3 = time.perf_counter()
        for k, x in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
            phases[k].append(1000 * x)
    proxy.shutdown()
    ratios = [p / r for p, r in zip(proxy_tps, raw_tps)]   # per round: the two ran back to back
    print(json.dumps({
        "model": args.model, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "raw_tokens_per_s": [round(x) for x in raw_tps], "proxy_tokens_per_s": [round(x) for x in proxy_tps],
        "proxy_over_raw": round(statistics.median(ratios), 3),
        "weight_update_ms": {k: round(statistics.median(v), 1) for k, v in phases.items()},
        "weight_mb": round(sum(t.numel() * t.element_size() for _, t in named) / 2**20, 2),
    }, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF model dir (default: the embedded tiny model)")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--updates", type=int, default=5)
    asyncio.run(main(ap.parse_args()))
