"""An MPI world that re-forms in place: ``phalanx run --backend mpi --max-restarts K`` (or ``--min-ranks M``).

Under Open MPI 5 the launcher runs ``mpirun --with-ft ulfm`` and ``fit(elastic=True)`` keeps the survivors:
MPI itself tells them of a lost rank, they shrink the communicator to the live processes, and spawn a
replacement per lost rank while ``--max-restarts`` allow (``phalanx/_epochs_ulfm.py``). The same training
program as ``test_recovery.py`` (gloo), the same checks. Elsewhere (MPICH) an MPI job restarts whole, and the
launcher says so. Run under Open MPI by ``.ci/run`` (``.venv-ompi``); under MPICH only the last test runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import AVAILABLE
from phalanx.launch._mpi_flavor import find_mpiexec, mpiexec_flavor
from test_recovery import REPLACED as GLOO_REPLACED
from test_recovery import (
    SIGKILL,
    SIGSTOP,
    TRAIN,
    Job,
    _equal_to_reference,
    _final,
    _finished,
    _initial,
    _killed,
    _references,
    _stalls,
)
from test_recovery import _run as _run_on

pytestmark = pytest.mark.skipif("mpi" not in AVAILABLE or "gloo" not in AVAILABLE, reason="needs MPI and torch")


def _ulfm() -> bool:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return False
    flavor = mpiexec_flavor(mpiexec)
    return flavor.family == "openmpi" and flavor.version[:1] >= (5,)


ULFM = _ulfm()
IN_FLIGHT = os.path.join(os.path.dirname(__file__), "program_lost_in_flight.py")
needs_ulfm = pytest.mark.skipif(not ULFM, reason="needs Open MPI 5 (ULFM); .ci/run runs this file under .venv-ompi")


def _run(marks: str, n: int, flags: list[str], env: dict[str, str], timeout: float, program: str = TRAIN) -> Job:
    return _run_on(marks, program, n, flags, env, timeout, backend="mpi")


def _left_behind(marks: str) -> list[str]:
    """This job's processes still running (their command line names the marks folder in the environment)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"MARKS={marks}".encode() in f.read().split(b"\0"):
                        out.append(pid)
            except OSError:
                continue
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    if not ULFM:
        pytest.skip("needs Open MPI 5 (ULFM)")
    root = tmp_path_factory.mktemp("recovery-mpi")
    out = _references(root)
    out["replaced"] = _run(str(root / "replaced"), 4, ["--timeout", "10", "--max-restarts", "3"],
                           {"KILLS": json.dumps([[50, 1, SIGKILL], [120, 0, SIGKILL], [200, 2, SIGKILL]])}, 300)
    out["shrunk"] = _run(str(root / "shrunk"), 4, ["--timeout", "10", "--min-ranks", "2"],
                         {"KILLS": json.dumps([[30, 3, SIGKILL], [60, 0, SIGKILL]]), "STEPS": "100"}, 200)
    out["floor"] = _run(str(root / "floor"), 3, ["--timeout", "10", "--min-ranks", "2"],
                        {"KILLS": json.dumps([[10, 1, SIGKILL], [20, 0, SIGKILL]]), "STEPS": "100"}, 200)
    out["stalled"] = _run(str(root / "stalled"), 3, ["--timeout", "3", "--min-ranks", "2"],
                          {"KILLS": json.dumps([[20, 1, SIGSTOP]]), "STEPS": "100"}, 200)
    # one budget: a replacement in place (step 10), a whole restart after a stall (step 20); the restarted job's
    # kill (step 40) finds --max-restarts 2 used up, and the survivors go on without a replacement
    out["budget"] = _run(str(root / "budget"), 3, ["--timeout", "3", "--max-restarts", "2"],
                         {"KILLS": json.dumps([[10, 1, SIGKILL], [20, 1, SIGSTOP], [40, 2, SIGKILL]]), "STEPS": "100"},
                         200)
    out["in_flight"] = _run(str(root / "in-flight"), 5, ["--timeout", "10", "--min-ranks", "2"], {"PHALANX_CHECK": "0"},
                            120, program=IN_FLIGHT)
    return out


def _reference(jobs: dict[str, Job], steps: int) -> Any:
    return _final(jobs[f"reference-{steps}"].files("final-*.pt")[0])


REPLACED = {
    **{name: GLOO_REPLACED[name] for name in ("exits_0_without_a_whole_restart", "survivors_keep_their_pids",
                                               "rank_0_is_among_the_killed")},  # as on gloo
    "three_replacements_join_in_the_epoch_of_the_loss": lambda job: (
        len(job.pids_started() - _initial(job)) == 3 and len(job.kills()) == 3
        and _finished(job) - _initial(job) == job.pids_started() - _initial(job) - _killed(job)
        and all(d["joined"] for d in job.done() if d["pid"] not in _initial(job))
        and job.output.count("spawned 1 replacement(s)") == 3),
    "every_finisher_ends_in_epoch_3_of_4_ranks": lambda job: (
        len(job.done()) == 4 and {(d["size"], d["epoch"]) for d in job.done()} == {(4, 3)}),
    "a_replacement_keeps_the_slot_of_the_rank_it_replaces": lambda job: (
        sorted(d["slot"] for d in job.done()) == [0, 1, 2, 3]),
    "nothing_is_left_behind": lambda job: not _left_behind(job.marks),
}


@needs_ulfm
@pytest.mark.parametrize("behaviour", sorted(REPLACED))
def test_mpi_killed_ranks_are_replaced_in_place_under_ulfm(jobs: dict[str, Job], behaviour: str) -> None:
    job = jobs["replaced"]
    assert REPLACED[behaviour](job), job.output[-4000:]


@needs_ulfm
def test_mpi_killed_ranks_are_replaced_in_place_stall_at_most_13_s(jobs: dict[str, Job]) -> None:
    """A shrink and a spawned replacement take ~3.5 s here (benchmarks/README.md); gloo's bound holds."""
    stalls = _stalls(jobs["replaced"])
    assert len(stalls) == 3 and max(stalls) <= 13.0, (stalls, jobs["replaced"].output[-3000:])


@needs_ulfm
def test_mpi_killed_ranks_are_replaced_in_place_equal_to_the_uninterrupted_run(jobs: dict[str, Job]) -> None:
    _equal_to_reference(jobs["replaced"], _reference(jobs, 300))


@needs_ulfm
def test_mpi_min_ranks_shrinks_in_place_to_3_then_2_ranks_equal_to_the_uninterrupted_run(jobs: dict[str, Job]) -> None:
    job = jobs["shrunk"]
    assert job.code == 0 and "restart 1 of" not in job.output, job.output[-3000:]
    assert {(d["size"], d["epoch"]) for d in job.done()} == {(2, 2)}, job.output[-3000:]
    assert _finished(job) == _initial(job) - _killed(job)
    _equal_to_reference(job, _reference(jobs, 100))


@needs_ulfm
def test_mpi_fewer_survivors_than_min_ranks_end_with_quorum_lost_and_nothing_left_behind(jobs: dict[str, Job]) -> None:
    job = jobs["floor"]
    assert job.code != 0 and "QuorumLostError" in job.output and "fewer than --min-ranks 2" in job.output, \
        job.output[-3000:]
    assert not job.done() and not _left_behind(job.marks)


@needs_ulfm
def test_mpi_a_stalled_rank_ends_the_job_within_the_timeout_naming_why(jobs: dict[str, Job]) -> None:
    """MPI cannot remove a live process from a communicator: the survivors' shrink waits the timeout + 5 s,
    then every rank ends, saying so (gloo's launcher kills the stalled rank and goes on instead)."""
    job = jobs["stalled"]
    assert job.code != 0 and "stalled outside MPI" in job.output, job.output[-3000:]
    assert job.seconds < 60 and not job.done() and not _left_behind(job.marks), (job.seconds, job.output[-3000:])


@needs_ulfm
def test_mpi_replacements_in_place_and_whole_restarts_share_one_max_restarts_budget(jobs: dict[str, Job]) -> None:
    job = jobs["budget"]
    assert job.code == 0 and "restart 1 of 2" in job.output and "restart 2 of" not in job.output, job.output[-3000:]
    assert job.output.count("spawned 1 replacement(s)") == 1, job.output[-3000:]  # in the first attempt only
    assert {(d["size"], d["epoch"]) for d in job.done()} == {(2, 1)}, job.output[-3000:]  # the restart: 3 -> 2
    _equal_to_reference(job, _reference(jobs, 100))  # the restart trained from step 0 again (no checkpoint)


@needs_ulfm
@pytest.mark.parametrize("what", ["bucket", "handle", "group"])
def test_mpi_a_peer_lost_while_a_polled_operation_is_in_flight_raises_rank_failed_and_the_survivors_reform(
        jobs: dict[str, Job], what: str) -> None:
    """A gradient bucket's allreduce polled from a later backward hook, and ``handle.test()``: the failure MPI
    reports there (``MPI_ERR_REVOKED``, ``MPI_ERR_PROC_FAILED``) is a RankFailedError, so fit(elastic=True)
    re-forms (``tests/program_lost_in_flight.py``); never the transport's own error, which ended the job. A
    group's call waiting on a rank that re-forms the world stops at once: the group is revoked with it."""
    job = jobs["in_flight"]
    every = [json.loads(open(path).read()) for path in job.files("in-flight-*.json")]  # what each rank saw
    seen = [one for one in every if what in one]  # the survivors of this part (the lost rank wrote none)
    finished = [one for one in every if "end" in one]
    assert job.code == 0 and len(seen) == {"bucket": 4, "handle": 3, "group": 2}[what], job.output[-3000:]
    for one in seen:
        assert one[what].startswith("phalanx._errors.RankFailedError: phalanx."), one.get(what + "-trace", one)
        assert one[what + "-zero_grad"] == "ok", one  # as fit does: the open reduction of a broken world is dropped
    assert len(finished) == 2 and all(one["end"] == [3, 2, 2.0] and one["same-after-step"] for one in finished)
    if what == "group":  # rank 0 waited in the group's call on rank 1: re-forming revoked it (the timeout is 10 s)
        assert max(one["group-seconds"] for one in seen) < 5.0, seen


@needs_ulfm
def test_mpi_horovodrun_min_np_resets_in_place_after_a_killed_rank(tmp_path: Any) -> None:
    """hvd.elastic on mpi: ``horovodrun --mpi -np 3 --min-np 2``, as test_horovod_elastic.py runs on gloo."""
    from test_horovod_elastic import reset_in_place

    reset_in_place(str(tmp_path), "mpi")


@needs_ulfm
def test_mpi_in_place_forwards_every_phalanx_variable_to_every_host_and_names_them_for_replacements(
        tmp_path: Any) -> None:
    """Open MPI forwards only the variables named with ``-x``; a replacement spawned on another host gets
    the same ones from the first survivor (``PHALANX_FORWARDED``, read by ``_epochs_ulfm.start_early``)."""
    from phalanx.launch import Launch
    from phalanx.launch._mpiexec import mpi_command

    env = {"PATH": os.environ["PATH"], "PHALANX_TEST_SETTING": "1"}
    job = Launch(n=4, backend="mpi", target=["train.py"], hosts="h0:2,h1:2", max_restarts=1)
    cmd, _ = mpi_command(job, env, str(tmp_path))
    forwarded = {cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-x"}
    assert "--with-ft" in cmd and {"PHALANX_TEST_SETTING", "PHALANX_ELASTIC", "PHALANX_FORWARDED"} <= forwarded, cmd
    assert set(env["PHALANX_FORWARDED"].split(",")) == forwarded, env["PHALANX_FORWARDED"]


@pytest.mark.skipif(ULFM, reason="under Open MPI 5 the world re-forms in place (the tests above)")
def test_mpi_without_ulfm_restarts_whole_and_the_launcher_says_so(tmp_path: Any) -> None:
    script = tmp_path / "ok.py"
    script.write_text("import phalanx\nphalanx.init()\nphalanx.barrier()\n")
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "2", "--backend", "mpi", "--max-restarts", "1",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "an MPI job restarts whole after a failure (re-forming in place needs Open MPI 5's ULFM" in done.stderr
