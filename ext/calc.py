"""ext/calc.py: the tool environment (--env calc) and the sandbox its tool runs in.

    --env calc      the default task, but the model's first turn may be calc(EXPR): EXPR, written by the
                    model, runs in the sandbox and its value comes back as the next observation; the next
                    turn answers
    from ext.calc import SandboxLimits, run_python, arun_python, mechanism
    run_python("(17 + 25) * 3", mode="eval")      # SandboxResult(ok=True, output='126', kind='ok', ...)
    await arun_python("print(sum(range(10)))", SandboxLimits(wall_s=2))   # output '45\n'
    mechanism()                                   # "netns" here, else "socket-refusal"

--env calc's embedded model (CALC, CALC_DIR): the tiny model with a longer warm start in which half the
problems call the calculator and copy its value (tiny_model.py builds it; Extension.embedded_model), so RL
can raise the tool's use from there; its replies get 16 tokens (a calc(123+456) call is 13 and an <eos>).

The sandbox. kind: "ok", "error" (the code raised; error is its traceback), "timeout" (wall clock),
"killed" (a signal, e.g. the CPU limit's SIGKILL) or "refused" (a blocked import, socket, fork, kill, or
path). Layers: stage 1 (python -I -S) enters new user+net+pid namespaces where the kernel allows it, sets
the rlimits and execs stage 2, a fresh python -I -S whose audit hook refuses sockets, ctypes, fork/exec,
and files outside its temp dir; at wall_s the namespace is killed.

This is defence in depth, NOT a security boundary. Audit hooks are documented as unfit for sandboxing: a
determined attacker can patch the stdlib functions the hook calls, or open files relative to a dir fd.
The code runs as the caller's uid; for root the kernel does not enforce RLIMIT_NPROC (not even in a user
namespace), and what the hook does not see (os.stat, for one) still reaches the host's files. Untrusted
code at scale needs more around this: a container or a gVisor/Firecracker VM, a non-root user, cgroup
memory and pids limits, a read-only root filesystem, no network.
"""


import asyncio
import json
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
import dataclasses
import re

import tiny_model
from config import Extension, extension
from rollout import ENVS, score
from task import Problem

CODE_FILE = ".sandbox_code"  # stage 2 reads and deletes it, so the working dir the code sees starts empty
REFUSED_EXIT = 3  # stage 2's exit status when a Refused escaped the code

STAGE1 = r"""
import ctypes, json, os, resource, signal, sys
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if a["netns"] is not False and libc.unshare(0x10000000 | 0x40000000 | 0x20000000):  # NEWUSER|NEWNET|NEWPID
    sys.exit("sandbox: unshare failed: " + os.strerror(ctypes.get_errno()))
if a["netns"] is None:  # mechanism()'s probe
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
# _Run.stop()'s SIGTERM waits (blocked) until the handler below knows the child's pid: one arriving right
# after the fork would otherwise kill stage 1 unreaped-child-and-all, leaving pid 1 to the host's init
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
pid = os.fork()
if pid == 0:  # pid 1 of the new namespace; ctypes and this code are gone after the exec
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # (a blocked mask survives exec)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: if stage 1 is killed, so is pid 1 (and its ns)
        for name, limit in a["rlimits"]:  # soft = hard, so the code cannot raise them again
            hard = resource.getrlimit(getattr(resource, name))[1]
            limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
            resource.setrlimit(getattr(resource, name), (limit, limit))
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", a["stage2"], a["mode"]])
    except BaseException as e:
        os.write(2, f"sandbox: stage 1: {e!r}".encode())
        os._exit(127)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))  # _Run.stop(): kill, then reap below
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})       # (one that came meanwhile runs it now)
os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # not reaped yet, so the handler cannot hit a reused pid
signal.signal(signal.SIGTERM, signal.SIG_IGN)
status = os.waitpid(pid, 0)[1]
if os.WIFSIGNALED(status):  # die the same way, so the caller sees the signal
    if os.WTERMSIG(status) != signal.SIGKILL:
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
"""

STAGE2 = r"""
import linecache, os, sys, traceback
with open(".sandbox_code", encoding="utf-8") as f:
    src = f.read()
os.unlink(".sandbox_code")
linecache.cache["<sandbox>"] = (len(src), None, src.splitlines(True), "<sandbox>")  # source in tracebacks

class Refused(PermissionError):
    pass

def make_hook(cwd, roots, real=os.path.realpath, fsdecode=os.fsdecode):  # bound now: rebinding later is moot
    blocked = {"ctypes", "_ctypes", "cffi", "_cffi_backend", "_posixsubprocess", "_testcapi",
               "_testinternalcapi"}
    refused = {"os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
               "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.chmod", "os.chown",
               "os.chflags", "os.setxattr", "os.removexattr", "resource.setrlimit", "resource.prlimit"}
    writes = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.truncate": 1, "os.utime": 1, "os.rename": 2,
              "os.link": 2, "os.symlink": 2, "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.move": 2}
    wflags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def check(path, write):
        if isinstance(path, int):  # an fd the process already holds
            return
        p = real(fsdecode("." if path is None else path))
        if not any(p == r or p.startswith(r + "/") for r in ((cwd,) if write else (cwd,) + roots)):
            raise Refused(f"sandbox: {'writing' if write else 'reading'} {path!r} is refused")

    def hook(event, args):
        if event == "import" and args[0].partition(".")[0] in blocked:
            raise Refused(f"sandbox: import {args[0]} is refused")
        if event in refused or event.partition(".")[0] in ("socket", "ctypes"):
            raise Refused(f"sandbox: {event} is refused")
        if event == "object.__setattr__" and args[1] in ("__code__", "__defaults__", "__kwdefaults__"):
            raise Refused(f"sandbox: setting {args[1]} is refused")  # e.g. on this hook
        if event == "open":
            check(args[0], bool(args[2] & wflags) or any(c in (args[1] or "") for c in "wax+"))
        elif event in ("os.listdir", "os.scandir", "os.chdir"):
            check(args[0], False)
        for path in args[:writes.get(event, 0)]:
            check(path, True)
    return hook

sys.addaudithook(make_hook(os.getcwd(), tuple(os.path.realpath(p) for p in sys.path if p)))
ns, status = {"__name__": "__main__", "__builtins__": __builtins__}, 0
try:
    value = eval(compile(src, "<sandbox>", sys.argv[1]), ns)
    if sys.argv[1] == "eval":
        sys.stdout.write(repr(value))
except SystemExit as e:
    if e.code not in (None, 0):
        status = 1
        print(f"SystemExit: {e.code}", file=sys.stderr)
except BaseException as e:
    ns.clear()  # after a MemoryError the hog is still referenced from here: free it to print the traceback
    traceback.clear_frames(e.__traceback__)
    status = 3 if any(isinstance(x, Refused) for x in (e, e.__cause__, e.__context__)) else 1
    try:
        traceback.print_exception(e.with_traceback(e.__traceback__.tb_next))  # without this file's frame
    except BaseException:
        os.write(2, type(e).__name__.encode())
try:
    sys.stdout.flush()
    sys.stderr.flush()
finally:
    os._exit(status)  # not sys.exit, which would wait for threads the code started
"""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2  # a calculator/python tool call needs milliseconds of CPU; 2 s still fits big-int math
    memory_mb: int = 256  # address space: the interpreter takes ~16 MB; 64 concurrent calls stay under 16 GB
    file_mb: float = 1  # the largest file the code may write: scratch files only
    nproc: int = 16  # threads (forks are refused); not enforced for root, see above
    nofile: int = 64  # open files: a handful are in use after startup
    wall_s: float = 5.0  # > cpu_s + startup, so a CPU hog is reported as such; catches sleeps, blocked reads
    output_bytes: int = 4096  # of stdout and of stderr, each: ~1k tokens; more is noise in a tool observation

    def __post_init__(self):
        # (integer?, minimum): RLIMIT_CPU counts whole seconds; in under 0.1 s the interpreter cannot start
        bounds = {"cpu_s": (True, 1), "memory_mb": (True, 32), "file_mb": (False, 0), "nproc": (True, 1),
                  "nofile": (True, 16), "wall_s": (False, 0.1), "output_bytes": (True, 1)}
        for f in fields(self):
            (integer, lo), v = bounds[f.name], getattr(self, f.name)
            number = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
            if isinstance(v, bool) or not number or v < lo:
                kind = "an integer" if integer else "a number"
                raise ValueError(f"SandboxLimits.{f.name} must be {kind} >= {lo}, got {v!r}")


@dataclass
class SandboxResult:
    ok: bool
    output: str  # stdout, capped; in eval mode the repr of the value
    error: str  # stderr (a traceback), or why the call was stopped; capped
    kind: str  # "ok" | "error" | "timeout" | "killed" | "refused"
    wall_s: float


def _env(cwd: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}


@cache
def mechanism() -> str:
    """"netns" if user+net+pid namespaces can be entered here (probed once), else "socket-refusal"."""
    probe = subprocess.run([sys.executable, "-I", "-S", "-c", STAGE1, json.dumps({"netns": None})],
                           capture_output=True, cwd="/", env=_env("/"), timeout=30)
    return "netns" if probe.returncode == 0 else "socket-refusal"


class _Run:
    """One call: the stage 1 process, its pipes, a pidfd (readable once it exits), the output so far."""

    def __init__(self, code: str, limits: SandboxLimits, mode: str):
        if mode not in ("exec", "eval"):
            raise ValueError(f"mode must be 'exec' or 'eval', got {mode!r}")
        rlimits = [("RLIMIT_CPU", limits.cpu_s), ("RLIMIT_AS", limits.memory_mb << 20),
                   ("RLIMIT_FSIZE", int(limits.file_mb * (1 << 20))), ("RLIMIT_NPROC", limits.nproc),
                   ("RLIMIT_NOFILE", limits.nofile)]
        netns = mechanism() == "netns"
        args = json.dumps({"netns": netns, "rlimits": rlimits, "stage2": STAGE2, "mode": mode})
        self.limits, self.workdir, self.proc = limits, tempfile.mkdtemp(prefix="sandbox-"), None
        try:
            with open(os.path.join(self.workdir, CODE_FILE), "w", encoding="utf-8") as f:
                f.write(code)
            self.t0 = time.monotonic()
            self.deadline = self.t0 + limits.wall_s
            pipe = subprocess.PIPE
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", STAGE1, args], cwd=self.workdir,
                                         env=_env(self.workdir), stdin=subprocess.DEVNULL, stdout=pipe,
                                         stderr=pipe, start_new_session=True)
            self.pidfd = os.pidfd_open(self.proc.pid)  # Linux 5.3+
        except BaseException:
            if self.proc is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.bufs = {p.fileno(): bytearray() for p in (self.proc.stdout, self.proc.stderr)}
        self.dropped = dict.fromkeys(self.bufs, 0)
        for fd in self.bufs:
            os.set_blocking(fd, False)
        self.open = set(self.bufs) | {self.pidfd}  # done: both pipes at EOF and the process has exited

    def step(self, fd: int):
        """fd is readable: read what is there, keep up to output_bytes."""
        if fd == self.pidfd:
            self.open.discard(fd)
            return
        with suppress(BlockingIOError):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.open.discard(fd)
            keep = chunk[:max(0, self.limits.output_bytes - len(self.bufs[fd]))]
            self.bufs[fd] += keep
            self.dropped[fd] += len(chunk) - len(keep)

    def stop(self):
        """Stage 1 SIGKILLs its child and reaps it, which for a pid namespace's init returns only once the
        kernel has killed the whole namespace; then whatever is left in the process group gets SIGKILL. The
        leader is not reaped yet, so its pid (the group's id) cannot have been reused."""
        with suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        select.select([self.pidfd], [], [], 2.0)  # ~ms; bounded in case stage 1 is wedged
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self) -> SandboxResult:
        timed_out = self.pidfd in self.open
        if timed_out:
            self.stop()
        with suppress(ProcessLookupError):  # strays that kept the pipes open after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        _, status, usage = os.wait4(self.proc.pid, 0)  # its CPU time includes that of its reaped child
        rc = self.proc.returncode = os.waitstatus_to_exitcode(status)
        cut = {fd: f"\n...[{n} more bytes cut]" if n else "" for fd, n in self.dropped.items()}
        out, err = (buf.decode("utf-8", "replace") + cut[fd] for fd, buf in self.bufs.items())
        if timed_out:
            kind, err = "timeout", f"wall-clock limit of {self.limits.wall_s} s exceeded\n{err}"
        elif rc < 0:
            cpu = usage.ru_utime + usage.ru_stime >= self.limits.cpu_s - 0.05
            why = f"CPU limit of {self.limits.cpu_s} s" if cpu else "a signal"
            kind, err = "killed", f"killed by {signal.Signals(-rc).name} ({why})\n{err}"
        else:
            kind = {0: "ok", REFUSED_EXIT: "refused"}.get(rc, "error")
            err = err or ("" if rc == 0 else f"exit status {rc}")
        return SandboxResult(kind == "ok", out, err.strip(), kind, time.monotonic() - self.t0)

    def close(self):
        if self.proc.returncode is None:  # cancelled, or failed before finish()
            self.stop()
            self.proc.returncode = os.waitstatus_to_exitcode(os.waitpid(self.proc.pid, 0)[1])
        os.close(self.pidfd)
        self.proc.stdout.close()
        self.proc.stderr.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), mode: str = "exec") -> SandboxResult:
    """Run code in a sandbox and wait for it (blocking; from async code use arun_python)."""
    run = _Run(code, limits, mode)
    try:
        with selectors.DefaultSelector() as sel:
            for fd in run.open:
                sel.register(fd, selectors.EVENT_READ)
            while run.open and (left := run.deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    run.step(key.fd)
                    if key.fd not in run.open:
                        sel.unregister(key.fd)
        return run.finish()
    finally:
        run.close()


async def arun_python(code: str, limits: SandboxLimits = SandboxLimits(),
                      mode: str = "exec") -> SandboxResult:
    """run_python on the event loop's own selector. Cancelling it stops the sandbox (nothing is left
    running) before the CancelledError propagates. Popen, not asyncio's subprocess API: one _Run for both,
    and the leader stays unreaped until its process group is killed (asyncio's child watcher reaps it)."""
    loop = asyncio.get_running_loop()
    run, done = _Run(code, limits, mode), loop.create_future()

    def ready(fd):
        run.step(fd)
        if fd not in run.open:
            loop.remove_reader(fd)
            if not run.open and not done.done():
                done.set_result(None)
    try:
        for fd in run.open:
            loop.add_reader(fd, ready, fd)
        await asyncio.wait([done], timeout=max(0.0, run.deadline - time.monotonic()))
        return run.finish()
    finally:
        for fd in run.open:
            loop.remove_reader(fd)
        run.close()


# ---------------------------------------------------------------------------------------------
# the tool env


CALL = re.compile(r"\s*calc\((.*)\)\s*", re.DOTALL)   # a tool call: the whole action is calc(EXPR)


def calc_observation(value: str | None) -> str:
    """What the model sees after a call: the value, then a cue to answer ("answer:"; a bare "=VALUE" would
    read as the default task's finished answer, after which the warm-started model stops)."""
    return f" ={value} answer:" if value is not None else " error, answer:"


class CalcEnv:
    """The problem's prompt; the model answers, or first writes calc(EXPR): EXPR (model-written Python)
    runs in the sandbox (below: its own process, no network, limits, a wall-clock kill) and its
    value comes back as the next observation (calc_observation). The first action that is not a call
    is the answer, scored by the task's verifier."""

    def __init__(self, problem: Problem, reward_fn=None, max_calls: int = 2, limits=None):
        self.problem, self.reward_fn, self.max_calls = problem, reward_fn, max_calls
        self.limits = limits or SandboxLimits()
        self.calls = 0

    async def reset(self, seed: int) -> str:
        self.calls = 0
        return self.problem.prompt

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        call = CALL.fullmatch(action)
        if call and self.calls < self.max_calls:
            self.calls += 1
            res = await arun_python(call.group(1), self.limits, mode="eval")
            value = res.output.strip()
            ok = res.ok and re.fullmatch(r"-?\d{1,40}", value) is not None   # text the tiny model can read
            info = {"tool": res.kind, "tool_s": res.wall_s}
            return calc_observation(value if ok else None), 0.0, False, info
        return "", await score(self.problem, action, self.reward_fn), True, {"tool_calls": self.calls}


ENVS["calc"] = lambda problem, seed, reward_fn=None: CalcEnv(problem, reward_fn)
CALC_DIR, CALC = tiny_model.DEFAULT_DIR.with_name("tiny-qwen2-calc"), tiny_model.TinyConfig(tool_frac=0.5,
                                                                                            sft_steps=2000)


def sft_segments(p: Problem) -> list[tuple[str, bool]]:
    """A warm-start transcript that calls the calculator (CalcEnv's protocol), then copies its value."""
    return [(p.prompt, False), (f"calc({p.prompt.rstrip('=')})", True), (calc_observation(p.answer), False),
            (p.answer, True)]


def ensure_calc_model(log=print) -> Path:
    return tiny_model.ensure_tiny_model(CALC_DIR, CALC, log=log, tool=sft_segments)


@extension
class Calc(Extension):
    """--env calc: the embedded model is the one warm-started to call the calculator; replies of 16 tokens."""
    name = "calc"

    def embedded_model(self):
        return ensure_calc_model if self.cfg.controller.env == "calc" else None

    def resolve(self, cfg):
        if cfg.controller.env == "calc" and not cfg.model and not cfg.rollout.max_tokens:
            return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_tokens=16))
        return cfg
