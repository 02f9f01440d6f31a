"""ext/distill.py, on-policy distillation: the per-token advantage against a hand computation, a sample's
teacher log-probs placed on its model tokens, the teacher's log-probs from a real engine against transformers,
the direction one real train step moves the student, the bad inputs, and a torchrun run with a teacher rank
(every trained sample scored by it, the reverse KL to the teacher falling). How far and how fast against RL,
at which async ratio: tools/distill_study.py."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffer import LocalQueues, Sample
from ext.distill import NAME, DistillConfig, DistillParams, TeacherClient, distill, teacher_kl
from losses import ADV_SHAPERS, Fields
from rollout import EnvFailure

ROOT = Path(__file__).resolve().parent.parent


def test_the_per_token_advantage_is_the_reward_advantage_plus_the_teachers_gap():
    """A_t = A + coef x (log pi_teacher - log mu) on the model tokens (the mask), the sample's A elsewhere;
    coef 0 leaves the advantages as they are."""
    mask = torch.tensor([[0., 1., 1., 0.], [0., 0., 1., 1.]])
    old = torch.tensor([[0., -1., -2., 0.], [0., 0., -0.5, -3.]]) * mask
    teacher = torch.tensor([[0., -0.5, -4., 0.], [0., 0., -0.5, -1.]]) * mask
    mb = {"adv": torch.tensor([1.0, -2.0]), "old_logp": old, "mask": mask,
          "fields": Fields({"teacher_logp": teacher}, mask)}
    got = distill(mb, DistillParams(distill_coef=0.5))
    want = torch.tensor([[1.0, 1.0 + 0.5 * 0.5, 1.0 + 0.5 * -2.0, 1.0],
                         [-2.0, -2.0, -2.0 + 0.0, -2.0 + 0.5 * 2.0]])
    assert torch.allclose(got, want)
    assert distill(mb, DistillParams(distill_coef=0.0)) is mb["adv"] and distill(mb, None) is mb["adv"]
    assert ADV_SHAPERS["distill"] is distill


def test_one_train_step_moves_the_students_logprobs_toward_the_teachers(tiny_model_dir):
    """Through the real trainer, reward advantages 0: the tokens the teacher likes more than the behaviour
    policy did (log pi_teacher > log mu) gain log-prob, those it likes less lose it; --distill-coef 0
    leaves nothing to learn (no gradient)."""
    from model import collate, token_logprobs
    from tests.test_trainer import make_samples
    from trainer import Trainer, TrainConfig
    samples = make_samples(tiny_model_dir)
    for i, s in enumerate(samples):               # samples 0 and 2: the teacher likes them 1 nat more
        s.token_fields["teacher_logp"] = [lp + (1.0 if i % 2 == 0 else -1.0) for lp in s.logprobs]
    t = collate(samples, "cpu")

    def step(coef):
        tr = Trainer(str(tiny_model_dir), TrainConfig(loss="ppo", lr=1e-3, warmup_steps=0))
        tr.cfg.hparams["distill"] = DistillParams(distill_coef=coef)
        with torch.no_grad():
            before = (token_logprobs(tr.model, t["input_ids"], t["attn"]) * t["mask"]).sum(1)
        m = tr.train_step(samples, [0.0] * len(samples))
        with torch.no_grad():
            after = (token_logprobs(tr.model, t["input_ids"], t["attn"]) * t["mask"]).sum(1)
        return (after - before).tolist(), m
    delta, m = step(1.0)
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0 and m["grad_norm"] > 0
    assert step(0.0)[1]["grad_norm"] == 0


def answer_with(client_queues: LocalQueues, logprobs_of):
    """A teacher rank's part, in process: answer every request on its rank's queue with logprobs_of(ids)."""
    async def serve():
        requests = client_queues.named(NAME)
        while True:
            for rank, rid, op, ids, _ in requests.get_many(64):
                assert op == "score"
                client_queues.named(f"{NAME}{rank}").put_many([(rid, logprobs_of(ids))])
            await asyncio.sleep(0.001)
    return serve


def test_a_samples_teacher_logprobs_land_on_its_model_tokens_and_feed_teacher_kl():
    """A multi-turn sample (model tokens, then an observation, then model tokens): the teacher's log-prob of
    each token after the first comes back; the sample keeps those of its model tokens, in order; teacher_kl
    is the mean of log mu - log pi_teacher over them. A sample longer than the teacher's context fails."""
    q = LocalQueues(1)
    q.named(f"{NAME}_ready0").put_many([(0, 12)])             # one teacher rank, a 12-token context

    async def main():
        client = TeacherClient(q, 0, timeout_s=5, startup_s=5, num_teachers=1)
        server = asyncio.create_task(answer_with(q, lambda ids: [-float(t) for t in ids[1:]])())
        s = Sample("t", "g", [7, 8], [1, 2, 9, 3], [-0.1, -0.2, 0.0, -0.3], [1, 1, 0, 1], [0, 0, 0], 1.0)
        await client(s)
        long = Sample("u", "g", [1] * 10, [2, 3, 4], [0.0] * 3, [1] * 3, [0] * 3, 0.0)
        with pytest.raises(EnvFailure, match="13 tokens exceed the teacher's context \\(12\\)"):
            await client(long)
        server.cancel()
        return s
    s = asyncio.run(main())
    assert s.token_fields["teacher_logp"] == [-1.0, -2.0, -3.0] and s.meta["teacher_s"] >= 0
    assert teacher_kl([s])["teacher_kl"] == pytest.approx(((-0.1 + 1) + (-0.2 + 2) + (-0.3 + 3)) / 3)


def test_a_teacher_that_does_not_answer_fails_the_sample_in_bounded_time():
    q = LocalQueues(1)
    q.named(f"{NAME}_ready0").put_many([(0, 128)])

    async def main():
        client = TeacherClient(q, 0, timeout_s=0.2, startup_s=5, num_teachers=1)
        with pytest.raises(EnvFailure, match="no answer within 0s.*--teacher-timeout-s"):
            await client(Sample("t", "g", [1], [2], [0.0], [1], [0], 1.0))
    asyncio.run(main())


@pytest.mark.engine
def test_the_teachers_logprobs_from_a_real_engine_match_transformers(vllm_proxy, hf):
    """What a teacher rank answers (its engine's prompt log-probs, temperature 1) against transformers' own
    log-probs of the same sequence, within 1e-4."""
    lt, proxy = vllm_proxy
    model, tok = hf
    ids = tok.encode("37+485=522") + [tok.eos_token_id]
    got = lt.run(proxy.score(ids))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert len(got) == len(ids) - 1 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # a teacher rank scores many samples at once: each answer is its own (request ids are unique)
    seqs = [tok.encode(f"{a}+{a}={2 * a}") + [tok.eos_token_id] for a in range(40)]

    async def together():
        return await asyncio.gather(*[proxy.score(x) for x in seqs])
    at_once = lt.run(together())
    assert all(len(r) == len(x) - 1 for r, x in zip(at_once, seqs))
    alone = [lt.run(proxy.score(x)) for x in seqs[:3]]
    assert max(abs(a - b) for r, s in zip(at_once, alone) for a, b in zip(r, s)) < 1e-5


def test_bad_teacher_flags_are_named(tmp_path, tiny_model_dir, chat_model):
    """--teacher without --teacher-gpus (and the reverse), a teacher dir that is not a model, --reward none
    with dynamic filtering, a teacher with another vocabulary: each refused at start-up, naming it."""
    from config import parse_cli
    from ext.distill import Distill
    from train import Config
    with pytest.raises(ValueError, match="--teacher-gpus 0: a teacher needs ranks"):
        DistillConfig(teacher=str(tiny_model_dir))
    with pytest.raises(ValueError, match="--teacher \\(none\\) and --teacher-gpus 1"):
        DistillConfig(teacher_gpus=1)

    def refused(*args):
        r = subprocess.run([sys.executable, "train.py", *args, "--print-world-size"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        return r.stderr
    assert "not a Hugging Face model dir" in refused("--teacher", str(tmp_path), "--teacher-gpus", "1")
    assert "--no-filter-groups" in refused("--teacher", str(tiny_model_dir), "--teacher-gpus", "1",
                                          "--reward", "none")
    other = str(chat_model["dir"])                   # (a byte-level BPE tokenizer: not the tiny model's)
    cfg = parse_cli(Config, ["--teacher", other, "--teacher-gpus", "1"])
    with pytest.raises(SystemExit, match=f"--teacher {other}: its vocabulary .* not the student's"):
        Distill(cfg, cfg.ext["distill"]).startup_lines(str(tiny_model_dir), "cpu")
    assert parse_cli(Config, ["--teacher", str(tiny_model_dir), "--teacher-gpus", "2"]) is not None
    r = subprocess.run([sys.executable, "train.py", "--teacher", str(tiny_model_dir), "--teacher-gpus", "2",
                        "--print-world-size"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "4"                     # 1 trainer + 1 rollout + 2 teachers: run.sh's count


@pytest.fixture(scope="session")
def distill_teacher() -> Path:
    """A teacher unlike the student (another seed, a shorter warm start: cheap to build, cached): what the
    student's teacher_kl can fall towards."""
    import tiny_model
    return tiny_model.ensure_tiny_model(ROOT / ".cache" / "tiny-teacher-test",
                                        tiny_model.TinyConfig(seed=2, sft_steps=300), log=lambda *a: None)


@pytest.mark.engine
def test_distillation_alone_under_torchrun_lowers_the_students_kl_to_its_teacher(tmp_path, tiny_model_dir,
                                                                                 distill_teacher):
    """3 ranks (trainer, rollout, teacher), --reward none: the student learns from the teacher's per-token
    log-probs alone. Every trained sample carried the teacher's scores (none failed), teacher_kl and
    time_teacher are recorded each step, and the reverse KL to the teacher falls: the last 4 steps' mean
    below 90% of the first 4 steps' (256 samples a step; one step's KL varies by about 0.1 around a mean
    that falls from about 0.75 to 0.45 over these 14 steps)."""
    from tools.jobs import run_to_end, torchrun_cmd
    out = tmp_path / "distill"
    cmd = torchrun_cmd("--out-dir", str(out), "--steps", "14", "--timeout-s", "300",
                       "--teacher", str(distill_teacher), "--teacher-gpus", "1", "--distill-coef", "1",
                       "--reward", "none", "--no-filter-groups", "--save-every", "0")
    cmd[cmd.index("--nproc-per-node") + 1] = "3"
    rows = run_to_end(cmd, out, "test_distill", timeout_s=900)
    kl = [r["teacher_kl"] for r in rows]
    assert len(kl) == 14 and all(r["num_samples"] == 256 and r["samples_failed"] == 0 for r in rows), rows
    assert all(0 < k < 20 for k in kl), kl               # (the student's own engine and the teacher's differ)
    assert sum(kl[-4:]) < 0.9 * sum(kl[:4]), kl
    log = out.with_suffix(".log").read_text()
    assert "teacher_kl" in log and all(r["time_teacher"] > 0 for r in rows)
    assert "3 ranks = 1 trainer + 1 rollout + 1 model server," in log     # the start line names every rank
    assert json.loads((out / "rollout_stats.json").read_text())


@pytest.mark.engine
def test_distill_study_writes_its_three_tables(tmp_path, tiny_model_dir, distill_teacher):
    """tools/distill_study.py at tiny settings (2 steps a run, one seed, ratios 2 and 0): every kind's runs,
    the held-out reward of the teacher and the student, the teacher's scoring time, and the three tables."""
    from toolrun import run_tool
    out = tmp_path / "distill"
    printed = run_tool("tools.distill_study", [
        "--ratios", "2,0", "--seeds", "0", "--steps", "2", "--batch-groups", "4", "--eval-every", "2",
        "--eval-prompts", "8", "--teacher", str(distill_teacher), "--runs-dir", str(tmp_path / "runs"),
        "--out", str(out)])
    res = json.loads(out.with_suffix(".json").read_text())
    assert [(r["kind"], r["ratio"]) for r in res["runs"]] == [("rl", 2), ("distill", 2), ("both", 2),
                                                               ("distill", 0)]
    assert all(r["evals"] and r["evals"][-1][0] == 2 for r in res["runs"])          # the final weights'
    assert all(len([k for k in r["teacher_kl"] if k is not None]) == 2 for r in res["runs"][1:])
    assert 0 <= res["student_held_out"] <= 1 and 0 <= res["teacher_held_out"] <= 1 and res["score_s"] > 0
    md = out.with_suffix(".md").read_text()
    assert md in printed and all(f"### {i}." in md for i in (1, 2, 3)) and out.with_suffix(".png").exists()
