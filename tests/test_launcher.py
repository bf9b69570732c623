"""The launcher (`phalanx run`), the other commands, and `phalanx.testing.run_world`.

Every test here starts real processes: `python -m phalanx run ...` for the
command line, `run_world` for the test helper. "spawn" jobs (`--backend gloo`)
whose scripts never call `phalanx.init` test the spawning supervisor alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import phalanx
from conftest import AVAILABLE
from phalanx.cli._run import split_target
from phalanx.testing import WorldFailed, run_world

LAUNCHERS = [pytest.param(b, marks=[] if b in AVAILABLE else pytest.mark.skip(reason=f"no {b} backend here"))
             for b in ("mpi", "gloo")]


def phalanx_cli(*args: str, cwd: Path | None = None, timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("argv,options,target", [
    (["-n", "2", "train.py", "-n", "5", "--lr", "0.1"], ["-n", "2"], ["train.py", "-n", "5", "--lr", "0.1"]),
    (["-n", "2", "--backend", "gloo", "-m", "pkg.mod", "--x", "-m"], ["-n", "2", "--backend", "gloo"],
     ["-m", "pkg.mod", "--x", "-m"]),
    (["--np=3", "-mpkg.mod", "a"], ["--np=3"], ["-m", "pkg.mod", "a"]),
    (["-n", "2", "--", "-weird.py"], ["-n", "2"], ["-weird.py"]),
    (["-n", "2", "--start-timeout", "5", "job.py", "--start-timeout"], ["-n", "2", "--start-timeout", "5"],
     ["job.py", "--start-timeout"]),
], ids=["script", "module", "glued-m", "double-dash", "start-timeout"])
def test_script_arguments_pass_through_untouched(argv: list[str], options: list[str], target: list[str]) -> None:
    assert split_target(argv) == (options, target)


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_a_raising_rank_ends_the_job_and_is_named_with_its_traceback(tmp_path: Path, backend: str) -> None:
    job = script(tmp_path, """\
        import phalanx
        phalanx.init()
        if phalanx.rank() == 1:
            raise ValueError("boom on rank 1")
        phalanx.barrier()  # rank 0 waits for rank 1, which never comes
    """)
    start = time.monotonic()
    out = phalanx_cli("run", "-n", "2", "--backend", backend, "--timeout", "30", str(job))
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr
    assert elapsed < 15, f"the job took {elapsed:.1f} s to end"
    report = out.stderr[out.stderr.index("phalanx run: rank"):]
    assert report.startswith("phalanx run: rank 1 failed first"), out.stderr
    assert "ValueError: boom on rank 1" in report
    assert f'File "{job}", line 4, in <module>' in report, report  # the user's frame, not the bootstrap's
    assert "_worker.py" not in report


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_a_killed_rank_is_named_with_its_signal(tmp_path: Path, backend: str) -> None:
    job = script(tmp_path, """\
        import os, time
        import phalanx
        phalanx.init()
        if phalanx.rank() == 1:
            os.kill(os.getpid(), 9)
        time.sleep(60)
    """)
    out = phalanx_cli("run", "-n", "3", "--backend", backend, str(job))
    assert out.returncode == 128 + 9, out.stderr
    assert "phalanx run: rank 1 failed first" in out.stderr, out.stderr
    assert "killed by signal 9 (SIGKILL)" in out.stderr, out.stderr
    assert "ranks 0, 2 stopped by" in out.stderr


KILLED_ON_CUE = """\
    import os, sys, time
    import phalanx
    phalanx.init()
    with open(os.path.join(sys.argv[1], f"up{phalanx.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    if phalanx.rank() == 1:
        while not os.path.exists(os.path.join(sys.argv[1], "go")):
            time.sleep(0.01)
        os.kill(os.getpid(), 9)
    time.sleep(60)
"""


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_the_rank_killed_first_is_named_even_when_the_launcher_looks_late(tmp_path: Path, backend: str) -> None:
    """Forced timing: the launcher is stopped (SIGSTOP) while rank 1 dies and for a second after. Hydra
    SIGKILLs every rank within a millisecond of one dying by a signal, even with -disable-auto-cleanup,
    so the launcher used to see all three end at once and named rank 0 (the lowest of equal times).
    Each rank now runs under a keeper (launch/_keeper.py) that turns its signal into an exit status,
    so nobody but the launcher stops the others."""
    job = script(tmp_path, KILLED_ON_CUE)
    launcher = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-n", "3", "--backend", backend, str(job),
                                 str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"up{r}").exists() for r in range(3)) and time.monotonic() < deadline:
            time.sleep(0.05)
        rank_1 = psutil.Process(int((tmp_path / "up1").read_text()))
        os.kill(launcher.pid, signal.SIGSTOP)
        try:
            (tmp_path / "go").touch()
            deadline = time.monotonic() + 10
            while _alive(rank_1) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.0)
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        _, err = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert "phalanx run: rank 1 failed first" in err, err
    assert "killed by signal 9 (SIGKILL)" in err and launcher.returncode == 128 + 9, err


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_every_rank(tmp_path: Path, backend: str, sig: int, code: int) -> None:
    if backend == "mpi" and "mpi" not in AVAILABLE:
        pytest.skip("no mpi backend here")
    pids = tmp_path / "pids"
    pids.mkdir()
    job = script(tmp_path, """\
        import os, sys, time
        rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]
        with open(os.path.join(sys.argv[1], rank), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    """)  # no phalanx.init: this tests the launcher alone
    launcher = subprocess.Popen([sys.executable, "-m", "phalanx", "run", "-n", "3", "--backend", backend,
                                 str(job), str(pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while len(list(pids.iterdir())) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    rank_pids = [int(p.read_text()) for p in pids.iterdir() if p.read_text()]
    assert len(rank_pids) == 3
    launcher.send_signal(sig)
    assert launcher.wait(timeout=10) == code
    launcher.communicate()
    time.sleep(0.2)
    alive = [pid for pid in rank_pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not alive, f"ranks survived the launcher: {alive}"


LATE_RANK = """\
    import os, time
    import phalanx
    rank = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ["OMPI_COMM_WORLD_RANK"])
    if rank == 1:
        time.sleep(60)  # rank 1 starts 60 s late: the others wait for it inside phalanx.init
    phalanx.init()
    phalanx.barrier()
"""
START_TIMEOUT = 4.0


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_a_rank_that_misses_the_start_timeout_ends_the_job_and_is_named(tmp_path: Path, backend: str) -> None:
    job = script(tmp_path, LATE_RANK)
    start = time.monotonic()
    out = phalanx_cli("run", "-n", "3", "--backend", backend, "--start-timeout", str(START_TIMEOUT), str(job))
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stderr
    assert elapsed < START_TIMEOUT + 6, f"the job took {elapsed:.1f} s to end"  # measured: 4.5 s (mpi and gloo)
    assert "phalanx run: rank 1 did not reach phalanx.init within the start timeout of 4 s" in out.stderr, out.stderr
    assert "ranks 0, 2 were waiting in phalanx.init for it" in out.stderr


def test_the_start_timeout_comes_from_the_environment(tmp_path: Path) -> None:
    job = script(tmp_path, LATE_RANK)
    out = phalanx_cli("run", "-n", "2", "--backend", "gloo", str(job), env={"PHALANX_START_TIMEOUT": "2"})
    assert out.returncode == 1 and "within the start timeout of 2 s" in out.stderr, out.stderr


@pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi backend here")
def test_the_start_timeout_is_not_applied_where_ranks_may_run_on_other_hosts(tmp_path: Path) -> None:
    # Ranks on other hosts cannot leave their markers in this host's job directory: naming a host
    # list makes the launcher assume they may, so a late rank here is not taken for a missing one.
    from phalanx.launch._mpi_flavor import find_mpiexec, mpiexec_flavor

    mpiexec = find_mpiexec(None)
    assert mpiexec is not None
    hosts = "--host localhost:2" if mpiexec_flavor(mpiexec).family == "openmpi" else "-hosts localhost"
    job = script(tmp_path, LATE_RANK.replace("time.sleep(60)", "time.sleep(3)"))
    out = phalanx_cli("run", "-n", "2", "--backend", "mpi", "--start-timeout", "1", f"--mpi-args={hosts}", str(job))
    assert out.returncode == 0, out.stderr


def test_a_job_that_never_calls_init_is_not_stopped_by_the_start_timeout(tmp_path: Path) -> None:
    job = script(tmp_path, "import time\ntime.sleep(2)\nprint('slept')\n")
    out = phalanx_cli("run", "-n", "2", "--backend", "gloo", "--start-timeout", "0.5", str(job))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("slept") == 2


@pytest.mark.parametrize("name,value", [("PHALANX_STOP_GRACE", "soon"), ("PHALANX_STOP_GRACE", "-1"),
                                        ("PHALANX_START_TIMEOUT", "0"), ("PHALANX_START_TIMEOUT", "ten")])
def test_a_malformed_launcher_setting_is_a_usage_error_naming_it(tmp_path: Path, name: str, value: str) -> None:
    job = script(tmp_path, "print('never runs')\n")
    out = phalanx_cli("run", "-n", "2", "--backend", "gloo", str(job), env={name: value})
    assert out.returncode == 2, out.stderr
    assert f"phalanx run: {name}={value!r} is not a number of seconds" in out.stderr
    assert "never runs" not in out.stdout


def test_a_bad_start_timeout_flag_is_a_usage_error(tmp_path: Path) -> None:
    out = phalanx_cli("run", "-n", "2", "--backend", "gloo", "--start-timeout", "0", str(script(tmp_path, "")))
    assert out.returncode == 2 and "--start-timeout 0: give a positive number of seconds" in out.stderr


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_log_dir_holds_each_ranks_output_and_the_console_shows_it_prefixed(tmp_path: Path, backend: str) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "hello.py").write_text(textwrap.dedent("""\
        import sys
        import phalanx
        phalanx.init()
        print(f"hello from {phalanx.rank()} argv={sys.argv[1:]} name={__name__}")
        print(f"error line from {phalanx.rank()}", file=sys.stderr)
    """))
    out = phalanx_cli("run", "-n", "2", "--backend", backend, "--log-dir", "logs",
                      "-m", "pkg.hello", "-n", "7", "--flag", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank.{rank}.log").read_text()
        assert f"hello from {rank} argv=['-n', '7', '--flag'] name=__main__\n" in text
        assert f"error line from {rank}\n" in text
        assert f"[{rank}] hello from {rank}" in out.stdout


def test_a_module_runs_as_main_with_its_arguments(tmp_path: Path) -> None:
    # One write per line: the ranks share the console, and print() writes piece by piece.
    (tmp_path / "tool.py").write_text("import os, sys\nos.write(1, f\"tool {os.environ['RANK']} {sys.argv[1:]}\\n\".encode())\n")
    out = phalanx_cli("run", "-n", "2", "--backend", "gloo", "-m", "tool", "--lr", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["tool 0 ['--lr', '3']", "tool 1 ['--lr', '3']"]


def test_a_missing_script_is_a_usage_error() -> None:
    out = phalanx_cli("run", "-n", "2", "no_such_script.py")
    assert out.returncode == 2
    assert "no such script: no_such_script.py" in out.stderr


def test_info_shows_the_installation_as_text_and_json() -> None:
    text = phalanx_cli("info")
    assert text.returncode == 0, text.stderr
    assert "phalanx:" in text.stdout and phalanx.__version__ in text.stdout
    data = json.loads(phalanx_cli("info", "--json").stdout)
    for key in ("python", "numpy", "torch", "mpi4py", "mpiexec", "phalanx run default backend", "settings"):
        assert key in data, key


@pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi backend here")
def test_demo_smoke_reports_agreement() -> None:
    out = phalanx_cli("demo", "--smoke")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK: 2 processes agreed on every collective (backend mpi)" in out.stdout


# -- run_world -------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankReport:  # defined in the test module: must unpickle in the test process
    rank: int
    size: int
    total: float


def report_rank(scale: float) -> RankReport:
    total = phalanx.allreduce(np.array([scale * (phalanx.rank() + 1)]))[0]
    return RankReport(phalanx.rank(), phalanx.size(), float(total))


def fail_on_rank_1() -> None:
    if phalanx.rank() == 1:
        raise ValueError("rank 1 gives up")
    phalanx.barrier()


def sleep_forever(pid_dir: str) -> None:
    Path(pid_dir, str(phalanx.rank())).write_text(str(os.getpid()))
    time.sleep(600)


WORLDS = [("local", 1)] + [(b, n) for b in ("mpi", "gloo") for n in (1, 2, 3)]


@pytest.mark.parametrize("backend,n", [pytest.param(b, n, id=f"{b}-{n}", marks=[] if b in AVAILABLE else
                                                    pytest.mark.skip(reason=f"no {b} backend here"))
                                       for b, n in WORLDS])
def test_run_world_returns_each_ranks_value(backend: str, n: int) -> None:
    results = run_world(report_rank, n, backend, args=(2.0,))
    total = 2.0 * n * (n + 1) / 2
    assert results == [RankReport(r, n, total) for r in range(n)]


@pytest.mark.parametrize("backend", LAUNCHERS)
def test_run_world_failure_carries_every_ranks_output(backend: str) -> None:
    with pytest.raises(WorldFailed) as failed:
        run_world(fail_on_rank_1, 2, backend, op_timeout=10)
    error = failed.value
    assert error.returncode == 1 and not error.timed_out
    assert "ValueError: rank 1 gives up" in error.outputs[1]
    assert "phalanx run: rank 1 failed first" in error.report
    assert "--- rank 0 output ---" in str(error) and "--- rank 1 output ---" in str(error)


@pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi backend here")
def test_run_world_timeout_kills_every_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(sleep_forever, 2, "mpi", timeout=3, args=(str(tmp_path),))
    assert failed.value.timed_out and failed.value.returncode is None
    assert time.monotonic() - start < 12
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2
    time.sleep(0.2)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_run_world_rejects_a_function_ranks_cannot_import() -> None:
    with pytest.raises(phalanx.UnsupportedArgumentError, match="module level") as error:
        run_world(lambda: 1, 1, "local")
    assert isinstance(error.value, TypeError) and "run_world(fn=" in str(error.value)


def test_run_world_rejects_more_than_one_local_rank() -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match="exactly one rank") as error:
        run_world(report_rank, 2, "local")
    assert isinstance(error.value, ValueError) and "run_world(n=2, backend='local')" in str(error.value)
