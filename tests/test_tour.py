"""docs/tour.md's "Watch it happen" recipes, as a student types them: under pdb, the one-process run at async
ratio 0 with a slow heavy-tailed env stops at a sample dropped as stale at the assembler and at a weight sync
that aborts running work that can no longer be fresh; at the default ratio, at a finished sample whose tokens
crossed a sync (two versions) and is still fresh."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# each breakpoint prints what the tour prints at it, once, and goes on (the stops may come in either order)
COMMANDS = """import env_manager, buffer
break buffer.GroupAssembler.add, not s.failed and not self._fresh(s, version)
commands 1
p "STALE", s.task_id, s.versions, s.oldest_version, version
disable 1
continue
end
break env_manager.EnvManager._abort, counter == "aborted_stale" and len(task_ids) > 0
commands 2
p "ABORT", task_ids, self.proxy.version, [t.versions for t in self.trajs.get(task_ids[0], {}).values()]
disable 2
continue
end
continue
quit
"""


def test_the_tour_shows_a_sample_dropped_and_work_aborted_as_stale(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items()                        # (not under torchrun: one process)
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "pdb", "train.py", "--steps", "4", "--async-ratio", "0",
                        "--env-latency-s", "0.1", "--env-latency-sigma", "1", "--out-dir",
                        str(tmp_path / "stale"), "--save-every", "0"],
                       cwd=ROOT, input=COMMANDS, capture_output=True, text=True, timeout=600, env=env)
    out = r.stdout
    stale = re.search(r"\('STALE', '(g\d+\.\d+)', \[([\d, ]*)\], (\d+), (\d+)\)", out)
    assert stale, out[-3000:]
    versions, oldest, version = [int(v) for v in stale[2].split(", ") if v], int(stale[3]), int(stale[4])
    assert oldest == min(versions) < version, stale[0]           # its oldest token: older than the ratio's 0
    abort = re.search(r"\('ABORT', \[('g\d+\.\d+'(, )?)+\], (\d+), (\[.*\])\)", out)
    assert abort, out[-3000:]
    assert "The program finished" in out, out[-2000:]             # (both printed once; the run went on)


def test_the_tour_shows_a_sample_whose_tokens_crossed_a_sync(tmp_path, tiny_model_dir):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    commands = ("import buffer\nbreak buffer.GroupAssembler.add, len(set(s.versions)) > 1\ncontinue\n"
                "p 'CROSSED', s.task_id, s.versions, s.oldest_version, version, self._fresh(s, version)\n"
                "quit\n")
    r = subprocess.run([sys.executable, "-m", "pdb", "train.py", "--steps", "10", "--out-dir",
                        str(tmp_path / "cross"), "--save-every", "0"],
                       cwd=ROOT, input=commands, capture_output=True, text=True, timeout=600, env=env)
    got = re.search(r"\('CROSSED', 'g\d+\.\d+', \[([\d, ]*)\], (\d+), (\d+), (True|False)\)", r.stdout)
    assert got, r.stdout[-3000:]
    versions = [int(v) for v in got[1].split(", ")]
    assert len(set(versions)) == 2 and versions == sorted(versions) and int(got[2]) == versions[0]
    assert int(got[3]) - versions[0] <= 2 and got[4] == "True"    # within the default ratio: still fresh
