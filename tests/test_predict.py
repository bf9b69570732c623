"""``phalanx bench predict`` and the α-β model behind it: the arithmetic against hand-computed
cases, the command's table, JSON, PNG and errors, and ``phalanx bench allreduce``'s fit of the
link across two simulated hosts.

    python -m pytest -q tests/test_predict.py
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import requires_hosts
from phalanx import InvalidArgumentError
from phalanx.cli._predict import parse_ranks
from phalanx.cli._scaling import (
    Fabric,
    Settings,
    codec_flops,
    comm_time,
    compressed_matrices,
    fit_allreduce,
    parse_variant,
    ring_allreduce,
    step_time,
    variant_bytes,
)
from phalanx.cli._scaling_data import LINKS, MODELS, Link, ModelShape

CLI_TIMEOUT = 60
LINK = Link(alpha=10e-6, beta=1e-9)  # 10 us, 1 GB/s
SLOW = Link(alpha=50e-6, beta=1e-8)  # 50 us, 100 MB/s
FABRIC = Fabric(inter=SLOW, intra=LINK)
PLAIN, BF16, PSGD, HIER = (parse_variant(v) for v in ("plain", "bf16", "powersgd", "hierarchical"))


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-15)


def test_one_rank_has_no_communication() -> None:
    s = Settings(t1=0.1, overhead=0.5)
    for variant in (PLAIN, BF16, PSGD, HIER):
        row = step_time(1, MODELS["resnet50"], variant, FABRIC, s)
        assert row["comm_s"] == 0 and row["step_s"] == 0.1 and row["efficiency"] == 1.0


def test_ring_allreduce_is_2_n_minus_1_alpha_plus_2_n_minus_1_over_n_s_beta() -> None:
    # 8 ranks, 1 MB: 2·7·10 us + 2·7/8·1e6 B·1 ns = 140 us + 1.75 ms
    assert close(ring_allreduce(1e6, 8, LINK), 140e-6 + 1.75e-3)
    assert close(ring_allreduce(1e6, 8, LINK, rounds=3), 3 * 140e-6 + 1.75e-3)
    assert ring_allreduce(1e6, 1, LINK) == 0.0


def test_bf16_halves_the_beta_term_and_keeps_the_alpha_term() -> None:
    model = ModelShape("m", ((1000, 1000),), 0)  # 1e6 params: 4 MB fp32, 2 MB bf16, one bucket each
    s = Settings(t1=0.1)
    plain, bf16 = (step_time(4, model, v, Fabric(LINK, LINK), s)["comm_s"] for v in (PLAIN, BF16))
    alpha_term = 2 * 3 * LINK.alpha
    assert close(plain - alpha_term, 2 * (bf16 - alpha_term))
    assert close(bf16, alpha_term + 2 * 3 / 4 * 2e6 * LINK.beta)


def test_bf16_cast_cost_is_charged_per_fp32_byte() -> None:
    model = ModelShape("m", ((1000, 1000),), 0)
    s = Settings(t1=0.1, cast_s_per_byte=1e-10)  # 10 GB/s
    assert close(step_time(2, model, BF16, FABRIC, s)["codec_s"], 4e6 * 1e-10)
    assert step_time(2, model, PLAIN, FABRIC, s)["codec_s"] == 0


def test_flat_ring_across_hosts_runs_at_the_inter_link_and_hierarchical_splits_the_classes() -> None:
    nbytes, n, per_host = 8e6, 16, 4  # 4 hosts x 4 ranks
    flat = comm_time(nbytes, n, FABRIC, per_host)
    assert close(flat, 2 * 15 * SLOW.alpha + 2 * 15 / 16 * nbytes * SLOW.beta)
    hier = comm_time(nbytes, n, FABRIC, per_host, hierarchical=True)
    intra = 2 * 3 * LINK.alpha + 2 * 3 / 4 * nbytes * LINK.beta  # reduce to the leader; broadcast the same
    inter = 2 * 3 * SLOW.alpha + 2 * 3 / 4 * nbytes * SLOW.beta  # ring among 4 leaders
    assert close(hier, 2 * intra + inter)
    assert hier < flat  # fewer ranks on the slow ring: fewer α steps and fewer bytes across hosts
    assert close(comm_time(nbytes, 4, FABRIC, 4), ring_allreduce(nbytes, 4, LINK))  # one host: intra only
    assert close(comm_time(nbytes, 4, FABRIC, 1, hierarchical=True), ring_allreduce(nbytes, 4, SLOW))


def test_powersgd_sends_r_times_rows_plus_cols_per_compressible_matrix_and_the_rest_whole() -> None:
    model = ModelShape("m", ((1024, 512), (256, 256), (4, 1024)), vectors=2000)
    s = Settings(t1=0.1, rank=4)
    nbytes, rounds, flops, _ = variant_bytes(model, PSGD, s)
    # (4, 1024) stays whole: (4+1024)·4·2 >= 4·1024 (it would not shrink by DDP's factor 2)
    assert nbytes == 4 * (4 * (1024 + 512) + 4 * (256 + 256) + 4 * 1024 + 2000)
    assert rounds == 3  # P, Q and the uncompressed rest
    assert flops == 6.0 * 4 * (1024 * 512 + 256 * 256) + 2.0 * 16 * (1024 + 256)
    plain_bytes, plain_rounds, _, _ = variant_bytes(model, PLAIN, s)
    assert plain_bytes == 4 * model.params and plain_rounds == 1


def test_buckets_each_cost_their_alpha_terms() -> None:
    model = MODELS["resnet101"]  # 178 MB of fp32 gradients: 7 buckets of 25 MiB
    nbytes, rounds, _, _ = variant_bytes(model, PLAIN, Settings(t1=0.1))
    assert nbytes == 4 * 44_549_160 and rounds == math.ceil(nbytes / (25 << 20)) == 7


def test_overlap_hides_comm_up_to_the_backward_pass() -> None:
    model = MODELS["mlp"]
    base = step_time(2, model, PLAIN, FABRIC, Settings(t1=0.01))
    half = step_time(2, model, PLAIN, FABRIC, Settings(t1=0.01, overlap=0.5))
    assert close(half["hidden_s"], min(0.5 * base["comm_s"], 2 / 3 * 0.01))
    assert close(half["step_s"], base["step_s"] - half["hidden_s"])


def test_named_models_have_torchvision_parameter_counts() -> None:
    assert {k: m.params for k, m in MODELS.items()} == {
        "mlp": 4_733_962, "resnet50": 25_557_032, "resnet101": 44_549_160, "vgg16": 138_357_544}
    assert (256, 128 * 9) not in MODELS["resnet101"].matrices and (128, 128 * 9) in MODELS["resnet101"].matrices


def test_fit_recovers_alpha_and_beta_from_synthetic_ring_timings() -> None:
    n, alpha, beta = 4, 30e-6, 1 / 117e6
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    seconds = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s * beta for s in sizes]
    fit = fit_allreduce(sizes, seconds, n)
    assert close(fit["alpha"], alpha, 1e-6) and close(fit["beta"], beta, 1e-6) and fit["rms_rel_error"] < 1e-9
    with pytest.raises(InvalidArgumentError, match="--sizes"):
        fit_allreduce([1024], [1e-3], n)


def test_named_links_follow_line_rate_times_efficiency() -> None:
    assert close(LINKS["25gbe"].beta, 8 / (25e9 * 0.94))
    assert LINKS["ib-hdr-200"].alpha < LINKS["10gbe"].alpha


def test_ranks_lists_expand_dots_geometrically_or_arithmetically() -> None:
    assert parse_ranks("2,4,...,64") == [2, 4, 8, 16, 32, 64]
    assert parse_ranks("2,3,...,6") == [2, 3, 4, 5, 6]
    assert parse_ranks("1,2,4,...,1024")[-1] == 1024
    for bad in ("0,2", "a", "2,..."):
        with pytest.raises(InvalidArgumentError, match="--ranks"):
            parse_ranks(bad)
    with pytest.raises(InvalidArgumentError, match="--variants"):
        parse_variant("zip")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "phalanx", "bench", "predict", *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT)


def test_cli_prints_a_table_per_variant_and_rank_count() -> None:
    p = cli("--model", "resnet101", "--step-ms", "250", "--fabric", "25gbe", "--ranks", "1,8,512",
            "--ranks-per-host", "8", "--variants", "plain,bf16,powersgd,hierarchical")
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] in (["plain"], ["bf16"],
                                                                                 ["powersgd"], ["hierarchical"])]
    assert len(rows) == 12 and all(float(r[-1]) <= 1.0 for r in rows)
    assert [r[1] for r in rows[:3]] == ["1", "8", "512"] and rows[0][-1] == "1.000"


def test_cli_json_matches_the_model(tmp_path: Path) -> None:
    p = cli("--params", "4.733962M", "--step-ms", "10", "--fabric", "1gbe", "--ranks", "2,4", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["params"] == 4_733_962 and [r["ranks"] for r in out["rows"]][:2] == [2, 4]
    expected = ring_allreduce(4 * 4_733_962, 2, LINKS["1gbe"])
    assert close(out["rows"][0]["comm_s"], expected)


def test_cli_reads_a_fitted_fabric_and_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fabric = tmp_path / "fit.json"
    fabric.write_text(json.dumps({"fit": {"class": "inter", "use": "mpi4py",
                                          "links": {"mpi4py": {"alpha": 1e-5, "beta": 1e-8}}}}))
    png = tmp_path / "p.png"
    p = cli("--model", "mlp", "--step-ms", "20", "--fabric", str(fabric), "--ranks", "2,4", "--png", str(png),
            "--variants", "plain", "--json")
    assert p.returncode == 0, p.stderr
    assert close(json.loads(p.stdout)["rows"][0]["comm_s"], ring_allreduce(4 * 4_733_962, 2, Link(1e-5, 1e-8)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,flag", [
    (("--model", "nope", "--step-ms", "5"), "--model"),
    (("--model", "mlp", "--step-ms", "-1"), "--step-ms"),
    (("--model", "mlp", "--step-ms", "5", "--fabric", "2gbe"), "--fabric"),
    (("--model", "mlp", "--step-ms", "5", "--overlap", "2"), "--overlap"),
    (("--model", "mlp", "--params", "5M", "--step-ms", "5"), "--params"),
    (("--model", "mlp", "--step-ms", "5", "--variants", "gzip"), "--variants"),
    (("--model", "mlp", "--step-ms", "5", "--gflops", "fast"), "--gflops"),
    (("--model", "mlp", "--step-ms", "5", "--gflops", "-3"), "--gflops"),
    (("--model", "mlp", "--step-ms", "5", "--gflops", "nan"), "--gflops"),
])
def test_cli_bad_input_names_the_flag_and_exits_2(args: tuple[str, ...], flag: str) -> None:
    p = cli(*args)
    assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_powersgd_codec_costs_its_flops_at_the_given_speed() -> None:
    s = Settings(t1=0.02, flops_per_s=5e9)
    flops = sum(codec_flops(n, m, 4) for n, m in compressed_matrices(MODELS["mlp"], s))
    # every weight matrix, the 10×1024 head too: 10·1024 > 2·4·(10+1024)
    assert compressed_matrices(MODELS["mlp"], s) == [(1024, 512)] + [(1024, 1024)] * 4 + [(10, 1024)]
    assert close(flops, 6.0 * 4 * (1024 * 512 + 4 * 1024 * 1024 + 10 * 1024) + 2.0 * 16 * (1024 * 5 + 10))
    assert compressed_matrices(ModelShape("tall", ((8, 8),), 0), s) == []  # 64 < 2·4·16: sent whole
    assert close(step_time(2, MODELS["mlp"], PSGD, FABRIC, s)["codec_s"], flops / 5e9)
    assert step_time(2, MODELS["mlp"], PLAIN, FABRIC, s)["codec_s"] == 0.0


def test_cli_gflops_measure_times_phalanx_powersgd_on_this_machine() -> None:
    pytest.importorskip("torch")
    p = cli("--model", "mlp", "--step-ms", "20", "--fabric", "1gbe", "--ranks", "2", "--variants",
            "plain,powersgd", "--gflops", "measure", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    gflops = out["powersgd_gflops"]
    assert 0.01 < gflops < 1e4  # a real timing: finite, positive
    flops = sum(codec_flops(n, m, 4) for n, m in compressed_matrices(MODELS["mlp"], Settings(t1=0.02)))
    plain, psgd = out["rows"]
    assert plain["codec_s"] == 0.0 and close(psgd["codec_s"], flops / (gflops * 1e9), rel=1e-6)
    table = cli("--model", "mlp", "--step-ms", "20", "--ranks", "2", "--gflops", "measure")
    assert table.returncode == 0 and "PowerSGD's local work at " in table.stdout, table.stderr
    # no matrix PowerSGD would compress: nothing to time, the codec is free
    none = cli("--params", "1000", "--step-ms", "20", "--ranks", "2", "--gflops", "measure", "--json")
    assert none.returncode == 0 and json.loads(none.stdout)["powersgd_gflops"] == 0.0, none.stderr


def test_codec_seconds_runs_the_passes_powersgd_reduce_makes() -> None:
    pytest.importorskip("torch")
    from phalanx.torch import _powersgd

    calls: list[str] = []
    originals = {name: getattr(_powersgd, name) for name in ("_project", "_second_factor", "_decompress")}
    try:
        for name, fn in originals.items():
            setattr(_powersgd, name, lambda *a, _n=name, _f=fn: (calls.append(_n), _f(*a))[1])
        seconds = _powersgd.codec_seconds([(64, 32), (48, 48)], rank=4, repeats=2)
    finally:
        for name, fn in originals.items():
            setattr(_powersgd, name, fn)
    assert seconds > 0
    assert calls == (["_project"] * 2 + ["_second_factor"] * 2 + ["_decompress"] * 2) * 3  # warm-up + 2 timed


def test_bench_allreduce_refuses_a_bad_link_rate_before_starting_ranks() -> None:
    p = subprocess.run([sys.executable, "-m", "phalanx", "bench", "allreduce", "--link-rate", "fast"],
                       capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert p.returncode == 2 and "--link-rate 'fast'" in p.stderr and "1gbit" in p.stderr, p.stderr


def test_import_phalanx_and_the_model_stay_light() -> None:
    code = ("import sys, phalanx, phalanx.cli._scaling, phalanx.cli._predict; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'jax', 'matplotlib') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


@requires_hosts
def test_bench_allreduce_fits_the_shaped_link_across_two_simulated_hosts(tmp_path: Path) -> None:
    """2 hosts x 1 rank over a 100 Mbit/s link: the fit is of the inter-host class and its bandwidth
    is the link's (within 30%), for phalanx and the raw libraries alike."""
    from phalanx.testing import simulated_hosts

    out = tmp_path / "fit.json"
    with simulated_hosts(2, rate="100mbit") as hosts:
        argv = [sys.executable, "-m", "phalanx", "bench", "allreduce", "--hosts", "h0:1,h1:1", "--rsh", hosts.rsh,
                "--sizes", "64K,1M,4M", "--repeats", "2", "--min-time", "0.02", "--link-rate", "100mbit",
                "--json", str(out)]
        p = hosts.run(0, argv, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    fit = json.loads(out.read_text())["fit"]
    assert fit["class"] == "inter" and fit["ranks"] == 2 and "of the 100mbit link" in p.stdout
    for name, link in fit["links"].items():
        assert 0.7 < link["gbytes_per_s"] * 1e9 / 12.5e6 < 1.3, (name, link)
