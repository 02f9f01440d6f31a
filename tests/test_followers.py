"""TrainerRanks on real gloo processes: a follower (trainer rank > 0) waits for trainer rank 0's next op
as long as a step takes (a long collection or evaluation outlasts --timeout-s), yet fails within about
--timeout-s once trainer rank 0 is dead. No model: the ops are 'probe's whose collective stands in for
FSDP's (the ops themselves: test_trainer.py, test_train.py)."""

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from test_trainer import free_port
from ranks import TrainerRanks

TIMEOUT_S = 5.0      # --timeout-s: the trainer group's timeout, and the longest a follower hears nothing


class CollectiveTrainer:
    """What TrainerRanks asks of a Trainer for a 'probe': here a collective over the trainer group
    (as FSDP's forward is), returning the sum of rank + 1 over the ranks."""

    def __init__(self, group):
        self.rank, self.group, self.probes = dist.get_rank(group), group, 0

    def probe_logprobs(self, ids):
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t, group=self.group)
        self.probes += 1
        return t.tolist()


def _trainer_rank(rank, world, port, store_host, idle_s, out):
    """Trainer rank `rank` of `world`, set up as train.py does: a default group with a long timeout, the
    trainer group with --timeout-s, the mailboxes on the default group's TCPStore (hosted by the test, as
    by torchrun's agent, or by rank 0). Rank 0: probe, idle `idle_s` (a long collection), probe, stop;
    the others follow(). Each writes its results, or its error, to out.<rank>."""
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0 and store_host == "rank 0",
                          wait_for_workers=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT_S))
    trainer = CollectiveTrainer(group)
    ranks = TrainerRanks(trainer, world, group, "", "", [], store=dist.PrefixStore("trainer-ranks", store),
                         timeout_s=TIMEOUT_S)
    try:
        if rank == 0:
            first = ranks.probe()
            Path(f"{out}.ready").touch()
            time.sleep(idle_s)
            result = [first, ranks.probe()]
            ranks.stop()
        else:
            ranks.follow()
            result = trainer.probes
    except RuntimeError as e:
        Path(f"{out}.{rank}").write_text(json.dumps({"error": str(e)}))
        raise
    Path(f"{out}.{rank}").write_text(json.dumps({"result": result,
                                                 "threads": [t.name for t in threading.enumerate()]}))
    dist.barrier()               # every rank done before any tears the group down
    dist.destroy_process_group()


def agent_store(port: int):
    """The store's host outside the ranks, as torchrun's agent is."""
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def test_followers_wait_out_a_step_longer_than_the_timeout(tmp_path):
    """Rank 0 idles 3x --timeout-s between two ops (a long collection): the follower waits it out, runs
    the second op, stops on 'stop'; no rank leaves a thread behind (rank 0's heartbeat ends at stop)."""
    port, out = free_port(), str(tmp_path / "rank")
    host = agent_store(port)
    mp.spawn(_trainer_rank, args=(2, port, "agent", 3 * TIMEOUT_S, out), nprocs=2)
    del host
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    assert r0["result"] == [[3.0], [3.0]] and r1["result"] == 2        # both probes ran on both ranks
    assert r0["threads"] == ["MainThread"] and r1["threads"] == ["MainThread"]


@pytest.mark.parametrize("store_host", ["agent", "rank 0"])
def test_followers_fail_soon_after_rank_0_dies(tmp_path, store_host):
    """Rank 0 SIGKILLed while two followers wait for its next op: each fails within 3x --timeout-s
    (no heartbeat; or at once, where rank 0 hosted the store) with an error naming itself and rank 0."""
    port, out = free_port(), str(tmp_path / "rank")
    host = agent_store(port) if store_host == "agent" else None
    procs = mp.spawn(_trainer_rank, args=(3, port, store_host, 3600.0, out), nprocs=3, join=False).processes
    try:
        deadline = time.monotonic() + 180
        while not Path(f"{out}.ready").exists():                       # rank 0 done with its first op
            assert all(p.is_alive() for p in procs), [p.exitcode for p in procs]
            assert time.monotonic() < deadline, "rank 0's first op did not finish in time"
            time.sleep(0.2)
        procs[0].kill()
        t = time.monotonic()
        for p in procs[1:]:
            p.join(max(0.0, t + 3 * TIMEOUT_S - time.monotonic()))
        took = time.monotonic() - t
        assert not any(p.is_alive() for p in procs[1:]), f"followers waiting {took:.1f} s after the kill"
        for r in (1, 2):
            error = json.loads(Path(f"{out}.{r}").read_text())["error"]
            assert error.startswith(f"trainer rank {r}: ") and "trainer rank 0" in error, error
            assert procs[r].exitcode != 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        del host
