"""Pre-warmed workers (trainer.launch.zygote): every rank is a fork of the node's zygote, the
first ones (whose workers wait for it to import) and the restarted ones.

Real jobs (`rfsdp train`, ft_launcher, 2 gloo ranks); faults are real signals sent from here once
the zygote is listening, so that the restart it serves does not depend on how fast it imported.
Every assertion is about structure (who forked whom, what is alive), never about timings.

What a request carries, in this process: tests/unit/test_zygote.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import NOBODY, ROOT
from tests.reaper import TAG_ENV, alive
from trainer.events import FaultFired, Restart, RunEnd, RunStart, Step, read_events, select
from trainer.faults import FAULTS_DIR
from trainer.launch.local import RUN_DIR_LOCK
from trainer.launch.worker import ZYGOTE_MODULE, lock_address, zygote_address


def start_train(data: Path, run: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "trainer.cli",
        "train",
        "--quiet",
        "--data",
        str(data),
        "--run-dir",
        str(run),
        *extra,
    ]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(what: str, check: Callable[[], object], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: list[str]
    env: dict[str, str]


def ours() -> list[Proc]:
    """This test's live processes (they carry its tag), as they are now."""
    tag = os.environ[TAG_ENV]
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get(TAG_ENV) == tag and alive(p.pid):
                found.append(Proc(p.pid, p.ppid(), p.cmdline(), env))
        except psutil.Error:  # gone meanwhile
            continue
    return found


def zygotes() -> dict[int, tuple[str, int]]:
    """This test's zygotes (pid -> address, agent pid): the processes that hold a zygote's lock
    file open. Its forks (the ranks, their children, NVRx's monitors double-forked from them)
    close it. The agent forks its zygote (its parent); a worker starts one as
    ``python -m trainer.launch.zygote ADDRESS AGENT_PID``.
    """
    found = {}
    for p in ours():
        lock = next((path for path in open_paths(p.pid) if re.fullmatch(r".*/zygote-[0-9a-f]+\.lock", path)), None)
        if lock is not None:
            agent = int(p.argv[-1]) if ZYGOTE_MODULE in p.argv[1:4] else p.ppid
            found[p.pid] = (lock.removesuffix(".lock"), agent)
    return found


def open_paths(pid: int) -> list[str]:
    """The files the process ``pid`` has open."""
    try:
        return [f.path for f in psutil.Process(pid).open_files()]
    except psutil.Error:  # gone meanwhile
        return []


def one_listening_zygote() -> list | None:
    found = zygotes()
    return list(found.items()) if len(found) == 1 and listening(next(iter(found.values()))[0]) else None


def listening(address: str) -> bool:
    """True while a socket is bound at the path ``address``."""
    return any(line.rstrip().endswith(f" {address}") for line in Path("/proc/net/unix").read_text().splitlines())


def forked_ranks(zygote: int, besides: list[int] = ()) -> list[int]:
    return [p.pid for p in ours() if p.ppid == zygote and p.pid not in besides]


def session_leaders(pids: list[int], count: int) -> list[int] | None:
    """``pids`` if there are ``count`` of them and each leads its own session, else None."""
    try:
        return pids if len(pids) == count and all(os.getsid(p) == p for p in pids) else None
    except ProcessLookupError:  # one ended meanwhile
        return None


def worker(program: str, rank: int) -> int | None:
    """The live process started as ``python -m PROGRAM`` for ``rank`` (exec'd: its environment is
    its own), not a fork of it (the checkpoint writer's worker).
    """
    procs = [p for p in ours() if program in p.argv[1:4]]  # python [-u] -m PROGRAM (the launcher's argv names it too)
    pids = {p.pid for p in procs}
    return next((p.pid for p in procs if p.ppid not in pids and p.env.get("RANK") == str(rank)), None)


def test_restarts_are_served_by_the_zygote_which_ends_with_the_run(data_dir: Path, tmp_path: Path) -> None:
    """The first workers wait for the zygote to import, and their ranks are two forks of it,
    each leading its own session; so is a SIGKILLed rank's restart. Killing a client's process
    group (what the launcher does to restart) kills its rank; SIGTERM reaches the forked ranks
    through their clients (a graceful preemption). After `rfsdp train` returns, neither the
    zygote nor its socket is left.
    """
    run = tmp_path / "run"
    proc = start_train(data_dir, run, "--steps", "100000", "--ckpt-every", "5")  # ended by the SIGTERM below
    try:
        ((zygote, (address, _)),) = wait_for("one zygote, listening", one_listening_zygote)
        assert Path(lock_address(address)).is_file()
        assert oct(Path(address).parent.stat().st_mode & 0o777) == oct(0o700)
        # Each leads its own session, as a worker does (a fork is seen before it calls setsid).
        first = wait_for("the first workers' ranks, forked", lambda: session_leaders(forked_ranks(zygote), 2))
        # The run dir's lock is the job's (its launcher and agent hold it), not the zygote's nor a
        # rank's: those outlive the agent by a moment, and a next job on the run dir was refused.
        lock = str(run / RUN_DIR_LOCK)
        assert lock in open_paths(psutil.Process(zygote).ppid())
        assert not [pid for pid in (zygote, *first) if lock in open_paths(pid)]
        assert worker("trainer.rank.train", 0) is None and worker("trainer.rank.train", 1) is None  # none exec'd
        wait_for("a step", lambda: select(read_events(run), Step))  # the restart's timeline starts there
        (start,) = select(read_events(run), RunStart)
        assert "forked" in start.phases
        os.kill(first[1], signal.SIGKILL)  # a rank lost

        ranks = wait_for("two new forked ranks", lambda: session_leaders(forked_ranks(zygote, besides=first), 2))
        wait_for("the restart event", lambda: select(read_events(run), Restart))
        (restart,) = select(read_events(run), Restart)
        assert "forked" in restart.phases and "imports_done" not in restart.phases  # rank 0 imported nothing

        client = wait_for("rank 0's client", lambda: worker("trainer.launch.worker", 0))
        os.killpg(client, signal.SIGKILL)  # as the launcher stops a worker
        wait_for("the killed client's ranks to end", lambda: not any(alive(r) for r in ranks), timeout=30)
        wait_for("the second restart", lambda: len(select(read_events(run), Restart)) == 2)
        wait_for("the next forked ranks", lambda: session_leaders(forked_ranks(zygote), 2))

        proc.send_signal(signal.SIGTERM)  # preemption: launcher -> clients -> forked ranks
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert select(read_events(run), RunEnd)[-1].status == "preempted"
    # It ends as soon as it sees its agent gone, which may be just after `rfsdp train` saw it.
    wait_for("the zygote to end", lambda: not alive(zygote), timeout=10)
    assert not listening(address) and not Path(address).exists() and not Path(lock_address(address)).exists()
    assert not zygotes()


def test_two_runs_at_once_have_a_zygote_each(data_dir: Path, tmp_path: Path) -> None:
    """Each agent (ft_launcher) has its own zygote, at its own address: two jobs on one machine
    never fork each other's ranks.
    """
    procs = [start_train(data_dir, tmp_path / f"run{i}", "--steps", "30", "--ckpt-every", "10") for i in range(2)]
    try:
        found = wait_for("two zygotes", lambda: len(z := set(zygotes().values())) == 2 and z)
        assert len({address for address, _ in found}) == 2
        launchers = {psutil.Process(agent).ppid() for _, agent in found}
        assert launchers == {p.pid for p in procs}  # each zygote's agent is the launcher of a different run
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


CLIENT = r"""
import json, os, socket, sys
address, argv = sys.argv[1], sys.argv[2:]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    sock.connect(address if address.startswith("/") else "\0" + address)
except OSError as e:
    print(json.dumps({"connect": type(e).__name__}))
    sys.exit()
request = {"argv": argv, "env": dict(os.environ), "withheld": [], "cwd": "/", "pid": os.getpid(), "started": 0.0}
socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
print(json.dumps(json.loads(sock.recv(1 << 20) or b"{}")))
"""
"""A client of a zygote that is not a worker of its launcher: it asks for a rank as a worker does."""

root_only = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to act as another user"
)


def as_nobody(*args: str) -> list[str]:
    """``python ARGS`` run as the user nobody: the base interpreter (the scripts need only the
    standard library), since a checkout under a 0700 folder keeps nobody out of its venv.
    """
    python = [*NOBODY, os.path.realpath(sys.executable)]
    if subprocess.run([*python, "-c", "pass"], cwd="/", capture_output=True, timeout=60).returncode:
        pytest.skip("the user nobody cannot run this Python")
    return [*python, *args]


@root_only
def test_only_a_worker_of_its_own_launcher_gets_a_rank(data_dir: Path, tmp_path: Path) -> None:
    """Another user cannot reach a job's zygote, and a process of the same user that is not one of
    the launcher's workers is refused: neither gets a rank (the audit's client, run as nobody,
    got one that trained and wrote root-owned files where it chose).
    """
    run = tmp_path / "run"
    proc = start_train(data_dir, run, "--steps", "100000", "--ckpt-every", "50000")  # ended below
    try:
        ((zygote, (address, _)),) = wait_for("one zygote, listening", one_listening_zygote)
        ranks = wait_for("the job's ranks, forked", lambda: session_leaders(forked_ranks(zygote), 2))
        ask = ["-c", CLIENT, address, "--data", str(data_dir), "--run-dir", str(tmp_path / "theirs")]
        nobodys = subprocess.run(as_nobody(*ask), cwd="/", capture_output=True, text=True, timeout=60)
        roots = subprocess.run([sys.executable, *ask], cwd="/", capture_output=True, text=True, timeout=60)
        for reply in (nobodys, roots):
            assert reply.returncode == 0, reply.stderr
            assert "pid" not in json.loads(reply.stdout), reply.stdout
        assert json.loads(nobodys.stdout) == {"connect": "PermissionError"}  # the socket's folder is its user's alone
        assert "is not a worker of this zygote's launcher" in json.loads(roots.stdout)["error"]
        assert not forked_ranks(zygote, besides=ranks)
        assert not (tmp_path / "theirs").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


SQUATTER = r"""
import os, socket, sys
address = sys.argv[1]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
if address.startswith("/"):
    os.makedirs(os.path.dirname(address), mode=0o777, exist_ok=True)
    os.chmod(os.path.dirname(address), 0o777)
    sock.bind(address)
else:
    sock.bind("\0" + address)
sock.listen(16)
sock.settimeout(float(sys.argv[2]))
print("ready", flush=True)
try:
    while True:
        conn, _ = sock.accept()
        data = conn.recv(1 << 20)
        print("received", len(data), data.decode(errors="replace"), flush=True)
        conn.close()
except socket.timeout:
    pass
"""
"""Binds the name a worker will use before its zygote does, and prints whatever it receives."""

AGENT = "import subprocess, sys; input(); sys.exit(subprocess.call(sys.argv[1:]))"
"""A stand-in launcher: starts the worker given as its argv once a line arrives on its stdin."""


@root_only
def test_a_worker_sends_nothing_to_another_users_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket another user bound first at the zygote's name (in a folder they made, as the
    temporary folder allows) gets no request: the audit's squatter received six, with the job's
    secrets and stdio. The worker runs the rank itself instead.
    """
    shared_tmp = Path(tempfile.mkdtemp(prefix="rfsdp-test-"))  # short: a socket's path holds 108 bytes
    shared_tmp.chmod(0o1777)  # as /tmp is
    ours = Path(tempfile.mkdtemp(prefix="rfsdp-test-"))
    env = {**os.environ, "TMPDIR": str(shared_tmp), "TORCHELASTIC_RUN_ID": "job", "AWS_SECRET_ACCESS_KEY": "sekrit"}
    command = [sys.executable, "-c", AGENT, sys.executable, "-m", "trainer.launch.worker", "--help"]
    agent = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    squatter = None
    try:
        monkeypatch.setenv(
            "TMPDIR", str(ours)
        )  # where the name is computed: the squatter takes it in the shared folder
        name = zygote_address(agent.pid, "job")
        assert name is not None
        target = str(shared_tmp / f"rfsdp-{os.geteuid()}" / Path(name).name) if name.startswith("/") else name
        squatter = subprocess.Popen(as_nobody("-c", SQUATTER, target, "20"), cwd="/", stdout=subprocess.PIPE, text=True)
        assert squatter.stdout.readline().strip() == "ready"
        agent.stdin.write("\n")
        agent.stdin.flush()
        out, _ = agent.communicate(timeout=120)
        squatter.kill()
        received, _ = squatter.communicate(timeout=30)
    finally:
        for p in (agent, squatter):
            if p is not None and p.poll() is None:
                p.kill()
        shutil.rmtree(shared_tmp, ignore_errors=True)
        shutil.rmtree(ours, ignore_errors=True)
    assert "received" not in received and "sekrit" not in received, received
    assert agent.returncode == 0, out[-3000:]  # the trainer's --help, run by the worker itself
    assert "usage:" in out
    assert "not a private folder of this user's" in out


def test_a_forked_ranks_sigterm_fault_preempts_the_run(data_dir: Path, tmp_path: Path) -> None:
    """A rank forked by the zygote preempts the run through its launcher, not its parent (the
    zygote): the audit's ``sigkill@150:1,sigterm@300:0`` was never preempted. The sigterm fault is
    held back (its once-per-run marker) until the first ranks are past its step, then the
    restarted ranks, which resume from step 0, fire it.
    """
    run = tmp_path / "run"
    marker = run / FAULTS_DIR / "sigterm@5:0"
    marker.parent.mkdir(parents=True)
    marker.touch()  # already fired, as far as the first workers know
    proc = start_train(
        data_dir, run, "--steps", "100000", "--ckpt-every", "50000", "--local-ckpt-every", "0", "--fault", "sigterm@5:0"
    )
    try:
        ((zygote, _),) = wait_for("one zygote, listening", one_listening_zygote)
        first = wait_for("the first workers' ranks, forked", lambda: session_leaders(forked_ranks(zygote), 2))
        wait_for("step 6", lambda: any(s.step >= 6 for s in select(read_events(run), Step)))
        marker.unlink()
        os.kill(first[1], signal.SIGKILL)
        wait_for("two new forked ranks", lambda: session_leaders(forked_ranks(zygote, besides=first), 2))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    events = read_events(run)
    (fired,) = select(events, FaultFired)
    assert fired.kind == "sigterm" and fired.step == 5
    (restart,) = select(events, Restart)
    assert "forked" in restart.phases
    end = select(events, RunEnd)[-1]
    assert end.status == "preempted" and end.step == 5


@pytest.mark.parametrize(
    ("status", "returncode"),
    [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, -signal.SIGTERM), (3 << 8, 3)],
    ids=["sigkill", "sigterm", "exit-3"],
)
def test_a_worker_ends_as_its_forked_rank_did(status: int, returncode: int) -> None:
    """ft_launcher sees the worker, so the worker ends as its rank did: a rank SIGKILLed (by the
    kernel's OOM killer, the rank monitor at a hang) leaves a worker SIGKILLed, not one that
    exits 1 (before: setting SIGKILL's handler raised, and the kill was reported as an exit)."""
    code = f"from trainer.launch.worker import _exit_like; _exit_like({int(status)})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == returncode, proc.stderr[-2000:]


def test_a_rank_leaves_as_the_interpreter_would_less_its_teardown(tmp_path: Path) -> None:
    """``leave``: a non-daemon thread is joined, then the atexit handlers run, stdio is flushed,
    and the exit code is the one asked for (the module teardown it skips leaves no trace)."""
    out = tmp_path / "order"
    program = f"""
import atexit, sys, threading, time
from pathlib import Path
from trainer.process import leave
out = Path({str(out)!r})
def late():
    time.sleep(0.3)
    with out.open("a") as f: f.write("thread ")
threading.Thread(target=late).start()
atexit.register(lambda: out.open("a").write("atexit"))
sys.stdout.write("unflushed")
leave(3)
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushed"
    assert out.read_text() == "thread atexit"


_TRIPWIRE = """
import json, sys, torch
calls = []
def tripwire(name, fn):
    def wrapped(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapped
for name in dir(torch._C):
    if name.startswith("_cuda_") and callable(getattr(torch._C, name)):
        setattr(torch._C, name, tripwire(name, getattr(torch._C, name)))
# Not device_count: it asks NVML, which is safe to fork after (NVRx's local tier calls it at import).
for name in ("is_available", "init", "is_bf16_supported", "get_device_capability", "get_device_properties",
             "current_device", "set_device", "synchronize", "mem_get_info"):
    setattr(torch.cuda, name, tripwire("cuda." + name, getattr(torch.cuda, name)))
from trainer.launch.zygote import PRELOAD
from trainer.models import model_modules
modules = [*PRELOAD, *model_modules(sys.argv[1])]
for module in modules:
    __import__(module)
imported = list(calls)
torch.cuda.is_available()  # the tripwire's own check: this one must be seen
print(json.dumps({"imported": imported, "canary": calls[len(imported):], "modules": modules}))
"""


def test_what_the_zygote_imports_calls_no_cuda_api(tmp_path: Path) -> None:
    """The zygote forks the ranks, so it must never touch a GPU (a CUDA context does not survive a
    fork): importing what it preloads, an ``hf:`` model's transformers modules included, calls no
    CUDA function of torch's that starts CUDA. Checked in a fresh interpreter, with a tripwire on
    each of them."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = subprocess.run(
        [sys.executable, "-c", _TRIPWIRE, f"hf:{tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert "transformers.models.llama.modeling_llama" in seen["modules"]
    assert seen["canary"] and seen["imported"] == [], seen["imported"]
