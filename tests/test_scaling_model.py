"""The performance model: the fit recovers what it should, predictions move the right way."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench import scaling_model as sm

MIB = 1 << 20
SIZES = [1 << 10, MIB, 16 * MIB, 64 * MIB, 256 * MIB]


def _points(fit: sm.RingFit, procs=(2, 4, 8)) -> list[dict]:
    return [{"procs": n, "bytes": s, "ms": fit.time(n, s) * 1e3} for n in procs for s in SIZES]


def test_serial_fit_recovers_alpha_gamma_beta():
    truth = sm.RingFit(platform="synthetic", alpha=50e-6, gamma=20e-6, beta=1 / 10e9)
    fit = sm.fit_platform({"name": "synthetic", "model": "serial", "points": _points(truth)})
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.gamma == pytest.approx(truth.gamma, rel=1e-6)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)


def test_serial_fit_recovers_oversubscription_and_cache():
    truth = sm.RingFit(
        platform="cpu",
        alpha=100e-6,
        gamma=60e-6,
        beta=1 / 2.5e9,
        cores=2,
        kappa=1.25,
        cache_bytes=MIB,
        beta_cache=1 / 5e9,
    )
    spec = {"name": "cpu", "model": "serial", "cores": 2, "cache_bytes": MIB}
    fit = sm.fit_platform({**spec, "points": _points(truth)})
    assert fit.kappa == pytest.approx(1.25)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)
    assert fit.beta_cache == pytest.approx(truth.beta_cache, rel=1e-6)


def test_overlapped_fit_recovers_device_and_host_terms():
    truth = sm.RingFit(
        platform="gpu",
        alpha=120e-6,
        gamma=25e-6,
        beta=1 / 250e9,
        model="overlapped",
        host_gamma=67e-6,
    )
    sizes = [MIB, 16 * MIB, 128 * MIB, 256 * MIB, 512 * MIB, 1 << 30]
    points = [{"procs": 2, "bytes": s, "ms": truth.time(2, s) * 1e3} for s in sizes]
    fit = sm.fit_platform(
        {"name": "gpu", "model": "overlapped", "host_gamma_us": 67, "points": points}
    )
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.gamma == pytest.approx(truth.gamma, rel=1e-6)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)


def test_overlapped_fit_with_two_rank_counts_fits_h_and_a_beta_per_peer_case():
    truth = sm.RingFit(
        platform="gpu",
        alpha=120e-6,
        gamma=25e-6,
        beta=1 / 250e9,
        model="overlapped",
        host_gamma=55e-6,
        beta_multi=1 / 150e9,
    )
    sizes = [MIB, 16 * MIB, 128 * MIB, 256 * MIB, 512 * MIB, 1 << 30]
    points = [{"procs": n, "bytes": s, "ms": truth.time(n, s) * 1e3} for n in (2, 4) for s in sizes]
    spec = {"name": "gpu", "model": "overlapped", "host_gamma_us": 67, "beta_by_peers": True}
    fit = sm.fit_platform({**spec, "points": points})
    assert fit.host_gamma_fitted
    assert fit.host_gamma == pytest.approx(55e-6, rel=1e-6)  # not the fixed 67 us
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(truth.beta, rel=1e-6)
    assert fit.beta_multi == pytest.approx(truth.beta_multi, rel=1e-6)


def test_one_process_count_folds_gamma_into_alpha():
    truth = sm.RingFit(platform="x", alpha=30e-6, gamma=0.0, beta=1 / 300e9)
    fit = sm.fit_platform({"name": "x", "model": "serial", "points": _points(truth, (2,))})
    assert not fit.gamma_identified
    assert fit.gamma == 0.0
    assert fit.alpha == pytest.approx(30e-6, rel=1e-6)


def test_nonneg_wls_never_returns_a_negative_coefficient():
    import numpy as np

    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])  # falling: the free slope would be negative
    coef = sm.nonneg_wls(a, y)
    assert min(coef) >= 0.0


def test_fit_rejects_an_unknown_model():
    points = [{"procs": 2, "bytes": s, "ms": 1.0} for s in SIZES]
    with pytest.raises(ValueError, match="model must be"):
        sm.fit_platform({"name": "x", "model": "magic", "points": points})


@pytest.fixture(scope="module")
def clusters():
    fits, _ = sm.fit_all(json.loads(sm.DATA.read_text()))
    return sm.h100_clusters(fits["nccl-nvlink-h100"])


@pytest.mark.parametrize("algorithm", ["flat", "hier", "tree"])
def test_allreduce_time_grows_with_size(clusters, algorithm):
    for n in (8, 64, 1024):
        times = [sm.allreduce_time(algorithm, n, s, clusters[-1]) for s in SIZES]
        assert times == sorted(times)


def test_flat_ring_time_grows_with_world_size(clusters):
    times = [sm.allreduce_time("flat", n, 25 * MIB, clusters[0]) for n in sm.WORLD_SIZES]
    assert times == sorted(times)


@pytest.mark.parametrize("algorithm", ["flat", "hier"])
def test_efficiency_falls_with_world_size_and_stays_in_range(clusters, algorithm):
    effs = [sm.dp_efficiency(sm.RESNET50, n, clusters[0], algorithm) for n in sm.WORLD_SIZES]
    assert all(0 < e <= 1 for e in effs)
    assert effs == sorted(effs, reverse=True)


def test_a_faster_network_never_hurts(clusters):
    for n in sm.WORLD_SIZES:
        effs = [sm.dp_efficiency(sm.GPT_1_3B, n, c, "hier") for c in clusters]
        assert effs == sorted(effs)


def test_hierarchical_beats_flat_across_nodes(clusters):
    for n in (64, 256, 1024):
        flat = sm.allreduce_time("flat", n, 25 * MIB, clusters[-1])
        assert sm.allreduce_time("hier", n, 25 * MIB, clusters[-1]) < flat


def test_more_micro_batches_shrink_the_pipeline_bubble(clusters):
    effs = [
        sm.dp_pp_efficiency(sm.GPT_1_3B, 64, clusters[-1], "hier", stages=4, micro=m)
        for m in (4, 8, 16, 32)
    ]
    assert effs == sorted(effs)


def test_no_communication_means_full_efficiency(clusters):
    free = replace(clusters[-1], alpha=0.0, host_gamma=0.0, intra_gamma=0.0, net_gamma=0.0)
    free = replace(free, intra_beta=0.0, nic_gbps=1e12)
    assert sm.dp_efficiency(sm.RESNET50, 512, free, "hier") == pytest.approx(1.0, abs=1e-6)


def test_read_results_understands_the_bench_output_and_markdown(tmp_path):
    lines = tmp_path / "allreduce.txt"
    lines.write_text(
        "n=4   16MiB native     0.100 ms  300.00 GiB/s | ring     0.300 ms  100.00 GiB/s "
        "ratio  0.33 | ring bf16     0.310 ms speedup  0.32\n"
    )
    assert sm.read_results(str(lines)) == [
        {"procs": 4, "bytes": 16 * MIB, "native_ms": 0.1, "ring_ms": 0.3}
    ]
    table = tmp_path / "results.md"
    table.write_text(
        "| GPUs | size | native ms | ring ms |\n|---|---|---|---|\n| 4 | 64 MiB | 0.4 | 0.5 |\n"
    )
    assert sm.read_results(str(table))[0]["ring_ms"] == 0.5
    summary = tmp_path / "summary.txt"
    summary.write_text(json.dumps({"rows": [{"procs": 4, "bytes": MIB, "ring_ms": 0.2}]}) + "\n")
    assert sm.read_results(str(summary))[0]["bytes"] == MIB


CPU_AND_GPU_TABLES = """\
### CPU

| procs | size | native ms | ring ms | ring GiB/s | ratio | ring bf16 ms | bf16 speedup |
|---:|---:|---:|---:|---:|---:|---:|---:|
| 4 | 256 MiB | 640 | 416 | 0.90 | 1.54 | 446 | 1.43 |

| size | native ms | ring ms | ring GiB/s | ratio |
|---:|---:|---:|---:|---:|
| 1 MiB | 0.030 | 0.235 | 4.2 | 0.13 |

### GPU

| GPUs | size | native ms | native GiB/s | ring ms | ring GiB/s | ratio |
|---:|---:|---:|---:|---:|---:|---:|
| 2 | 256 MiB | 0.898 | 278 | 1.077 | 232 | **0.83** |
| 4 | 1 MiB | 0.037 | 39.4 | 0.470 | 3.1 | 0.08 |
| 4 | 256 MiB | 1.182 | 317 | 2.794 | 134 | **0.42** |

| case | 1-GPU step | measured |
|---|---:|---:|
| 4 | 75.9 ms | 0.792 |
"""


def test_check_reads_only_the_gpu_allreduce_tables(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(CPU_AND_GPU_TABLES)
    assert sm.read_results(str(doc)) == [
        {"procs": 2, "bytes": 256 * MIB, "native_ms": 0.898, "ring_ms": 1.077},
        {"procs": 4, "bytes": MIB, "native_ms": 0.037, "ring_ms": 0.47},
        {"procs": 4, "bytes": 256 * MIB, "native_ms": 1.182, "ring_ms": 2.794},
    ]


def test_model_reproduces_the_4gpu_measurements():
    data = json.loads(sm.DATA.read_text())
    fits, rows = sm.fit_all(data)
    assert max(abs(r["error"]) for r in rows) <= 0.2
    assert fits["nccl-nvlink-h100"].host_gamma_fitted
    dp = sm.dp_check(data["dp_check"], fits)
    ours = [r for r in dp if r["case"].startswith("ours")]
    assert ours
    assert all(abs(r["error"]) <= 0.2 for r in ours)


def test_cli_last_line_is_json_with_the_fit_error(capsys, tmp_path):
    results = tmp_path / "four.txt"
    results.write_text(
        "n=4   64MiB native     0.300 ms  300.00 GiB/s | ring     0.500 ms  100.00 GiB/s\n"
    )
    sm.main(["--check", str(results)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert 0 <= summary["max_fit_error"] <= 0.2
    assert summary["check_rows"] == 2
    assert "horovod_512_model" in summary
