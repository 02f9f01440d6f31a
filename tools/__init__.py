"""tools/: what measures, simulates or studies the system; none of it is imported by the core.
Run from the repository root as modules, e.g. `.venv/bin/python -m tools.sim queue`.

    sim.py              the simulator: the real controller/buffer/env_manager code on fake engines,
                        paper scale
    sim_vs_real.py      the simulator's engine model calibrated to real vLLM CPU engines, the same runs
                        both ways
    bench.py            the rollout speedups with real engines and the real trainer, side by side in one run
    bench_e2e.py        the whole system (ratio 0 and 2) against a plain synchronous loop, to the same reward
    bench_proxy.py      proxy vs raw AsyncLLM throughput, weight update time
    bench_weight_sync.py  the weight sync before and after it went straight into the engines
    bench_trainer.py    the trainer at scale on CPU: log-prob, activation, start-up memory, packing, memplan
    gpu_check.py        the trainer side's GPU paths on one GPU, checked and measured in one run
    bench_chaos.py      random SIGKILLs of a run under torchrun --max-restarts: what each costs
    soak.py             a long faulty run watched for leaks (memory, fds, threads, requests in flight)
    profile_step.py     where a default step's time goes, in every process of the job
    study.py            the off-policy losses at async ratio 0 / 2 / 8 with real engines (Takeaway 4)
    plot.py             pictures of a run: metrics.png, timeline.png
    jobs.py             a train.py job seen from outside (the tools and the tests)
    core_lines.py       the core's size in code lines, and how much of it a run executes (coverage)
"""
