"""Faults in a user's training loop, run in the training world (``worlds_training.training``).

* Non-finite local gradients with a finite loss (issue 9, item 2): with
  ``nonfinite="raise"`` every rank raises the same NonFiniteGradientError
  naming the ranks whose own gradients held NaN, and no update is applied;
  with ``"skip"`` every rank skips that step and training equals one process
  that skipped it. Without the check the NaN silently reaches every rank.
* A rank that skips a step (issue 9, item 5): with ``check_steps`` the ranks
  agree on the optimizer's step count before each reduction, and with
  ``step(step=s)`` on the user's label before each update, so the rank that
  skipped is named on every rank before steps are mixed.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import raises
from worlds_training import TIGHT, _setup, assert_close, batch, make_optimizer, mlp, mse, piece

FAULTS = Behaviours()        # every world
FAULTS_ACROSS = Behaviours()  # worlds of 2 or more ranks
STEPS = 4
BAD_STEP = 2


def _poison_once(torch: Any, param: Any) -> Any:
    """A hook that turns ``param``'s gradient into NaN in the next backward only (the loss stays finite)."""
    def hook(grad: Any) -> Any:
        handle.remove()
        return torch.full_like(grad, float("nan"))

    handle = param.register_hook(hook)
    return handle


def _wrap(torch: Any, pt: Any, form: str, model: Any, **options: Any) -> tuple[Any, Any, Any]:
    """(net, optimizer, the object with nonfinite_ranks()) for DistributedOptimizer or DataParallel."""
    if form == "opt":
        opt = pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()), **options)
        return model, opt, opt
    net = pt.DataParallel(model, **options)
    return net, make_optimizer(torch, "sgd", net.parameters()), net


def raise_names_the_ranks(form: str) -> None:
    """The last rank's gradients turn NaN at one step: every rank raises naming it, nothing is applied."""
    torch, pt, r, n = _setup()
    bad = n - 1
    net, opt, wrapper = _wrap(torch, pt, form, mlp(torch, 100 + r), nonfinite="raise")
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        if step == BAD_STEP and r == bad:
            _poison_once(torch, list(net.parameters())[0])
        before = copy.deepcopy(net.state_dict())
        started = time.perf_counter()
        try:
            mse(torch, net(piece(x, r)), piece(y, r)).backward()
            opt.step()
        except phalanx.NonFiniteGradientError as exc:
            elapsed = time.perf_counter() - started
            assert step == BAD_STEP, f"step {step}: {exc}"
            assert exc.ranks == [bad] and f"rank {bad}" in str(exc) and "NaN" in str(exc), exc
            assert isinstance(exc, FloatingPointError) and elapsed < 5, elapsed
            assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items()), "an update was applied"
            assert wrapper.nonfinite_ranks() == [bad]
        else:
            assert step != BAD_STEP, "the NaN gradient of one rank was not reported"
            assert wrapper.nonfinite_ranks() == []
    assert all(torch.isfinite(p).all() for p in net.parameters())


def skip_skips_everywhere(form: str) -> None:
    """Rank 0's gradients turn NaN at one step: every rank skips it, like one process skipping it."""
    torch, pt, r, n = _setup()
    model, ref = mlp(torch, 100 + r), mlp(torch, 100)
    net, opt, wrapper = _wrap(torch, pt, form, model, nonfinite="skip")
    ref_opt = make_optimizer(torch, "sgd", ref.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        if step == BAD_STEP and r == 0:
            _poison_once(torch, list(net.parameters())[-1])
        mse(torch, net(piece(x, r)), piece(y, r)).backward()
        opt.step()
        assert wrapper.nonfinite_ranks() == ([0] if step == BAD_STEP else []), (step, wrapper.nonfinite_ranks())
        if step != BAD_STEP:
            ref_opt.zero_grad()
            mse(torch, ref(x), y).backward()
            ref_opt.step()
    assert_close(model, ref, f"nonfinite='skip' ({form}) on {n} ranks", TIGHT)


for _form, _name in (("opt", "DistributedOptimizer"), ("dp", "DataParallel")):
    FAULTS.add(f"nonfinite-raise-names-the-ranks-with-nan-gradients-on-every-rank-{_name}",
               raise_names_the_ranks, _form)
    FAULTS.add(f"nonfinite-skip-skips-the-step-on-every-rank-{_name}", skip_skips_everywhere, _form)


@FAULTS.behaviour("without-the-check-a-nan-gradient-of-one-rank-reaches-every-rank")
def _unchecked() -> None:
    """What the check is for: by default (no cost) the NaN is averaged into every rank's gradients."""
    torch, pt, r, n = _setup()
    model = mlp(torch, 100 + r)
    opt = pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()))
    assert opt.nonfinite is None and not opt._engine.check_finite
    x, y = batch(torch, 0, (6,), n)
    if r == n - 1:
        _poison_once(torch, model[0].weight)
    mse(torch, model(piece(x, r)), piece(y, r)).backward()
    assert torch.isnan(model[0].weight.grad).all() and opt.nonfinite_ranks() == []
    opt.zero_grad()
    opt.close()


@FAULTS.behaviour("bad-nonfinite-and-step-arguments-are-invalid-argument-errors")
def _bad_arguments() -> None:
    torch, pt, r, n = _setup()
    model = mlp(torch, 0)
    for make in (lambda: pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()),
                                                 nonfinite="warn"),
                 lambda: pt.DataParallel(model, nonfinite="warn")):
        with raises(phalanx.InvalidArgumentError, "nonfinite='warn' was accepted") as raised:
            make()
        exc = raised.value
        assert "nonfinite='warn'" in str(exc) and "'skip'" in str(exc), exc
    opt = pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()))
    with raises(phalanx.InvalidArgumentError, "step=1.5 was accepted") as raised:
        opt.step(step=1.5)
    exc = raised.value
    assert "step(step=1.5)" in str(exc), exc
    opt.close()


def _expect_step_mismatch(what: str, run: Any, laggard: int, steps: tuple[int, int]) -> None:
    """``run()`` must raise the same CollectiveMismatchError on every rank, naming each rank's step."""
    started = time.perf_counter()
    with raises(phalanx.CollectiveMismatchError, f"{what}: mixing steps was not detected") as raised:
        run()
    exc = raised.value
    elapsed = time.perf_counter() - started
    text = str(exc)
    ahead, behind = steps
    assert "step differs" in text and f"rank {laggard}: " in text, text
    assert f"step={behind}" in text and f"step={ahead}" in text, text
    assert elapsed < 5, f"{what}: the error took {elapsed:.1f} s"
    assert phalanx.allreduce(1) == phalanx.size(), "the world is still usable"


@FAULTS_ACROSS.behaviour("check-steps-names-the-rank-that-skipped-step-before-gradients-mix")
def _skipped_step() -> None:
    """The last rank skips ``opt.step()`` once (it still runs backward): the next backward raises."""
    torch, pt, r, n = _setup()
    model = mlp(torch, 100 + r)
    opt = pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()), check_steps=True)
    laggard = n - 1
    opt.zero_grad()
    x, y = batch(torch, 0, (6,), n)
    mse(torch, model(piece(x, r)), piece(y, r)).backward()
    if r != laggard:
        opt.step()
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    x, y = batch(torch, 1, (6,), n)
    _expect_step_mismatch("check_steps", lambda: mse(torch, model(piece(x, r)), piece(y, r)).backward(),
                          laggard, (1, 0))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    opt.close()


@FAULTS_ACROSS.behaviour("step-labels-name-the-rank-that-skipped-an-iteration-before-the-update")
def _skipped_iteration() -> None:
    """The last rank skips iteration 1 entirely; step(step=s) raises at its next step, nothing applied."""
    torch, pt, r, n = _setup()
    model = mlp(torch, 100 + r)
    opt = pt.DistributedOptimizer(make_optimizer(torch, "sgd", model.parameters()))
    laggard = n - 1
    outcome: list[Any] = []
    for step in range(3):
        if step == 1 and r == laggard:
            continue
        opt.zero_grad()
        x, y = batch(torch, step, (6,), n)
        mse(torch, model(piece(x, r)), piece(y, r)).backward()
        before = copy.deepcopy(model.state_dict())
        if step == 0:
            opt.step(step=step)
            continue
        _expect_step_mismatch("step labels", lambda s=step: opt.step(step=s), laggard, (2, 1))
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "an update was applied"
        outcome.append(step)
        break
    assert outcome == [2 if r == laggard else 1], outcome
    opt.close()
