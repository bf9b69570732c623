"""What a new user meets first: the README's snippets, `phalanx bench -h`, the optimizer wrapper's hints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _snippet(heading: str) -> str:
    section = README[README.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_readme_training_snippet_initializes_phalanx_before_wrapping() -> None:
    code = _snippet("### Training")
    assert "phalanx.init()" in code and code.index("phalanx.init()") < code.index("DistributedOptimizer(")


def test_readme_fit_snippet_names_the_loggers_extra_for_tensorboard() -> None:
    code = _snippet("### A training loop")
    assert "TensorBoardLogger" in code and "phalanx[loggers]" in code


def test_bench_help_lists_predict_among_the_choices() -> None:
    out = subprocess.run([sys.executable, "-m", "phalanx", "bench", "-h"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "{allreduce,broadcast,predict}" in out.stdout, out.stdout


torch = pytest.importorskip("torch")


def test_distributed_optimizer_docstring_says_why_isinstance_of_the_wrapped_class_is_false() -> None:
    import phalanx.torch

    doc = phalanx.torch.DistributedOptimizer.__doc__ or ""
    assert "isinstance(opt, torch.optim.Adam)" in doc and "isinstance(opt.optimizer, torch.optim.Adam)" in doc


def test_synchronize_on_the_native_wrapper_hints_at_the_native_way() -> None:
    import phalanx
    import phalanx.torch

    phalanx.init("local")
    try:
        model = torch.nn.Linear(2, 2)
        opt = phalanx.torch.DistributedOptimizer(torch.optim.Adam(model.parameters()))
        assert not isinstance(opt, torch.optim.Adam) and isinstance(opt.optimizer, torch.optim.Adam)
        assert not hasattr(opt, "synchronize")  # code probing for Horovod's API still sees it absent
        with pytest.raises(AttributeError, match=r"already averaged when backward\(\) returns.*no_sync"):
            opt.synchronize()
        with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
            opt.no_such_thing  # noqa: B018
    finally:
        phalanx.shutdown()
