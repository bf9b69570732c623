"""Recovery in place: a gloo job that outlives its ranks (``fit(elastic=True)``, ``phalanx.reform``).

Each job runs once (a module fixture) and every behaviour is a check of what it left behind:

* **replaced** — 4 ranks, ``fit(elastic=True, global_batch_size=24)``, 300 steps of an MLP with Adam in
  float64, ``--timeout 10 --max-restarts 3``; the ranks 1, 0 and 2 of the moment are SIGKILLed at steps
  50, 120 and 200 (or the first step after, once the world is back at 4 ranks). The job exits 0 without a whole restart, the two untouched processes keep their
  PIDs, three replacements join and finish, at most 13 s pass from a kill to the survivors' next
  completed step, and every final parameter equals the uninterrupted run's (one process) to 1e-9.
* **shrunk** — ``--max-restarts 0 --min-ranks 2``, two kills: it finishes at 3 and then 2 ranks, equal.
* **stalled** — a rank SIGSTOPped (it never exits by itself): the survivors time out, the launcher kills
  it after the timeout, the job finishes on 2 ranks, equal.
* **sharded** — ``shard="gradients"``, ``checkpoint_every=10``: a rank killed at step 35 (its optimizer shard
  is lost with it); the survivors reload the step-30 checkpoint in process, a replacement joins, equal.
* **floor** — 3 ranks with ``--min-ranks 2`` and two kills: the survivor ends with QuorumLostError naming
  ``--min-ranks``; the job exits non-zero and leaves no process behind.
* **own loop** — ``phalanx.reform()`` in a loop of the user's (``tests/program_reform.py``): the error
  names the fix, the epoch is renumbered, a handle and a group of the old epoch are refused, the
  ``on_reform`` callback runs, then an object registered after it (one collected before never does).
* **one contract** — in *replaced*, each re-formation rebinds the sampler, fit's optimizer and a later
  callback in registration order; in *sharded*, the optimizer does not register (fit releases and wraps it).
* **own loop grows** — the same loop under ``--max-restarts 1``: the launcher starts a replacement,
  ``phalanx.replacement_waiting()`` turns True on every rank at the same iteration, ``reform()``
  admits it (epoch 2 of 3), it receives the count from rank 0 and all three finish.
* without a launcher that re-forms, ``reform()`` is a UsageError naming the fix (a world of one).

Figures (the stalls, the largest difference) are printed with ``-s``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from conftest import AVAILABLE

pytestmark = pytest.mark.skipif("gloo" not in AVAILABLE, reason="needs the gloo backend (torch)")

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "program_recovery.py")
LOOP = os.path.join(HERE, "program_reform.py")
SIGKILL, SIGSTOP = 9, 19


class Job:
    """One ``phalanx run`` of a test program, and what its processes left in ``marks``."""

    def __init__(self, marks: str, code: int, output: str, seconds: float) -> None:
        self.marks, self.code, self.output, self.seconds = marks, code, output, seconds

    def files(self, pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(self.marks, pattern)))

    def done(self) -> list[dict[str, Any]]:
        out = []
        for path in self.files("done-*.json"):
            with open(path) as f:
                out.append(dict(json.load(f), pid=int(path.rsplit("-", 1)[1].split(".")[0])))
        return out

    def pids_started(self) -> set[int]:
        return {int(p.rsplit("-", 1)[1]) for p in self.files("steps-*")}

    def steps(self, pid: int) -> list[tuple[int, float, int, int, int]]:
        with open(os.path.join(self.marks, f"steps-{pid}")) as f:
            return [(int(a), float(b), int(c), int(d), int(e)) for a, b, c, d, e in (line.split() for line in f)]

    def kills(self) -> list[dict[str, Any]]:
        out = []
        for path in self.files("kill-*"):
            with open(path) as f:
                out.append(dict(json.load(f), step=int(os.path.basename(path).split("-")[1])))
        return sorted(out, key=lambda k: k["time"])


def _run(marks: str, program: str, n: int, flags: list[str], env: dict[str, str], timeout: float,
         backend: str = "gloo") -> Job:
    os.makedirs(marks, exist_ok=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", backend, *flags, program],
                          capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MARKS=marks, **env))
    return Job(marks, done.returncode, done.stdout + done.stderr, time.monotonic() - start)


def _references(root: Any) -> dict[str, Job]:
    """The uninterrupted runs (a world of one) of 300 and 100 steps: ``reference-300``, ``reference-100``."""
    out: dict[str, Job] = {}
    for name, steps in (("reference-300", 300), ("reference-100", 100)):
        marks = str(root / name)
        os.makedirs(marks)
        subprocess.run([sys.executable, TRAIN], check=True, timeout=120, env=dict(
            os.environ, OMP_NUM_THREADS="1", MARKS=marks, STEPS=str(steps)))
        out[name] = Job(marks, 0, "", 0.0)
    return out


def _final(path: str) -> Any:
    import torch

    return torch.load(path)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("recovery")
    out = _references(root)
    out["replaced"] = _run(str(root / "replaced"), TRAIN, 4, ["--timeout", "10", "--max-restarts", "3"],
                           {"KILLS": json.dumps([[50, 1, SIGKILL], [120, 0, SIGKILL], [200, 2, SIGKILL]]), "FULL": "4"}, 300)
    out["shrunk"] = _run(str(root / "shrunk"), TRAIN, 4, ["--timeout", "10", "--max-restarts", "0", "--min-ranks", "2"],
                         {"KILLS": json.dumps([[30, 3, SIGKILL], [60, 0, SIGKILL]]), "STEPS": "100"}, 200)
    out["stalled"] = _run(str(root / "stalled"), TRAIN, 3, ["--timeout", "3", "--min-ranks", "2"],
                          {"KILLS": json.dumps([[20, 1, SIGSTOP]]), "STEPS": "100"}, 200)
    out["floor"] = _run(str(root / "floor"), TRAIN, 3, ["--timeout", "10", "--min-ranks", "2"],
                        {"KILLS": json.dumps([[10, 1, SIGKILL], [20, 0, SIGKILL]]), "STEPS": "100"}, 200)
    out["own loop"] = _run(str(root / "loop"), LOOP, 3, ["--timeout", "10", "--min-ranks", "1"], {}, 120)
    out["own loop grows"] = _run(str(root / "loop-grows"), LOOP, 3, ["--timeout", "10", "--max-restarts", "1"],
                                 {"SLOW": "1"}, 120)
    out["sharded"] = _run(str(root / "sharded"), TRAIN, 4, ["--timeout", "10", "--max-restarts", "1", "--min-ranks", "2"],
                          {"KILLS": json.dumps([[35, 2, SIGKILL]]), "STEPS": "100", "SHARD": "gradients",
                           "CKPT": str(root / "sharded-ckpt"), "CKPT_EVERY": "10"}, 200)
    return out


def _reference(jobs: dict[str, Job], steps: int) -> Any:
    return _final(jobs[f"reference-{steps}"].files("final-*.pt")[0])


def _equal_to_reference(job: Job, reference: Any) -> float:
    finals = job.files("final-*.pt")
    assert finals, job.output
    worst = max(float((_final(f) - reference).abs().max()) for f in finals)
    assert worst <= 1e-9, (worst, job.output[-3000:])
    return worst


# -- replaced: 3 kills, 3 replacements --------------------------------------------------------------------

def _stalls(job: Job) -> list[float]:
    """Seconds from each kill to the first later step completed by a process that survived it."""
    out = []
    for kill in job.kills():
        after = [t for pid in job.pids_started() if pid != kill["pid"]
                 for step, t, *_ in job.steps(pid) if t > kill["time"] and step > kill["step"]]
        out.append(min(after) - kill["time"])
    return out


def _initial(job: Job) -> set[int]:
    """The processes the job started with (their first step was in epoch 0)."""
    return {pid for pid in job.pids_started() if job.steps(pid)[0][4] == 0}


def _killed(job: Job) -> set[int]:
    return {k["pid"] for k in job.kills()}


def _finished(job: Job) -> set[int]:
    return {d["pid"] for d in job.done()}


REPLACED = {
    "exits_0_without_a_whole_restart": lambda job: (job.code == 0 and "restart 1 of" not in job.output
                                                    and all(d["restart_count"] == "0" for d in job.done())),
    "survivors_keep_their_pids": lambda job: (
        len(_initial(job)) == 4 and _finished(job) & _initial(job) == _initial(job) - _killed(job)
        and len(_initial(job) - _killed(job)) == 2),
    "three_replacements_join_and_the_unkilled_finish": lambda job: (
        len(job.pids_started() - _initial(job)) == 3 and len(job.kills()) == 3
        and _finished(job) - _initial(job) == job.pids_started() - _initial(job) - _killed(job)
        and all(d["joined"] for d in job.done() if d["pid"] not in _initial(job))),
    "every_finisher_ends_in_the_same_epoch_of_4_ranks": lambda job: (
        len(job.done()) == 4 and len({(d["size"], d["epoch"]) for d in job.done()}) == 1
        and job.done()[0]["size"] == 4 and job.done()[0]["epoch"] >= 3),
    "rank_0_is_among_the_killed": lambda job: os.path.exists(os.path.join(job.marks, "kill-120-0")),
    "each_kill_hits_a_whole_world_of_4": lambda job: all(
        size == 4 for k in job.kills() for step, _, _, size, _ in job.steps(k["pid"])[-1:]),
    # a replacement that starts quickly is admitted with the loss's own re-formation, else at the next step
    # one contract: reform() rebinds the sampler, then fit's optimizer, then a later callback, in that order
    "reform_rebinds_the_sampler_and_the_optimizer_through_one_contract": lambda job: all(
        all(f["order"] == ["DistributedSampler", "DistributedOptimizer", "_Callback"] and f["sampler"]
            and f["optimizers"] == [True] for f in d["followed"])
        and (d["followed"] or d["pid"] not in _initial(job)) for d in job.done()),
    "the_launcher_names_each_loss": lambda job: job.output.count("was killed by SIGKILL; the job continues in place") == 3
    and job.output.count("admitted 1 replacement(s)") == 3 and job.output.count("started a replacement") == 3,
}


@pytest.mark.parametrize("behaviour", sorted(REPLACED))
def test_killed_ranks_are_replaced_in_place(jobs: dict[str, Job], behaviour: str) -> None:
    job = jobs["replaced"]
    assert REPLACED[behaviour](job), job.output[-4000:]


def test_killed_ranks_are_replaced_in_place_stall_at_most_13_s(jobs: dict[str, Job]) -> None:
    stalls = _stalls(jobs["replaced"])
    print(f"\nreplaced: kill -> next completed step: {', '.join(f'{s:.2f} s' for s in stalls)} "
          f"(job {jobs['replaced'].seconds:.1f} s)")
    assert len(stalls) == 3 and max(stalls) <= 13.0, stalls


def test_killed_ranks_are_replaced_in_place_equal_to_the_uninterrupted_run(jobs: dict[str, Job]) -> None:
    worst = _equal_to_reference(jobs["replaced"], _reference(jobs, 300))
    print(f"\nreplaced: max |final - uninterrupted| = {worst:.3g}")


def test_killed_ranks_are_replaced_in_place_recoveries_are_recorded(jobs: dict[str, Job]) -> None:
    job = jobs["replaced"]
    survivor = [d for d in job.done() if d["pid"] in _initial(job)][0]
    recoveries = survivor["recoveries"]
    assert [r["epoch"] for r in recoveries] == list(range(1, len(recoveries) + 1)), survivor
    assert sum(r["lost"] for r in recoveries) == 3 and sum(r["joined"] for r in recoveries) == 3, recoveries
    assert recoveries[-1]["size"] == 4 and all(r["size"] in (3, 4) for r in recoveries), recoveries
    for r in recoveries:  # a loss (maybe with a replacement already waiting), or admitting one at a step boundary
        assert ("RankFailedError" in r["cause"]) == (r["lost"] == 1), r
        assert r["cause"] == "admitting a replacement" or r["lost"] == 1, r


# -- shrunk, stalled, floor --------------------------------------------------------------------------------

def test_min_ranks_shrinks_in_place_to_3_then_2_ranks_equal_to_the_uninterrupted_run(jobs: dict[str, Job]) -> None:
    job = jobs["shrunk"]
    assert job.code == 0, job.output[-3000:]
    assert sorted((d["size"], d["epoch"]) for d in job.done()) == [(2, 2), (2, 2)], job.done()
    sizes = [size for pid in job.pids_started() for _, _, _, size, _ in job.steps(pid)]
    assert {4, 3, 2} <= set(sizes)
    _equal_to_reference(job, _reference(jobs, 100))


def test_a_stalled_rank_is_killed_after_the_timeout_and_the_rest_finish_equal(jobs: dict[str, Job]) -> None:
    job = jobs["stalled"]
    assert job.code == 0, job.output[-3000:]
    assert "did not check in within the timeout (stalled), and was killed" in job.output, job.output[-3000:]
    assert sorted((d["size"], d["epoch"]) for d in job.done()) == [(2, 1), (2, 1)], job.done()
    _equal_to_reference(job, _reference(jobs, 100))


def test_fewer_survivors_than_min_ranks_end_with_quorum_lost_and_nothing_left_behind(jobs: dict[str, Job]) -> None:
    job = jobs["floor"]
    assert job.code != 0 and not job.done(), job.output[-3000:]
    assert "QuorumLostError" in job.output and "fewer than --min-ranks 2" in job.output, job.output[-3000:]
    alive = [pid for pid in job.pids_started() if os.path.exists(f"/proc/{pid}")
             and open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert not alive, alive


def test_sharded_gradients_reload_the_last_checkpoint_in_place_equal_to_the_uninterrupted_run(
        jobs: dict[str, Job]) -> None:
    job = jobs["sharded"]
    assert job.code == 0 and "restart 1 of" not in job.output, job.output[-3000:]
    initial = _initial(job) - _killed(job)
    assert len(initial) == 3 and initial <= _finished(job), (initial, job.done())
    survivor = [d for d in job.done() if d["pid"] in initial][0]
    assert [r["step"] for r in survivor["recoveries"]][:1] == [30], survivor  # killed at 35: back to step 30
    # a sharded optimizer does not follow in place (fit releases and wraps it again): only the sampler does
    assert survivor["followed"] and all(f["order"] == ["DistributedSampler", "_Callback"] and f["sampler"]
                                        and f["optimizers"] == [] for f in survivor["followed"]), survivor
    _equal_to_reference(job, _reference(jobs, 100))


# -- the user's own loop -----------------------------------------------------------------------------------

def _loop_records(jobs: dict[str, Job], name: str = "own loop", count: int = 2) -> list[dict[str, Any]]:
    """What each process of a ``program_reform.py`` job wrote (the job exited 0, ``count`` processes)."""
    job = jobs[name]
    assert job.code == 0, job.output[-3000:]
    records = []
    for path in job.files("reform-*.json"):
        with open(path) as f:
            records.append(json.load(f))
    assert len(records) == count, job.output[-3000:]
    return sorted(records, key=lambda r: r["start"][1])


LOOP_CHECKS = {
    "the_error_is_rank_failed_and_names_reform": lambda r: r["error"] == "RankFailedError" and r["error_mentions_reform"],
    "the_epoch_is_1_with_ranks_renumbered_in_order": lambda r: (
        r["epoch"]["number"] == 1 and r["epoch"]["size"] == 2 and r["epoch"]["rank"] == r["start"][1]
        and r["epoch"]["previous_rank"] == r["start"][1] and r["epoch"]["lost"] == [2] and r["epoch"]["joined"] == []),
    "a_handle_of_the_old_epoch_is_refused": lambda r: r["stale"].startswith(("RankFailedError", "WorldBrokenError")),
    "a_group_of_the_old_epoch_is_refused": lambda r: r["old_group"].startswith("UsageError"),
    "on_reform_callbacks_run_in_the_new_world": lambda r: r["callbacks"] == [[1, r["start"][1], 2]],
    # the registered object after the callback registered before it; the collected one never
    "registered_objects_follow_in_registration_order_held_weakly": lambda r: (
        r["followed"] == [[1, r["start"][1], 2, 1]]),
    "the_loop_finishes_in_epoch_1": lambda r: r["end"] == [1, r["start"][1], 2, 20],
}


@pytest.mark.parametrize("behaviour", sorted(LOOP_CHECKS))
def test_reform_in_a_users_own_loop(jobs: dict[str, Job], behaviour: str) -> None:
    for record in _loop_records(jobs):
        assert LOOP_CHECKS[behaviour](record), record


GROW_CHECKS = {
    "the_job_exits_0_with_two_survivors_and_one_replacement": lambda rs: (
        len(rs) == 3 and sorted(r["joined_late"] for r in rs) == [False, False, True]),
    "every_survivor_admits_it_in_epoch_2_of_3_before_the_end": lambda rs: all(
        len(r["admitted"]) == 1 and r["admitted"][0][:3] == [2, 3, [3]] and r["admitted"][0][3] < 20
        for r in rs if not r["joined_late"]),
    "the_replacement_starts_as_rank_2_of_3_in_epoch_2": lambda rs: [r["start"] for r in rs if r["joined_late"]] == [[2, 2, 3]],
    "registered_objects_follow_each_reform_after_the_earlier_callback": lambda rs: all(
        r["followed"] == [[*c, i + 1] for i, c in enumerate(r["callbacks"])] for r in rs),
    "every_rank_finishes_the_20_iterations_in_epoch_2": lambda rs: sorted(r["end"] for r in rs) == [
        [2, 0, 3, 20], [2, 1, 3, 20], [2, 2, 3, 20]],
}


@pytest.mark.parametrize("behaviour", sorted(GROW_CHECKS))
def test_replacement_waiting_admits_a_replacement_into_a_users_own_loop(jobs: dict[str, Job], behaviour: str) -> None:
    records = _loop_records(jobs, "own loop grows", 3)
    assert GROW_CHECKS[behaviour](records), (records, jobs["own loop grows"].output[-2000:])


def test_reform_without_a_launcher_that_reforms_is_a_usage_error_naming_the_fix_and_no_replacement_waits() -> None:
    code = ("import phalanx\nphalanx.init()\nassert phalanx.epoch() == 0\n"
            "assert phalanx.replacement_waiting() is False\ntry:\n    phalanx.reform()\n"
            "except phalanx.UsageError as e:\n    print('refused:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")})
    assert "refused: phalanx.reform: this world cannot re-form" in done.stdout, done.stdout + done.stderr
    assert "--max-restarts" in done.stdout
