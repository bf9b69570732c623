"""Running Horovod jobs: horovodrun's command line on ``phalanx run``, and ``phalanx.horovod.run``.

* each horovodrun flag phalanx takes means what it means there, in phalanx's terms (parsed,
  no process started), and every one it does not take is refused naming it and why;
* ``phalanx run -np 2 -H localhost:2 --gloo python job.py`` and ``--mpi`` run the job on one host;
  ``-H h0:1,h1:1 -p 22 -i KEY`` runs it on two simulated hosts through ssh with that port and key;
* ``phalanx.horovod.run`` returns every rank's result in rank order (gloo and mpi, a test-module
  function, a lambda), raises a RuntimeError naming the failing rank with its traceback, and
  refuses arguments Horovod refuses or phalanx cannot honour.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import phalanx
import phalanx.horovod as horovod
from conftest import AVAILABLE
from helpers import requires_hosts
from phalanx.launch._horovodrun import UNSUPPORTED, strip_python
from phalanx.launch._options import job_from_args, run_parser, split_target

JOB = """\
import os, socket
import numpy as np
import phalanx

phalanx.init()
total = phalanx.allreduce(np.array([phalanx.rank() + 1.0]))
print(f"RESULT rank={phalanx.rank()} size={phalanx.size()} backend={phalanx.backend().name} "
      f"host={socket.gethostname()} sum={total[0]:g} timeout={os.environ.get('PHALANX_TIMEOUT')}", flush=True)
"""

needs_gloo = pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here (see `phalanx info`)")
needs_mpi = pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi backend here (see `phalanx info`)")


def job_of(*argv: str) -> phalanx.launch.Launch:
    options, target = split_target(list(argv))
    return job_from_args(run_parser().parse_args(options), strip_python(target))


def phalanx_run(*args: str, cwd: Path | None = None, timeout: float = 60,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", "run", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def results(stdout: str) -> dict[int, dict[str, str]]:
    found = {}
    for line in stdout.splitlines():
        if "RESULT " in line:
            fields = dict(w.split("=", 1) for w in line.split("RESULT ", 1)[1].split())
            found[int(fields["rank"])] = fields
    return found


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(JOB)
    return path


# -- horovodrun's flags, parsed ----------------------------------------------------------------
def test_np_H_and_gloo_are_n_hosts_and_backend(job: Path) -> None:
    launch = job_of("-np", "2", "-H", "localhost:2", "--gloo", "python", str(job), "--lr", "0.1")
    assert (launch.n, launch.backend, [str(h) for h in launch.hosts]) == (2, "gloo", ["localhost:2"])
    assert launch.target == [str(job), "--lr", "0.1"]  # horovodrun's "python" is dropped, the rest kept
    assert job_of("--num-proc", "3", "--mpi", str(job)).backend == "mpi"


def test_hostfile_takes_horovodruns_host_slots_lines(job: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    for flag in ("-hostfile", "--hostfile"):
        launch = job_of("-np", "2", flag, str(hostfile), "--gloo", str(job))
        assert [str(h) for h in launch.hosts] == ["localhost:2"]


def test_ssh_port_and_identity_go_to_ssh_or_the_rsh_given(job: Path) -> None:
    launch = job_of("-np", "2", "-H", "localhost:2", "-p", "2222", "-i", "/keys/id", "--gloo", str(job))
    assert launch.rsh == "ssh -p 2222 -i /keys/id"
    launch = job_of("-np", "2", "-H", "localhost:2", "--ssh-port", "2222", "--rsh", "myssh -q", "--gloo", str(job))
    assert launch.rsh == "myssh -q -p 2222"
    assert job_of("-np", "2", "-p", "2222", "--gloo", str(job)).rsh is None  # one host: no ssh, as horovodrun


def test_interface_output_timeouts_timeline_and_cache_flags_map_to_phalanx_settings(job: Path, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    monkeypatch.delenv("PHALANX_START_TIMEOUT", raising=False)
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "45")
    launch = job_of("-np", "2", "--gloo", "--network-interface", "lo", "--output-filename", str(tmp_path / "out"),
                    "--gloo-timeout-seconds", "7", "--timeline-filename", "t.json", "--timeline-mark-cycles",
                    "--disable-cache", "--verbose", str(job))
    assert (launch.iface, launch.log_dir, launch.timeout, launch.start_timeout) == ("lo", str(tmp_path / "out"),
                                                                                    7.0, 45.0)
    assert launch.env == {"HOROVOD_TIMELINE": os.path.abspath("t.json"), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    assert job_of("-np", "1", "--gloo", "--start-timeout", "5", str(job)).start_timeout == 5.0
    assert job_of("-np", "1", "--gloo", "--network-interfaces", "lo,lo", str(job)).iface == "lo"


@pytest.mark.parametrize("argv,words", [
    (["--gloo", "--mpi"], ["both --gloo and --mpi"]),
    (["--gloo", "--backend", "mpi"], ["--gloo and --backend mpi disagree"]),
    (["--network-interface", "eth0,eth1"], ["eth0, eth1", "one interface"]),
    (["--timeline-mark-cycles"], ["--timeline-mark-cycles", "--timeline-filename"]),
], ids=["gloo-and-mpi", "gloo-and-backend-mpi", "two-interfaces", "mark-cycles-without-file"])
def test_conflicting_horovodrun_flags_are_refused_naming_them(job: Path, argv: list[str], words: list[str]) -> None:
    with pytest.raises(phalanx.LaunchError) as refused:
        job_of("-np", "2", *argv, str(job))
    assert all(w in str(refused.value) for w in words), refused.value


@pytest.mark.parametrize("flag", sorted(UNSUPPORTED))
def test_unsupported_horovodrun_flags_are_refused_with_the_reason(flag: str) -> None:
    with pytest.raises(phalanx.LaunchError) as refused:
        split_target(["-np", "2", flag, "64", "train.py"])
    text = str(refused.value)
    assert text.startswith(f"phalanx run {flag}: horovodrun's option is not supported: ") and len(text) > 80, text


def test_the_command_line_says_which_flag_is_unsupported_and_exits_2(job: Path) -> None:
    out = phalanx_run("-np", "2", "--fusion-threshold-mb", "64", "python", str(job), timeout=30)
    assert out.returncode == 2
    assert "phalanx run --fusion-threshold-mb: horovodrun's option is not supported" in out.stderr, out.stderr
    assert "bucket_cap_mb" in out.stderr and "unrecognized arguments" not in out.stderr


def test_a_python_first_word_is_dropped_and_other_words_kept() -> None:
    assert strip_python(["python", "train.py", "-x"]) == ["train.py", "-x"]
    assert strip_python(["/usr/bin/python3", "-u", "train.py"]) == ["train.py"]
    assert strip_python(["python", "-m", "pkg.train"]) == ["-m", "pkg.train"]
    assert strip_python(["-m", "pkg"]) == ["-m", "pkg"] and strip_python(["train.py"]) == ["train.py"]


# -- horovodrun's command lines, run -----------------------------------------------------------
@needs_gloo
def test_np_2_H_localhost_2_gloo_runs_both_ranks_here(job: Path) -> None:
    out = phalanx_run("-np", "2", "-H", "localhost:2", "--gloo", "--gloo-timeout-seconds", "20", "python", str(job))
    assert out.returncode == 0, out.stderr
    found = results(out.stdout)
    assert sorted(found) == [0, 1]
    assert all(f["backend"] == "gloo" and f["sum"] == "3" and f["timeout"] == "20.0" for f in found.values()), found


@needs_mpi
def test_np_2_mpi_verbose_output_filename_writes_each_ranks_log(job: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    out = phalanx_run("-np", "2", "--mpi", "--verbose", "--disable-cache", "--output-filename", str(logs),
                      "python", str(job))
    assert out.returncode == 0, out.stderr
    assert "phalanx run: 2 ranks of" in out.stderr and "on backend mpi" in out.stderr, out.stderr
    assert f"each rank's output: {logs}/rank.<r>.log" in out.stderr
    for r in (0, 1):
        fields = results((logs / f"rank.{r}.log").read_text())[r]
        assert fields["backend"] == "mpi" and fields["sum"] == "3", fields


@requires_hosts
@needs_gloo
def test_H_h0_1_h1_1_with_ssh_port_and_key_runs_a_rank_on_each_simulated_host(job: Path, tmp_path: Path) -> None:
    """The ssh options reach the remote shell (a wrapper logs its words, then runs the hosts' ssh)."""
    from phalanx.testing import simulated_hosts

    with simulated_hosts(2) as hosts:
        log = tmp_path / "rsh.log"
        rsh = tmp_path / "rsh"
        rsh.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {hosts.rsh} "$@"\n')
        rsh.chmod(0o755)
        argv = [sys.executable, "-m", "phalanx", "run", "-np", "2", "-H", "h0:1,h1:1", "--gloo", "-p", "22",
                "-i", str(tmp_path / "id_key"), "--rsh", str(rsh), "--start-timeout", "60", "python", str(job)]
        done = hosts.run(0, argv, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    found = results(done.stdout)
    assert {r: f["host"] for r, f in found.items()} == {0: "h0", 1: "h1"}, done.stdout
    assert all(f["sum"] == "3" for f in found.values())
    assert f"-p 22 -i {tmp_path / 'id_key'} " in log.read_text(), log.read_text()


# -- phalanx.horovod.run ---------------------------------------------------------------------
def rank_and_sum(scale: float, *, offset: float = 0.0) -> tuple[int, float]:
    import numpy as np

    phalanx.init()
    return phalanx.rank(), float(phalanx.allreduce(np.array([scale * (phalanx.rank() + 1) + offset]))[0])


def raise_on_rank_1() -> None:
    phalanx.init()
    if phalanx.rank() == 1:
        raise ValueError("boom on rank 1")
    phalanx.barrier()


@pytest.mark.parametrize("use", [pytest.param("use_gloo", marks=needs_gloo), pytest.param("use_mpi", marks=needs_mpi)])
def test_run_returns_every_ranks_result_in_rank_order(use: str) -> None:
    got = horovod.run(rank_and_sum, args=(2.0,), kwargs={"offset": 1.0}, num_proc=2, start_timeout=60, **{use: True})
    assert got == [(0, 8.0), (1, 8.0)]


@needs_gloo
def test_run_takes_a_lambda_and_a_closure() -> None:
    pytest.importorskip("cloudpickle")
    base = 40
    assert horovod.run(lambda: base + 2, num_proc=2, use_gloo=True) == [42, 42]


@needs_mpi
def test_a_rank_that_raises_is_a_runtime_error_naming_it_with_its_traceback() -> None:
    with pytest.raises(RuntimeError) as failed:
        horovod.run(raise_on_rank_1, num_proc=2, use_mpi=True)
    assert isinstance(failed.value, phalanx.JobFailedError)
    text = str(failed.value)
    assert "rank 1 raised ValueError: boom on rank 1" in text, text
    assert f'File "{__file__}"' in text and "in raise_on_rank_1" in text, text
    assert "_runner.py" not in text  # the traceback starts at the user's function


def test_np_is_the_deprecated_name_of_num_proc() -> None:
    with pytest.raises(phalanx.InvalidArgumentError), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        horovod.run(rank_and_sum, np=0)  # np=0 replaces num_proc, and is then refused: nothing starts
    assert any(issubclass(w.category, DeprecationWarning) and "num_proc" in str(w.message) for w in caught)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"hosts": "h0:1", "hostfile": "hosts"}, ValueError, ["give one of them"]),
    ({"use_gloo": True, "use_mpi": True}, ValueError, ["choose one backend"]),
    ({"num_proc": 0}, ValueError, ["num_proc=0"]),
    ({"min_num_proc": 1}, TypeError, ["min_num_proc=1", "--max-restarts"]),
    ({"max_np": 4}, TypeError, ["max_np=4", "elastic"]),
    ({"executable": "/usr/bin/false"}, TypeError, ["executable='/usr/bin/false'", sys.executable]),
    ({"start_timeout": -1}, ValueError, ["start_timeout=-1"]),
    ({"ssh_port": "x"}, ValueError, ["ssh_port='x'"]),
], ids=["hosts-and-hostfile", "gloo-and-mpi", "no-ranks", "elastic-min", "elastic-max-np", "other-python",
        "negative-start-timeout", "bad-port"])
def test_run_refuses_bad_arguments_before_starting_anything(kwargs: dict, error: type, words: list[str]) -> None:
    with pytest.raises(error) as refused:
        horovod.run(rank_and_sum, **kwargs)
    assert isinstance(refused.value, phalanx.PhalanxError)
    assert all(w in str(refused.value) for w in words), refused.value


@requires_hosts
@needs_gloo
def test_run_with_hosts_runs_a_rank_on_each_simulated_host(tmp_path: Path) -> None:
    """hosts="h0:1,h1:1" through ssh (here the hosts' ssh stand-in, first on PATH), from host 0."""
    from phalanx.testing import simulated_hosts

    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent("""
        import socket, sys
        import phalanx.horovod as horovod

        def where():
            import phalanx
            phalanx.init()
            return phalanx.rank(), socket.gethostname(), phalanx.size()

        print("GOT", horovod.run(where, num_proc=2, hosts="h0:1,h1:1", use_gloo=True, start_timeout=60))
    """))
    with simulated_hosts(2) as hosts:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {hosts.rsh} "$@"\n')
        (bin_dir / "ssh").chmod(0o755)
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
        done = hosts.run(0, [sys.executable, str(driver)], capture_output=True, text=True, timeout=90, env=env,
                         cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GOT [(0, 'h0', 2), (1, 'h1', 2)]" in done.stdout, done.stdout + done.stderr
    assert not list(tmp_path.glob(".phalanx-run-*")), "the call directory was left behind"
