"""stream.py: the streaming trainer's gradient is the whole batch's, whatever order the groups arrive in;
the dealer's micro-batches; the same over 2 FSDP ranks with unequal shares."""

import os
import random
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ext import stream_trainer as stream
import trainer
from losses import AGG_MODES, group_advantages
from ext.stream_trainer import Dealer, GradStream
from tests.test_trainer import free_port, make_samples
from trainer import TrainConfig, Trainer


def groups_of(model_dir, lengths, G=2):
    """Groups of G samples with the given response lengths (in order), rewards 0/1 within a group."""
    samples = []
    for i, n in enumerate(lengths):
        [s] = make_samples(model_dir, n=1, resp_len=n, seed=i)
        s.group_id, s.reward = f"g{i // G}", float((i * 7) % 3 == 0)
        samples.append(s)
    return [samples[i:i + G] for i in range(0, len(samples), G)]


def capture_step(tr):
    """Replace the optimizer's step by a copy of the gradients it would apply (after clipping)."""
    seen = {}
    tr.opt.step = lambda: seen.update({n: p.grad.clone() for n, p in tr.model.named_parameters()
                                       if p.grad is not None})
    return seen


def whole_batch(model_dir, cfg, groups):
    tr = Trainer(str(model_dir), cfg)
    seen = capture_step(tr)
    batch = [s for g in groups for s in g]
    adv = group_advantages(torch.tensor([s.reward for s in batch]), len(groups[0])).tolist()
    m = tr.train_step(batch, adv, version=0)
    return seen, m


def streamed(model_dir, cfg, groups, order):
    tr = Trainer(str(model_dir), cfg)
    seen = capture_step(tr)
    grad, dealer = GradStream(tr), Dealer(1, cfg.micro_batch, cfg.max_tokens_per_micro)
    grad.begin(0)
    passes = 0
    for i in order:                             # the groups as they complete
        g = groups[i]
        adv = group_advantages(torch.tensor([s.reward for s in g]), len(g)).tolist()
        for parts in dealer.add(g, adv):
            grad.micro(*parts[0])
            passes += 1
    for parts in dealer.flush():
        grad.micro(*parts[0])
        passes += 1
    return seen, grad.step(), passes


LENGTHS = [3, 11, 5, 8, 2, 9, 14, 4, 6, 6, 1, 12]          # 6 groups of 2, responses of 1 to 14 tokens

# Gradients computed two ways agree within GRAD_TOL (float32: the same terms summed in another order; 2e-8
# to 4e-7 seen). That means something only for a gradient well above it (a vanished one would match
# whatever the weighting), so "a real gradient" has its largest entry above REAL_GRAD, 1000 x GRAD_TOL:
# agreeing within GRAD_TOL is then agreeing to 0.1% of it. Relative to the tolerance, not an absolute size:
# the gradient's size depends on the tiny model this machine built (0.036 to 0.15 seen for one batch)
GRAD_TOL = 1e-6
REAL_GRAD = 1000 * GRAD_TOL


@pytest.mark.parametrize("kw", [dict(loss="ppo", micro_batch=3),
                                dict(loss="ppo", micro_batch=3, loss_agg="seq-mean-token-mean"),
                                dict(loss="decoupled_ppo", micro_batch=2),     # pre-update logprobs per micro
                                dict(loss="ppo", max_tokens_per_micro=40, kl_coef=0.1)])
def test_streamed_gradient_equals_the_whole_batch_gradient_in_any_arrival_order(tiny_model_dir, kw):
    """The gradient the optimizer step sees, within GRAD_TOL: the whole batch at once (train_step), and the
    same groups streamed in three arrival orders, micro-batches formed as they arrive (so different ones
    each time), unnormalised and scaled once at the end."""
    cfg = TrainConfig(lr=1e-3, **kw)
    groups = groups_of(tiny_model_dir, LENGTHS)
    ref, m_ref = whole_batch(tiny_model_dir, cfg, groups)
    assert max(v.abs().max().item() for v in ref.values()) > REAL_GRAD       # a real gradient
    for seed in (0, 1, 2):
        order = list(range(len(groups)))
        random.Random(seed).shuffle(order)
        got, m, passes = streamed(tiny_model_dir, cfg, groups, order)
        assert set(got) == set(ref)
        assert max((got[n] - ref[n]).abs().max().item() for n in ref) < GRAD_TOL, (order, kw)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-4, abs=1e-7) and m["num_updates"] == 1
        assert passes >= 3                                                      # several micro-batches


def test_a_streamed_step_moves_the_weights_once_like_train_step(tiny_model_dir):
    """Not only the gradient: after the step the weights are train_step's (within 1e-5, as the FSDP tests:
    Adam's first step divides by the gradient's own magnitude, so entries near its eps amplify float32's
    rounding of the gradient to ~1e-6 of lr)."""
    cfg = TrainConfig(lr=1e-3, micro_batch=2)
    groups = groups_of(tiny_model_dir, LENGTHS[:8])
    a = Trainer(str(tiny_model_dir), cfg)
    batch = [s for g in groups for s in g]
    a.train_step(batch, group_advantages(torch.tensor([s.reward for s in batch]), 2).tolist())
    b = Trainer(str(tiny_model_dir), cfg)
    grad, dealer = GradStream(b), Dealer(1, 2)
    grad.begin(None)
    for g in reversed(groups):
        for parts in dealer.add(g, group_advantages(torch.tensor([s.reward for s in g]), 2).tolist()):
            grad.micro(*parts[0])
    for parts in dealer.flush():
        grad.micro(*parts[0])
    grad.step()
    assert a.num_steps == b.num_steps == 1
    wa, wb = dict(a.full_state()), dict(b.full_state())
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


def test_dealer_deals_round_robin_within_the_budget_and_flushes_the_rest(tiny_model_dir):
    from buffer import Sample
    def s(n, i):
        return Sample(f"t{i}", "g", [1], [2] * (n - 1), [-1.0] * (n - 1), [1] * (n - 1), [0] * (n - 1), 0.0)
    d = Dealer(world=2, micro_batch=2)
    assert d.add([s(5, 0), s(5, 1), s(5, 2)], [0, 1, 2]) == []              # 3 < 2 ranks x 2
    [micro] = d.add([s(5, 3), s(5, 4)], [3, 4])                              # 4: full, at once
    assert [[x.task_id for x in part[0]] for part in micro] == [["t0", "t2"], ["t1", "t3"]]
    assert [part[1] for part in micro] == [[0, 2], [1, 3]]
    [rest] = d.flush()
    assert [[x.task_id for x in part[0]] for part in rest] == [["t4"], []]   # rank 1: an empty pass
    t = Dealer(world=1, micro_batch=64, max_tokens=30)
    assert t.add([s(10, 0), s(10, 1)], [0, 0]) == []                         # 2 x 10 fits 30
    [micro] = t.add([s(10, 2), s(12, 3)], [0, 0])                            # 4 x 12 would not
    assert [x.task_id for x in micro[0][0]] == ["t0", "t1", "t2"]
    assert [[x.task_id for x in m[0][0]] for m in t.flush()] == [["t3"]]


def _fsdp_stream_worker(rank, world, port, model_dir, groups, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tr = Trainer(model_dir, TrainConfig(loss="ppo", lr=1e-3, micro_batch=1), dist.group.WORLD)
    grad, dealer = GradStream(tr), Dealer(world, 1)        # every rank deals alike; each runs its share
    grad.begin(0)
    for g in groups:
        for parts in dealer.add(g, group_advantages(torch.tensor([x.reward for x in g]), len(g)).tolist()):
            grad.micro(*parts[rank])
    for parts in dealer.flush():
        grad.micro(*parts[rank])
    grad.step()
    named = tr.full_state()
    if rank == 0:
        torch.save(dict(named), out)
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_streamed_step_is_the_batch_token_mean_over_ranks(tiny_model_dir, tmp_path):
    """Two FSDP ranks, 3 groups of 3 dealt one sample per rank per pass: rank 0 gets the long responses and
    the last pass alone (rank 1 runs an empty one beside it). The step normalises by the tokens of both
    ranks, so the weights equal one process's whole-batch step (its token-mean over the batch)."""
    groups = groups_of(tiny_model_dir, [14, 2, 12, 1, 9, 3, 11, 2, 7], G=3)
    flat = [x for g in groups for x in g]
    single = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3))
    single.train_step(flat, group_advantages(torch.tensor([x.reward for x in flat]), 3).tolist())
    ref = dict(single.full_state())
    out = tmp_path / "stream.pt"
    mp.spawn(_fsdp_stream_worker, args=(2, free_port(), str(tiny_model_dir), groups, str(out)), nprocs=2)
    got = torch.load(out)
    # AdamW's first step moves each weight by about lr * sign(gradient), whatever the gradient's scale: a
    # wrong weighting of the ranks' tokens flips signs and shows as differences of ~lr (1e-3). Coordinates
    # whose gradient is near Adam's eps move by a rounding-dependent fraction of lr: 1.4e-5 seen with this
    # machine's tiny model (the float32 order of the micro-batches' sums differs), hence lr / 10
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-4


class DefaultElsewhere(types.ModuleType):
    """torch, except that a tensor made without naming a device lands on "meta": on a GPU trainer the
    default device (the CPU) is not the trainer's either."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **{"device": "meta", **kwargs})


def test_trainer_group_collectives_get_tensors_on_the_trainers_device(tiny_model_dir, monkeypatch):
    """NCCL takes only tensors on its GPU (gloo takes CPU tensors too, so no gloo run can tell). One rank
    posing as one of several FSDP ranks, over a stand-in trainer group whose collectives check their tensor's
    device (one rank: a no-op is the reduction), with stream.py's and trainer.py's tensors made without a
    device landing elsewhere: the whole-batch step's and the streamed step's collectives each get a tensor
    on the trainer's device."""
    tr = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3, micro_batch=2))
    trainer_group, seen = object(), []

    def checked(name):
        def collective(tensor, *args, group=None, **kwargs):
            if group is trainer_group:
                assert tensor.device == tr.device, f"{name}, trainer group: a tensor on {tensor.device}"
                seen.append(name)
        return collective
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, checked(name))
    for module in (stream, trainer):
        monkeypatch.setattr(module, "torch", DefaultElsewhere("torch"))
    tr.fsdp, tr.trainer_group = True, trainer_group
    samples, adv = make_samples(tiny_model_dir, n=4), [1.0, -1.0, 1.0, -1.0]
    tr.train_step(samples, adv, version=0)               # the plan's micro-batch counts
    grad = GradStream(tr)
    grad.begin(0)
    grad.micro(samples, adv)
    grad.step()                                          # the batch's token count
    assert seen == ["all_reduce"] * 3 and tr.num_steps == 2       # (plan: counts, totals; stream: den)


def _exact_worker(rank, world, port, model_dir, samples, adv, kw, out):
    """One of `world` FSDP ranks: the gradient of its shard of the whole batch (train_step), then of the same
    batch streamed (GradStream, dealt round-robin). The optimizer step is replaced by a gather of the full
    gradient (a collective: every rank runs it)."""
    from datetime import timedelta
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    tr = Trainer(model_dir, TrainConfig(**kw), dist.group.WORLD)
    seen: dict = {}
    tr.opt.step = lambda: seen.update({n: p.grad.full_tensor().clone() for n, p in tr.model.named_parameters()
                                       if p.grad is not None})
    tr.train_step(samples[rank::world], adv[rank::world], version=0)
    whole = dict(seen)
    seen.clear()
    grad, dealer = GradStream(tr), Dealer(world, kw["micro_batch"])
    grad.begin(0)
    for parts in dealer.add(samples, adv) + dealer.flush():
        grad.micro(*parts[rank])
    grad.step()
    if rank == 0:
        torch.save({"whole": whole, "streamed": dict(seen)}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_two_fsdp_ranks_with_unequal_tokens_give_the_one_process_gradient(tiny_model_dir, tmp_path, agg):
    """5 samples over 2 FSDP ranks, whole batch (rank 0: samples 0, 2, 4, 35 response tokens; rank 1: 1, 3,
    3 tokens) and streamed (dealt 2 per pass): the gradient the optimizer step sees equals one process's on
    the whole batch within GRAD_TOL, in every --loss-agg mode: each rank's micro-batches are weighed by the
    whole batch's tokens (or sequences) over all ranks, not by its own (which would give rank 1's 3 tokens
    the weight of rank 0's 35)."""
    samples = [s for i, n in enumerate([14, 2, 12, 1, 9])
               for s in make_samples(tiny_model_dir, n=1, resp_len=n, seed=i)]
    adv = [0.05, -0.05, 0.025, -0.035, 0.04]      # small: the gradient and float32's rounding scale with them
    kw = dict(loss="ppo", loss_agg=agg, micro_batch=2, grad_clip=1e9)
    one = Trainer(str(tiny_model_dir), TrainConfig(**kw))
    ref = capture_step(one)
    one.train_step(samples, adv, version=0)
    assert max(v.abs().max().item() for v in ref.values()) > REAL_GRAD            # a real gradient
    out = tmp_path / "grads.pt"
    mp.spawn(_exact_worker, args=(2, free_port(), str(tiny_model_dir), samples, adv, kw, str(out)), nprocs=2)
    got = torch.load(out)
    for path in ("whole", "streamed"):
        assert set(got[path]) == set(ref)
        diff = max((got[path][n] - ref[n]).abs().max().item() for n in ref)
        assert diff < GRAD_TOL, (path, agg, diff, max(v.abs().max().item() for v in ref.values()))
