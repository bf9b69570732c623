"""phalanx inside Ray Train's ``TorchTrainer``: on the process group Ray made, unchanged scripts.

One local Ray cluster (``ray.init(num_cpus=2)``) for the module, two ``TorchTrainer`` runs of 2
CPU workers (``tests/program_ray.py``): the first trains with ``phalanx.torch.DistributedOptimizer``,
``phalanx.train.fit`` and ``phalanx.horovod.torch`` and reports a checkpoint through
``ray.train.report``; the second restores ``fit`` from it and then wraps a
``ray.train.torch.prepare_model`` model's optimizer in ``DistributedOptimizer``, which must fail
the run with phalanx's error, through Ray's own failure report; skipped without ``phalanx[ray]``.
The same refusal without Ray, for each phalanx wrapper over a DDP model's parameters, runs on a
2-rank gloo world.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import AVAILABLE
from phalanx.testing import run_world

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
WORKERS = 2
TOL = 1e-9


def _results(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"{name}-{r}.json").read_text()) for r in range(WORKERS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both TorchTrainer runs on one local cluster: what each worker wrote, and how the runs ended."""
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'phalanx[ray]')")
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    import program_ray

    out = tmp_path_factory.mktemp("ray")
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), saved["PYTHONPATH"]]))  # workers import program_ray
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    try:
        def trainer(fn: Any, name: str) -> Any:
            return TorchTrainer(fn, train_loop_config={"out": str(out)},
                                scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
                                run_config=ray.train.RunConfig(storage_path=str(out / "storage"), name=name))

        first = trainer(program_ray.train, "train").fit()
        failure: BaseException | None = None
        try:
            trainer(program_ray.resume_then_wrap_twice, "train").fit()  # the same run name: Ray restores it
        except Exception as exc:  # noqa: BLE001 - what Ray raises is what the test checks
            failure = exc
        yield {"out": out, "first": first, "failure": failure}
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_ranks_sizes_and_local_ranks_agree_with_ray_train_context_and_info_names_ray(runs: dict[str, Any]) -> None:
    for rank, result in enumerate(_results(runs["out"], "train")):
        assert result["phalanx"] == [rank, WORKERS, rank, "gloo"], result
        assert result["ray"] == result["phalanx"][:3], result
        assert result["environment"].startswith(f"Ray Train worker (rank {rank} of {WORKERS})"), result


def test_distributed_optimizer_and_horovod_scripts_equal_one_process_on_the_global_batch(
        runs: dict[str, Any]) -> None:
    for rank, result in enumerate(_results(runs["out"], "train")):
        assert result["optimizer"] <= TOL, f"rank {rank}: DistributedOptimizer differs by {result['optimizer']:.3g}"
        assert result["horovod"] <= TOL, f"rank {rank}: phalanx.horovod.torch differs by {result['horovod']:.3g}"


def test_fit_checkpoint_reported_to_ray_restores_equal_to_uninterrupted_one_process(runs: dict[str, Any]) -> None:
    checkpoint = runs["first"].checkpoint
    assert checkpoint is not None, "ray.train.report(checkpoint=...) left no checkpoint"
    assert runs["first"].metrics["step"] == 4, runs["first"].metrics
    for rank, result in enumerate(_results(runs["out"], "resume")):
        assert result["files"] == [f"checkpoint-{4:09d}.pt"], result  # fit's file for step 4
        assert result["fit"] <= TOL, f"rank {rank}: resumed fit differs by {result['fit']:.3g}"


def test_prepare_model_ddp_with_distributed_optimizer_fails_the_run_naming_which_to_drop(
        runs: dict[str, Any]) -> None:
    failure = runs["failure"]
    assert failure is not None, "wrapping a DDP model's optimizer in DistributedOptimizer did not fail the run"
    from phalanx import UsageError

    workers = getattr(failure, "worker_failures", {})  # Ray's report: each failed worker's exception
    assert sorted(workers) == list(range(WORKERS)), (type(failure), failure)
    for rank, exc in workers.items():
        assert isinstance(exc, UsageError), (rank, type(exc).__mro__, exc)
        text = str(exc)
        assert "phalanx.torch.DistributedOptimizer would average them a second time" in text, text
        assert "DistributedDataParallel" in text and "prepare_model(model, parallel_strategy=None)" in text, text


@pytest.mark.skipif("gloo" not in AVAILABLE, reason="backend 'gloo' is not available here (see `phalanx info`)")
def test_every_phalanx_wrapper_over_a_ddp_models_parameters_is_refused_until_the_ddp_model_is_gone() -> None:
    import program_ray

    for rank, found in enumerate(run_world(program_ray.ddp_refused, 2, "gloo")):
        for name in ("DistributedOptimizer", "DataParallel", "hvd.DistributedOptimizer"):
            assert "belong to a torch DistributedDataParallel model" in found[name], (rank, name, found[name])
            assert "parallel_strategy=None" in found[name], (rank, name, found[name])
        assert found["after"] == "DistributedOptimizer", found
        assert found["check_s"] < 0.5, f"the check took {found['check_s']:.3f} s"
