"""ext/distill.py, on-policy distillation: the per-token advantage against a hand computation (and its
clip with a reward), a sample's teacher log-probs placed on its model tokens, scored at the student's
temperature, held-out samples scored for eval_teacher_kl, the teacher's log-probs from a real engine against
transformers at temperature 1 and 0.7, the direction one real train step moves the student, the bad inputs (a
teacher whose context cannot hold the longest request among them), and a torchrun run with a teacher rank
(every trained sample scored by it, the reverse KL to the teacher falling, eval_teacher_kl recorded) whose
files also answer tools/distill_study.py's jobs. How far and how fast against RL, at which async ratio:
tools/distill_study.py."""

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from buffer import LocalQueues, Sample
from ext.distill import NAME, DistillConfig, DistillParams, TeacherClient, distill, teacher_kl
from ext.eval import Evaluation
from losses import ADV_SHAPERS, Fields
from rollout import EnvFailure

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.fast
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


def model_dir_stub(path: Path, context: int = 128) -> Path:
    """A dir that --teacher's flag checks take for a model (a config.json with its context), nothing else."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    return path


@pytest.mark.fast
def test_with_a_reward_the_teachers_gap_is_clipped_so_the_coefficient_weighs_it_against_the_reward(tmp_path):
    """A right answer (group-normalised advantage +1) with a token the teacher rules out (a gap of -20 nats)
    and one it likes (+0.5): unclipped, --distill-coef 0.5 turns the first token's advantage to -9, the
    teacher's term deciding its sign; clipped at 1 nat (--distill-clip's auto with a reward), it keeps +0.5,
    the reward's advantage less coef x 1. The auto resolves by the reward: 1 with the verifier's, never (0)
    with --reward none; a value given stays; a negative other than -1 is refused by name."""
    from config import parse_cli
    from train import Config
    mask = torch.tensor([[0., 1., 1.]])
    old = torch.tensor([[0., -0.5, -2.0]])
    mb = {"adv": torch.tensor([1.0]), "old_logp": old, "mask": mask,
          "fields": Fields({"teacher_logp": torch.tensor([[0., -20.5, -1.5]])}, mask)}
    assert distill(mb, DistillParams(distill_coef=0.5, distill_clip=0)).tolist() == [[1.0, -9.0, 1.25]]
    assert distill(mb, DistillParams(distill_coef=0.5, distill_clip=1)).tolist() == [[1.0, 0.5, 1.25]]
    teacher = ["--teacher", str(model_dir_stub(tmp_path / "t")), "--teacher-gpus", "1",
               "--distill-coef", "0.5"]

    def clip(*flags):
        return parse_cli(Config, [*teacher, *flags]).train.hparams["distill"].distill_clip
    assert clip() == 1.0 and clip("--reward", "none", "--no-filter-groups") == 0.0
    assert clip("--distill-clip", "3") == 3.0 and clip("--distill-clip", "0") == 0.0
    with pytest.raises(ValueError, match="--distill-clip must be >= 0, or -1"):
        DistillParams(distill_clip=-0.5)


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
    """A teacher rank's part, in process: answer every request on its rank's queue with logprobs_of(ids,
    temperature) (the request's argument: None for 1)."""
    async def serve():
        requests = client_queues.named(NAME)
        while True:
            for rank, rid, op, ids, arg in requests.get_many(64):
                assert op == "score"
                client_queues.named(f"{NAME}{rank}").put_many([(rid, logprobs_of(ids, arg))])
            await asyncio.sleep(0.001)
    return serve


@pytest.mark.fast
def test_a_samples_teacher_logprobs_land_on_its_model_tokens_and_feed_teacher_kl():
    """A multi-turn sample (model tokens, then an observation, then model tokens): the teacher's log-prob of
    each token after the first comes back; the sample keeps those of its model tokens, in order; teacher_kl
    is the mean of log mu - log pi_teacher over them. A sample longer than the teacher's context fails."""
    q = LocalQueues(1)
    q.named(f"{NAME}_ready0").put_many([(0, 12)])             # one teacher rank, a 12-token context

    async def main():
        client = TeacherClient(q, 0, timeout_s=5, startup_s=5, num_teachers=1)
        server = asyncio.create_task(answer_with(q, lambda ids, _: [-float(t) for t in ids[1:]])())
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


@pytest.mark.fast
def test_a_teacher_that_does_not_answer_fails_the_sample_in_bounded_time():
    q = LocalQueues(1)
    q.named(f"{NAME}_ready0").put_many([(0, 128)])

    async def main():
        client = TeacherClient(q, 0, timeout_s=0.2, startup_s=5, num_teachers=1)
        with pytest.raises(EnvFailure, match="no answer within 0s.*--teacher-timeout-s"):
            await client(Sample("t", "g", [1], [2], [0.0], [1], [0], 1.0))
    asyncio.run(main())


def teacher_config(tmp_path, *flags):
    """train.py's Config with a teacher (a stub model dir) and these flags."""
    from config import parse_cli
    from train import Config
    return parse_cli(Config, ["--teacher", str(model_dir_stub(tmp_path / "teacher")), "--teacher-gpus", "1",
                              *flags])


@pytest.mark.fast
def test_the_teacher_scores_at_the_students_temperature_and_held_out_samples_at_theirs(tmp_path):
    """--temperature 0.7: a trained sample asks the teacher for its log-probs at 0.7, the temperature of the
    student's own (mu); a held-out sample (evaluation's, sampled at temperature 1) at 1 (None on the wire),
    its greedy sample not at all; a held-out sample the teacher cannot score (longer than its context) keeps
    its reward, the failure noted, where a trained one would fail."""
    from types import SimpleNamespace

    from ext.distill import Distill
    q = LocalQueues(1)
    q.named(f"{NAME}_ready0").put_many([(0, 12)])             # one teacher rank, a 12-token context
    asked = []

    def logprobs_of(ids, temperature):
        asked.append(temperature)
        return [-1.0] * (len(ids) - 1)
    cfg = teacher_config(tmp_path, "--temperature", "0.7")
    finish = Distill(cfg, cfg.ext["distill"]).sample_finisher(0, SimpleNamespace(transport=q))
    trained = Sample("t", "g", [7, 8], [1, 2], [-0.1, -0.2], [1, 1], [0, 0], 1.0)
    held = [Sample(f"eval3.0.{name}", "eval3.0", [7, 8], [1, 2], [-0.1, -0.2], [1, 1], [0, 0], 1.0,
                   meta={"eval": True}) for name in ("t0", "greedy")]
    long = Sample("eval3.1.t1", "eval3.1", [1] * 10, [2, 3, 4], [0.0] * 3, [1] * 3, [0] * 3, 1.0,
                  meta={"eval": True})

    async def main():
        server = asyncio.create_task(answer_with(q, logprobs_of)())
        for s in (trained, *held, long):
            await finish(s)
        server.cancel()
    asyncio.run(main())
    assert asked == [0.7, None]
    assert trained.token_fields["teacher_logp"] == held[0].token_fields["teacher_logp"] == [-1.0, -1.0]
    assert "teacher_logp" not in held[1].token_fields and "teacher_logp" not in long.token_fields
    assert "13 tokens exceed the teacher's context (12)" in long.meta["teacher_error"] and long.reward == 1.0


@pytest.mark.fast
def test_an_evaluation_round_reports_the_held_out_reverse_kl_to_the_teacher():
    """An evaluation round (ext/eval.py) whose sampled held-out samples carry the teacher's log-probs: beside
    its accuracy, eval_teacher_kl, the mean of log mu - log pi_teacher over the model tokens of the samples
    the teacher scored (a multi-turn one's observation left out; the greedy sample and a failed one not
    scored); the step line shows it as the held-out teacher_kl, the evaluation's own part the accuracy."""
    from types import SimpleNamespace

    import task
    from ext.distill import Distill
    from ext.eval import Eval

    async def put_tasks(tasks):
        pass
    ctrl = SimpleNamespace(taps=[], version=4, buffer=SimpleNamespace(put_tasks=put_tasks))
    ev = Evaluation(ctrl)
    greedy = Sample("eval4.0.greedy", "eval4.0", [7], [1, 2], [0.0, 0.0], [1, 1], [4, 4], 1.0,
                    meta={"eval": True})
    t0 = Sample("eval4.0.t0", "eval4.0", [7], [1, 2], [-0.1, -0.2], [1, 1], [4, 4], 1.0, meta={"eval": True},
                token_fields={"teacher_logp": [-1.1, -0.7]})                       # gaps 1.0, 0.5
    t1 = Sample("eval4.0.t1", "eval4.0", [7], [3, 9, 4], [-0.3, 0.0, -0.4], [1, 0, 1], [4, 4], 0.0,
                meta={"eval": True}, token_fields={"teacher_logp": [-0.3, -2.4]})  # gaps 0.0, 2.0
    t2 = Sample("eval4.0.t2", "eval4.0", [7], [], [], [], [], 0.0, failed=True, meta={"eval": True})

    async def main():
        await ev.start(task.make_problems(1, seed=0), 3)
        assert all([await ev.tap(s) for s in (greedy, t0, t1, t2)])
        return ev.result()
    row = asyncio.run(main())
    assert row["eval_version"] == 4 and row["eval_greedy"] == 1.0
    assert row["eval_mean_at_3"] == pytest.approx(1 / 3)
    assert row["eval_teacher_kl"] == pytest.approx((1.0 + 0.5 + 0.0 + 2.0) / 4)
    line = Distill(None, None).step_line({**row, "teacher_kl": 1.5})
    assert line == "teacher_kl 1.500 held-out teacher_kl 0.875"
    assert Eval(None, None).step_line(row) == "greedy 1.000 | mean@3 0.333"


@pytest.mark.engine
def test_the_teachers_logprobs_from_a_real_engine_match_transformers(vllm_proxy, hf):
    """What a teacher rank answers (its engine's prompt log-probs, temperature 1) against transformers' own
    log-probs of the same sequence, within 1e-4."""
    from ext.served import answer_request
    lt, proxy = vllm_proxy
    model, tok = hf
    ids = tok.encode("37+485=522") + [tok.eos_token_id]
    got = lt.run(proxy.score(ids))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()

    def want_at(temperature):
        logp = torch.log_softmax(logits / temperature, -1)
        return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    want = want_at(1.0)
    assert len(got) == len(ids) - 1 and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # a teacher rank's answer at temperature 1 (None) and at the student's 0.7: log softmax(logits / 0.7)
    for temperature in (None, 0.7):
        answer = lt.run(answer_request(proxy, "score", ids, temperature, 128, "r", "teacher rank 0"))
        assert max(abs(a - b) for a, b in zip(answer, want_at(temperature or 1.0))) < 1e-4, answer
    assert max(abs(a - b) for a, b in zip(want_at(0.7), want)) > 0.1       # (0.7 is another distribution)
    # a teacher rank scores many samples at once: each answer is its own (request ids are unique)
    seqs = [tok.encode(f"{a}+{a}={2 * a}") + [tok.eos_token_id] for a in range(40)]

    async def together():
        return await asyncio.gather(*[proxy.score(x) for x in seqs])
    at_once = lt.run(together())
    assert all(len(r) == len(x) - 1 for r, x in zip(at_once, seqs))
    alone = [lt.run(proxy.score(x)) for x in seqs[:3]]
    assert max(abs(a - b) for r, s in zip(at_once, alone) for a, b in zip(r, s)) < 1e-5


def test_bad_teacher_flags_are_named(tmp_path, tiny_model_dir, chat_model, capsys):
    """--teacher without --teacher-gpus (and the reverse), a teacher dir that is not a model (the embedded
    teacher's: with its build command), --reward none with dynamic filtering, a teacher with another
    vocabulary: each refused at start-up, naming it."""
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
    with pytest.raises(SystemExit):          # (the embedded teacher's dir, unbuilt: its build command named)
        parse_cli(Config, ["--teacher", str(tmp_path / "tiny-teacher"), "--teacher-gpus", "1"])
    assert "python -m ext.distill --build builds it" in capsys.readouterr().err
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


def test_a_teacher_whose_context_cannot_hold_the_longest_request_is_refused(tmp_path, tiny_model_dir):
    """At start-up (rank 0's startup_lines): a teacher of the student's tokenizer with a 12-token context
    (config.json's max_position_embeddings) against the default task's longest prompt (8 tokens: "999+999=",
    over 1,000 drawn problems) plus --max-tokens 8 is refused, naming --teacher, its context and the
    request's length; a 16-token context holds it, and so does 12 with --max-tokens 4 or the student capped by
    --max-model-len 12; under a multi-turn --env the student's whole context (128) is the bound."""
    import shutil

    from config import parse_cli
    from ext.distill import Distill
    from train import Config

    def startup(context: int, *flags):
        teacher = tmp_path / f"teacher{context}"
        if not teacher.exists():
            shutil.copytree(tiny_model_dir, teacher)
            config = json.loads((teacher / "config.json").read_text())
            (teacher / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
        cfg = parse_cli(Config, ["--teacher", str(teacher), "--teacher-gpus", "1", *flags])
        cfg = dataclasses.replace(cfg, rollout=cfg.rollout.resolved(str(tiny_model_dir), "cpu", True))
        return Distill(cfg, cfg.ext["distill"]).startup_lines(str(tiny_model_dir), "cpu")
    with pytest.raises(SystemExit, match=r"--teacher .*teacher12: its context \(12 tokens\) cannot hold the "
                                         r"longest sequence the student can send it, 16 tokens \(the longest "
                                         r"prompt of 1000 drawn problems, 8 tokens, \+ --max-tokens 8\)"):
        startup(12)
    assert "context 16" in startup(16)
    assert "context 12" in startup(12, "--max-tokens", "4")
    assert "context 12" in startup(12, "--max-model-len", "12")
    with pytest.raises(SystemExit, match=r"its context \(16 tokens\) .* 128 tokens \(the student's context "
                                         r"\(--env guess: a trajectory may fill it\)\)"):
        startup(16, "--env", "guess")


@pytest.fixture(scope="session")
def distill_teacher() -> Path:
    """conftest.build_test_teacher's model (built in the background from collection on)."""
    from conftest import build_test_teacher, wait_for_build
    wait_for_build("distill_teacher")
    return build_test_teacher()


STEPS, EVAL_EVERY = 14, 7


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory, tiny_model_dir, distill_teacher) -> tuple[Path, list[dict]]:
    """(out_dir, metrics.jsonl's rows) of one real run: 3 ranks (trainer, rollout, teacher: real vLLM
    engines), --reward none (distillation alone), 14 steps, a held-out evaluation every 7 (8 problems, k
    2)."""
    from tools.jobs import run_to_end, torchrun_cmd
    out = tmp_path_factory.mktemp("distill") / "run"
    cmd = torchrun_cmd("--out-dir", str(out), "--steps", str(STEPS), "--timeout-s", "300",
                       "--teacher", str(distill_teacher), "--teacher-gpus", "1", "--distill-coef", "1",
                       "--reward", "none", "--no-filter-groups", "--save-every", "0",
                       "--eval-every", str(EVAL_EVERY), "--eval-prompts", "8", "--eval-k", "2")
    cmd[cmd.index("--nproc-per-node") + 1] = "3"
    return out, run_to_end(cmd, out, "test_distill", timeout_s=900)


@pytest.mark.engine
def test_distillation_alone_under_torchrun_lowers_the_students_kl_to_its_teacher(distill_run):
    """3 ranks (trainer, rollout, teacher), --reward none: the student learns from the teacher's per-token
    log-probs alone. Every trained sample carried the teacher's scores (none failed), teacher_kl and
    time_teacher are recorded each step, and the reverse KL to the teacher falls: the last 4 steps' mean
    below 90% of the first 4 steps' (256 samples a step; one step's KL varies by about 0.1 around a mean
    that falls from about 0.75 to 0.45 over these 14 steps). Each evaluation's held-out samples were scored
    too: eval_teacher_kl in the rows of the versions evaluated (7 and the final 14) and in the step line."""
    out, rows = distill_run
    kl = [r["teacher_kl"] for r in rows]
    assert len(kl) == STEPS and all(r["num_samples"] == 256 and r["samples_failed"] == 0 for r in rows), rows
    assert all(0 < k < 20 for k in kl), kl               # (the student's own engine and the teacher's differ)
    assert sum(kl[-4:]) < 0.9 * sum(kl[:4]), kl
    held = [(r["eval_version"], r["eval_teacher_kl"]) for r in rows if "eval_teacher_kl" in r]
    assert [v for v, _ in held] == [EVAL_EVERY, STEPS] and all(0 < k < 20 for _, k in held), held
    log = out.with_suffix(".log").read_text()
    assert "teacher_kl" in log and "held-out teacher_kl" in log and all(r["time_teacher"] > 0 for r in rows)
    assert "3 ranks = 1 trainer + 1 rollout + 1 model server," in log     # the start line names every rank
    assert json.loads((out / "rollout_stats.json").read_text())


@pytest.mark.engine
def test_distill_study_writes_its_three_tables(tmp_path, monkeypatch, distill_run, vllm_proxy, tiny_model_dir,
                                               distill_teacher):
    """tools/distill_study.py at tiny settings (one seed, ratios 2 and 0), each of its train.py jobs answered
    with the real run's files (tests/test_tools_runs.py's pattern: the job's command parsed by train.py's own
    parser, its layout checked against torchrun's --nproc-per-node) and the teacher's scoring timed on the
    session's engine: every kind's job with its flags, the held-out reward of the teacher and the student and
    the student's held-out reverse KL to the teacher before training, the scoring time, and the tables."""
    import contextlib
    import io
    import shutil

    import tools.distill_study as study
    import tools.jobs
    from config import parse_cli
    from train import Config
    run_dir, launched = distill_run[0], []

    def run_to_end(cmd, out, who, timeout_s, cwd=ROOT, env=None):
        cfg = parse_cli(Config, cmd[cmd.index("train.py") + 1:])
        ranks = cfg.train_gpus + cfg.rollout_gpus + cfg.ext["distill"].teacher_gpus
        assert ranks == int(cmd[cmd.index("--nproc-per-node") + 1]) and Path(cfg.out_dir) == Path(out), cmd
        shutil.copytree(run_dir, out, dirs_exist_ok=True)
        launched.append(cfg)
        return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    monkeypatch.setattr(tools.jobs, "run_to_end", run_to_end)
    lt, proxy = vllm_proxy
    def score_time(teacher, n):              # (the study's own timing, on the session's engine)
        return lt.run(study.time_scoring(proxy, study.scored_samples(teacher, n)))
    monkeypatch.setattr(study, "score_time", score_time)
    out = tmp_path / "distill"
    monkeypatch.setattr(sys, "argv", [
        "tools.distill_study", "--ratios", "2,0", "--seeds", "0", "--steps", str(STEPS), "--batch-groups",
        "4", "--eval-every", str(EVAL_EVERY), "--eval-prompts", "8", "--teacher", str(distill_teacher),
        "--runs-dir", str(tmp_path / "runs"), "--out", str(out)])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        study.main()
    printed = printed.getvalue()
    kinds = [(c.ext["distill"].teacher != "", c.rollout.reward, c.controller.async_ratio) for c in launched]
    assert kinds == [(False, "", 2), (True, "none", 2), (True, "", 2), (True, "none", 0)]
    assert all(c.steps == STEPS and c.controller.batch_groups == 4 and c.ext["eval"].eval_every == EVAL_EVERY
               for c in launched)
    res = json.loads(out.with_suffix(".json").read_text())
    assert [(r["kind"], r["ratio"]) for r in res["runs"]] == [("rl", 2), ("distill", 2), ("both", 2),
                                                               ("distill", 0)]
    assert all(r["evals"] and r["evals"][-1][0] == STEPS for r in res["runs"])          # the final weights'
    assert all(len([k for k in r["teacher_kl"] if k is not None]) == STEPS for r in res["runs"][1:])
    assert all([v for v, _ in r["eval_kl"]] == [EVAL_EVERY, STEPS] for r in res["runs"][1:])
    assert 0 <= res["student_held_out"] <= 1 and 0 <= res["teacher_held_out"] <= 1 and res["score_s"] > 0
    assert 0 < res["kl_before"]["0"] < 20 and -1 < res["kl_before_wrong"]["0"] < 2     # (not the teacher)
    md = out.with_suffix(".md").read_text()
    assert md in printed and all(f"### {i}." in md for i in (1, 2, 3)) and out.with_suffix(".png").exists()
    assert "Held-out reverse KL to the teacher" in md and "of it on the tokens where its answer departs" in md
    assert "within 2" not in md
