"""``phalanx run --backend mpi`` for a world that re-forms in place (Open MPI 5's ULFM): the launch's part.

The ranks re-form the world themselves (:mod:`phalanx._epochs_ulfm`); the launcher only

* starts ``mpirun --with-ft ulfm`` with the variables they need (:func:`in_place_mpi`), and names the
  variables it forwards, for the replacements the ranks spawn on other hosts (:func:`name_forwarded`);
* counts the replacements they spawned against ``--max-restarts`` (:func:`count_replacements`);
* reads mpirun's exit status against the ranks' markers (:func:`every_slot_finished`).
"""

from __future__ import annotations

import json

from .._epochs import COMMAND_ENV, ELASTIC_ENV, FORWARDED_ENV, REPLACEMENTS_ENV, ULFM
from ._job import Launch, all_local, notice, worker_command
from ._jobdir import any_record, marked_ranks, replaced_slots
from ._mpi_flavor import LOOPBACK_ENV, Flavor

__all__ = ["count_replacements", "every_slot_finished", "in_place_mpi", "name_forwarded", "re_forms"]


def re_forms(env: dict[str, str]) -> bool:
    """Whether the job started with ``env`` re-forms in place (:func:`in_place_mpi` said so)."""
    return env.get(ELASTIC_ENV) == ULFM


def in_place_mpi(job: Launch, flavor: Flavor, env: dict[str, str], ours: list[str]) -> bool:
    """Whether ``job``'s world re-forms in place (``--max-restarts`` or ``--min-ranks`` under Open MPI 5's
    ULFM: :mod:`phalanx._epochs_ulfm`); then the ranks' variables for it are set in ``env`` and named in
    ``ours``. Elsewhere (MPICH, Open MPI 4) an MPI job restarts whole, as the launcher says."""
    if not (job.max_restarts or job.min_ranks is not None):
        return False
    if flavor.family != "openmpi" or flavor.version[:1] < (5,):
        notice(f"--max-restarts/--min-ranks with {flavor.banner.splitlines()[0] if flavor.banner else 'this MPI'}: "
               "an MPI job restarts whole after a failure (re-forming in place needs Open MPI 5's ULFM; "
               "docs/cluster.md, \"Restarts\").")
        return False
    if job.max_restarts and env.get("OMPI_MCA_btl") == LOOPBACK_ENV["OMPI_MCA_btl"]:
        # a replacement is another MPI job, which shared memory does not reach: TCP, confined to loopback
        del env["OMPI_MCA_btl"]
    restarts = int(env.get("PHALANX_RESTART_COUNT", "0") or 0)
    env.update({ELASTIC_ENV: ULFM, COMMAND_ENV: json.dumps(worker_command(job.target)),
                # one budget, as on gloo: the whole restarts so far and the replacements spawned in them
                REPLACEMENTS_ENV: str(max(0, job.max_restarts - restarts - len(job.replaced))),
                "PHALANX_MIN_RANKS": str(job.min_ranks or 1)})
    ours += [ELASTIC_ENV, COMMAND_ENV, REPLACEMENTS_ENV, "PHALANX_MIN_RANKS"]
    return True


def name_forwarded(env: dict[str, str], ours: list[str]) -> None:
    """Name the variables forwarded to every rank (``ours``, Open MPI's ``-x``) in ``PHALANX_FORWARDED``:
    the first survivor sends them to each replacement (``_epochs_ulfm.start_early``), which on another
    host than mpirun's has only its daemon's environment."""
    env[FORWARDED_ENV] = ",".join([*ours, FORWARDED_ENV])
    ours.append(FORWARDED_ENV)


def count_replacements(job: Launch, job_dir: str) -> None:
    """The replacements the ranks spawned (their ``replaced-rank`` markers) count against ``--max-restarts``
    with the whole restarts, in ``job.replaced`` (one budget, as on gloo: :mod:`._elastic`)."""
    job.replaced.extend(replaced_slots(job_dir))


def every_slot_finished(job: Launch, job_dir: str) -> bool:
    """A ULFM job's ranks all finished: a replacement's spawned job counts a lost predecessor against
    mpiexec's exit status, but each slot's last process left its ``exit`` marker (or the survivors
    marked the slot ``dropped``: not refilled), and none raised. On one host only: the markers of ranks
    on other hosts do not reach this job directory."""
    ended = marked_ranks(job_dir, "exit") | marked_ranks(job_dir, "dropped")
    return all_local(job) and not any_record(job_dir) and ended >= set(range(job.n))
