"""torchft's recovery from a lost replica group, measured on CPU: the baseline for phalanx's in-place recovery.

What it measures
----------------
A torchft Lighthouse runs in this process; two replica groups (one process each, Gloo on CPU, loopback) train
the same float32 MLP (a ``torch.nn.Sequential`` of square ``Linear`` layers sized so that its parameters plus
AdamW's two moment buffers come to about ``--state-mb`` MB, 1 MB = 10**6 bytes) with AdamW on synthetic data
drawn from a fixed seed, for ``--steps`` committed steps. Each group is the plain torchft recipe:
``ProcessGroupGloo(timeout=...)``, a ``Manager`` (``min_replica_size=1``, its own ``TCPStore``, the
Lighthouse's address), ``torchft.optim.OptimizerWrapper`` around AdamW, and one ``manager.allreduce`` of the
flattened gradients per step; the Lighthouse keeps torchft's defaults unless told otherwise.

``--failures K`` times, at evenly spaced steps, this process SIGKILLs replica group 1 and at once starts a new
process with the same ``replica_id``; torchft heals it from the live group (the survivor sends its model and
optimizer state over HTTP). Every process appends, after each completed (committed) optimizer step, the step
number and ``time.time()`` to its own file, and from those files, per failure:

* ``stall_s``: from the kill to the survivor's (group 0) next completed step that went without the killed
  group (the first one committed with a quorum of one; a step whose allreduce had already finished with the
  victim's gradients when it was killed does not count);
* ``rejoin_s``: from the relaunch (the new process's start, so Python and torch's import included) to the new
  group's first completed step, the one that heals it; ``rejoin_import_s`` and ``rejoin_startup_s`` are the
  parts until torch and torchft are imported and until its ``Manager`` exists, ``rejoin_heal_s`` the rest
  (joining the quorum, receiving the survivor's state, the step itself);

and at the end ``final_max_abs_diff``, the largest absolute difference between the two groups' final
parameters (0.0: bit-identical). ``step_s`` is the survivor's median step time with both groups in, for scale.
The next failure waits until the relaunched group has completed a step. While group 1 is down, torchft lets the
survivor train on alone (``min_replica_size=1``); if it finishes its ``--steps`` before a failure is due, or
before a relaunched group rejoins (there is then no live group left to heal from), the JSON's ``note`` says so
and the measurements that became impossible are null.

Running it
----------
It needs an interpreter with torchft (``pip install torchft``; without it the script exits with status 2)::

    python benchmarks/recovery_torchft.py --failures 3 --steps 300 --state-mb 33 --json out.json

``benchmarks/recovery.py`` runs it as a subprocess with the interpreter given by its ``--torchft-python``.
It writes the JSON report (``tool``, ``version``, ``failures``, ``median_stall_s``, ``median_rejoin_s``,
``final_max_abs_diff``, ``state_mb``, ``steps``, ``wall_s`` and details) to ``--json`` and prints one summary
line. Every wait is bounded by ``--timeout-s``; every child is killed on the way out, and each child also
ends by itself when this process dies or its own deadline passes. Scratch files (per-process step logs,
stderr, final parameters) go to a fresh directory under ``--workdir``, removed afterwards unless ``--keep``.

Addresses: the Lighthouse, the stores, Gloo (``GLOO_SOCKET_IFNAME=lo``) and the managers' advertised addresses
are on loopback. torchft 0.2.0 gives no way to choose where its ``ManagerServer`` (``[::]``) and its HTTP
checkpoint server (``""``, advertised as ``socket.gethostname()``) listen: those two listen on every interface,
as they do for any torchft user.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

WORKER_FLAG = "--worker"
LOOPBACK = "127.0.0.1"
BATCH = 32
DEPTH = 4  # square Linear layers
BYTES_PER_PARAM = 12  # float32 parameter + AdamW's exp_avg and exp_avg_sq


def _import_torchft() -> Any:
    """Import torch and torchft (quietly), or exit with status 2 saying how to get torchft."""
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torch  # noqa: F401
        import torchft
    except ImportError as e:
        print(
            f"recovery_torchft: torchft is not importable with {sys.executable} ({e}); pip install torchft",
            file=sys.stderr,
        )
        sys.exit(2)
    return torchft


def _torchft_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return "unknown"


def mlp_width(state_mb: float) -> int:
    """The width of the square layers that makes parameters + AdamW state about ``state_mb`` MB."""
    params = state_mb * 1e6 / BYTES_PER_PARAM
    return max(8, int((-1 + math.sqrt(1 + 4 * params / DEPTH)) / 2))  # DEPTH * (w*w + w) = params


# --------------------------------------------------------------------------------------------------------------
# replica group process
# --------------------------------------------------------------------------------------------------------------


def _watchdog(parent: int, deadline: float) -> None:
    """End this process when the benchmark's process is gone or the deadline has passed."""
    while os.getppid() == parent and time.time() < deadline:
        time.sleep(0.25)
    os._exit(3)


def worker(argv: list[str]) -> None:
    """One replica group: train until ``--steps`` steps are committed, logging each one."""
    p = argparse.ArgumentParser(prog="recovery_torchft.py --worker")
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--pg-timeout-s", type=float, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--deadline", type=float, required=True)
    p.add_argument("--parent", type=int, required=True)
    a = p.parse_args(argv)
    threading.Thread(target=_watchdog, args=(a.parent, a.deadline), daemon=True).start()
    log = open(a.log, "a", buffering=1)

    def mark(**event: object) -> None:
        log.write(json.dumps(event) + "\n")

    mark(ev="start", t=time.time())
    _import_torchft()
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)  # two groups on a small machine
    mark(ev="imported", t=time.time())

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(DEPTH):
        layers.append(torch.nn.Linear(a.width, a.width))
        if i < DEPTH - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters())
    optim = torch.optim.AdamW(params, lr=1e-4)

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=a.pg_timeout_s)
    store = TCPStore(host_name=LOOPBACK, port=0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{a.replica}",
        lighthouse_addr=a.lighthouse,
        store_addr=LOOPBACK,
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timeout,
        hostname=LOOPBACK,
    )
    opt = OptimizerWrapper(manager, optim)
    mark(ev="ready", t=time.time())

    while manager.current_step() < a.steps:
        t0 = time.time()
        before = manager.current_step()
        opt.zero_grad()  # starts the quorum (and any healing)
        g = torch.Generator().manual_seed(1_000_003 * a.replica + before)
        x = torch.randn(BATCH, a.width, generator=g)
        y = torch.randn(BATCH, a.width, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat = torch.cat([q.grad.reshape(-1) for q in params if q.grad is not None])
        manager.allreduce(flat).wait()  # the average over the participating groups
        offset = 0
        for q in params:
            if q.grad is not None:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q))
                offset += q.numel()
        opt.step()  # steps AdamW only if the step commits
        after = manager.current_step()
        if after > before:
            mark(ev="step", step=after, t=time.time(), t0=t0, n=manager.num_participants(), healed=after > before + 1)
        else:
            mark(ev="uncommitted", step=before, t=time.time(), t0=t0)

    final = torch.cat([q.detach().reshape(-1) for q in params])
    torch.save(final, a.final + ".tmp")
    os.replace(a.final + ".tmp", a.final)
    mark(ev="done", t=time.time(), step=manager.current_step())
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's and gloo's background threads are not waited for


# --------------------------------------------------------------------------------------------------------------
# the benchmark's process
# --------------------------------------------------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


@dataclass
class Launch:
    """One process of a replica group, and what it has logged so far."""

    replica: int
    index: int
    proc: subprocess.Popen[bytes]
    started: float
    log: Path
    final: Path
    stderr: IO[bytes]
    events: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    def poll(self) -> None:
        """Read the lines logged since the last call."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        self.events.extend(json.loads(line) for line in data[:end].splitlines() if line)

    def done(self) -> bool:
        return self.first("done") is not None

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == "step"]

    def first(self, ev: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["ev"] == ev), None)

    def stderr_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.stderr.name).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


@dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    lighthouse: str
    width: int
    deadline: float
    launches: list[Launch] = field(default_factory=list)

    def spawn(self, replica: int) -> Launch:
        index = sum(1 for x in self.launches if x.replica == replica)
        stem = self.workdir / f"r{replica}-{index}"
        log, final = stem.with_suffix(".log"), stem.with_suffix(".final.pt")
        opts = {
            "--replica": replica,
            "--lighthouse": self.lighthouse,
            "--steps": self.args.steps,
            "--width": self.width,
            "--pg-timeout-s": self.args.pg_timeout_s,
            "--log": log,
            "--final": final,
            "--deadline": self.deadline,
            "--parent": os.getpid(),
        }
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            WORKER_FLAG,
            *(s for k, v in opts.items() for s in (k, str(v))),
        ]
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")  # gloo on loopback
        stderr = open(stem.with_suffix(".stderr"), "wb")
        started = time.time()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env)
        launch = Launch(replica, index, proc, started, log, final, stderr)
        self.launches.append(launch)
        return launch

    def check_time(self, what: str) -> None:
        if time.time() > self.deadline:
            raise BenchError(f"--timeout-s {self.args.timeout_s} passed while waiting for {what}")

    def check_alive(self, *launches: Launch) -> None:
        for x in launches:
            if x.proc.poll() is not None and not x.done():
                raise BenchError(
                    f"replica group {x.replica} (launch {x.index}) exited with status {x.proc.returncode} "
                    f"before finishing; its output ends with:\n{x.stderr_tail()}"
                )

    def kill_all(self) -> None:
        for x in self.launches:
            if x.proc.poll() is None:
                os.kill(x.proc.pid, signal.SIGKILL)
        for x in self.launches:
            try:
                x.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            x.stderr.close()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _failure_report(kill_t: float, relaunch_t: float, step: int, survivor: Launch, victim: Launch) -> dict[str, Any]:
    """What one failure cost, from the survivor's log and the relaunched process's log."""
    after = [e for e in survivor.steps() if e["t"] > kill_t]
    alone = next((e for e in after if e["n"] < 2), None)  # the first step committed without the victim
    rejoin = victim.steps()[0] if victim.steps() else None
    end = rejoin["t"] if rejoin else math.inf
    imported, ready = victim.first("imported"), victim.first("ready")
    return {
        "step": step,
        "stall_s": alone["t"] - kill_t if alone else None,
        "rejoin_s": rejoin["t"] - relaunch_t if rejoin else None,
        "rejoin_import_s": imported["t"] - relaunch_t if imported else None,
        "rejoin_startup_s": ready["t"] - relaunch_t if ready else None,
        "rejoin_heal_s": rejoin["t"] - ready["t"] if rejoin and ready else None,
        "healed": bool(rejoin and rejoin["healed"]),
        "healed_to_step": rejoin["step"] if rejoin else None,
        "survivor_step_at_kill": max((e["step"] for e in survivor.steps() if e["t"] <= kill_t), default=0),
        "survivor_steps_alone": sum(1 for e in after if e["n"] < 2 and e["t"] <= end),
        "survivor_uncommitted": sum(1 for e in survivor.events if e["ev"] == "uncommitted" and kill_t < e["t"] <= end),
    }


def _reached(victim: Launch, step: int, survivor: Launch) -> bool:
    """Whether ``victim`` has completed step ``step`` (or, for 1, any step), or ``survivor`` is done."""
    done = victim.steps()
    return bool(done and done[-1]["step"] >= step) or survivor.done()


def _finished(*launches: Launch) -> bool:
    return all(x.done() for x in launches)


def _wait(run: Run, what: str, done: Callable[[], bool], *launches: Launch) -> None:
    """Poll the launches' logs until ``done()``; a launch dying unfinished or the deadline ends it."""
    while True:
        for x in launches:
            x.poll()
        if done():
            return
        run.check_alive(*launches)
        run.check_time(what)
        time.sleep(0.005)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    _import_torchft()
    import torch
    from torchft.coordination import LighthouseServer

    wall0 = time.time()
    deadline = wall0 + args.timeout_s
    width = mlp_width(args.state_mb)
    n_params = DEPTH * (width * width + width)
    os.makedirs(args.workdir, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    lh_kwargs = {
        k: v
        for k, v in (("join_timeout_ms", args.join_timeout_ms), ("heartbeat_timeout_ms", args.heartbeat_timeout_ms))
        if v is not None
    }
    lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=1, **lh_kwargs)
    run = Run(args, workdir, f"http://{LOOPBACK}:{lighthouse.address().rsplit(':', 1)[1]}", width, deadline)
    kills: list[tuple[float, float, int, Launch]] = []  # kill time, relaunch time, step, the new process
    notes: list[str] = []
    max_diff: float | None = None
    try:
        survivor, victim = run.spawn(0), run.spawn(1)
        for i in range(args.failures):
            target = round(args.steps * (i + 1) / (args.failures + 1))
            # kill group 1 once it has completed step `target` (if it rejoined later than that: its first step)
            _wait(
                run,
                f"replica group 1 to reach step {target}",
                partial(_reached, victim, target, survivor),
                survivor,
                victim,
            )
            if survivor.done():
                notes.append(
                    f"the survivor finished its {args.steps} steps before the failure due at step {target}: "
                    f"{len(kills)} of {args.failures} failures fit (raise --steps)"
                )
                break
            step = victim.steps()[-1]["step"]
            kill_t = time.time()
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(timeout=10)
            victim = run.spawn(1)
            kills.append((kill_t, victim.started, step, victim))
            # the next failure waits for this one to be over: the new group has completed a step
            _wait(
                run,
                "the relaunched replica group 1 to rejoin",
                partial(_reached, victim, 1, survivor),
                survivor,
                victim,
            )
            if not victim.steps():
                time.sleep(0.5)  # a step it was finishing
                victim.poll()
            if not victim.steps():
                notes.append(
                    f"the survivor finished its {args.steps} steps {time.time() - victim.started:.1f}s after the "
                    f"relaunch at step {step}, before the relaunched group completed a step: torchft trained on "
                    "with one group (min_replica_size=1), and with no live group left to heal from, the relaunched "
                    "one would train alone from step 0, so it was stopped (no rejoin_s, no final comparison; "
                    "raise --steps)"
                )
                break
        if victim.steps():  # the group 1 now running is in step with the survivor: both finish, then compare
            _wait(run, "both replica groups to finish", partial(_finished, survivor, victim), survivor, victim)
            survivor.proc.wait(timeout=10)
            victim.proc.wait(timeout=10)
            a, b = torch.load(survivor.final), torch.load(victim.final)
            max_diff = float((a - b).abs().max()) if a.shape == b.shape else math.inf
        else:
            _wait(run, "replica group 0 to finish", survivor.done, survivor)
        failures = [_failure_report(k, r, s, survivor, v) for k, r, s, v in kills]
        both = [e for e in survivor.steps() if e["n"] == 2]
        gaps = [y["t"] - x["t"] for x, y in zip(both, both[1:], strict=False) if y["step"] == x["step"] + 1]
    finally:
        run.kill_all()
        lighthouse.shutdown()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    stalls = [f["stall_s"] for f in failures if f["stall_s"] is not None]
    rejoins = [f["rejoin_s"] for f in failures if f["rejoin_s"] is not None]
    if len(stalls) < len(failures):
        notes.append("after some kill the survivor completed no step without the killed group (stall_s null)")
    if any(f["rejoin_s"] is not None and not f["healed"] for f in failures):
        notes.append("some relaunched group's first step did not heal from the survivor (healed false)")
    return {
        "tool": "torchft",
        "version": _torchft_version(),
        "failures": failures,
        "median_stall_s": _median(stalls),
        "median_rejoin_s": _median(rejoins),
        "final_max_abs_diff": max_diff,
        "state_mb": n_params * BYTES_PER_PARAM / 1e6,
        "param_count": n_params,
        "param_mb": n_params * 4 / 1e6,
        "model": f"Sequential of {DEPTH} Linear({width}, {width}), ReLU between; AdamW; batch {BATCH}; float32",
        "steps": args.steps,
        "step_s": _median(gaps),
        "pg_timeout_s": args.pg_timeout_s,
        "lighthouse": {"min_replicas": 1, **lh_kwargs},
        "torch": torch.__version__,
        "wall_s": time.time() - wall0,
        "note": "; ".join(notes) if notes else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER_FLAG]:
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--failures", type=int, default=3, help="how many times replica group 1 is killed (default 3)")
    p.add_argument("--steps", type=int, default=300, help="committed training steps (default 300)")
    p.add_argument(
        "--state-mb",
        type=float,
        default=100.7,
        help="parameters + AdamW state in MB (default 100.7: about 8.4M parameters)",
    )
    p.add_argument("--json", type=Path, help="where to write the JSON report")
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on the whole run (default 300)")
    p.add_argument(
        "--pg-timeout-s", type=float, default=5.0, help="ProcessGroupGloo's and the Manager's timeout (default 5)"
    )
    p.add_argument("--join-timeout-ms", type=int, help="Lighthouse join_timeout_ms (default: torchft's)")
    p.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        help="Lighthouse heartbeat_timeout_ms, how long it waits for a lost group's heartbeat (default: torchft's)",
    )
    p.add_argument("--workdir", default="/tmp/tft-bench", help="where the scratch directory goes")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, stderr)")
    args = p.parse_args(argv)
    if args.failures < 0 or args.steps < args.failures + 1:
        p.error("need --failures >= 0 and --steps > --failures")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the children are killed on the way out
    try:
        report = bench(args)
    except BenchError as e:
        print(f"recovery_torchft: {e}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")

    def secs(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}s"

    r = report
    diff = "n/a" if r["final_max_abs_diff"] is None else f"{r['final_max_abs_diff']:.3g}"
    print(
        f"torchft {r['version']}: {len(r['failures'])} failures, median stall {secs(r['median_stall_s'])}, "
        f"median rejoin {secs(r['median_rejoin_s'])}, final max |diff| {diff}, state {r['state_mb']:.1f} MB, "
        f"{r['steps']} steps, step {secs(r['step_s'])}, wall {r['wall_s']:.1f}s"
        + (f" (note: {r['note']})" if r["note"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
