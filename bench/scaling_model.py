"""Performance model of the ring at scale: fit alpha-beta-gamma to what we measured, predict.

The time of one ring all-reduce of ``S`` bytes over ``n`` ranks is modelled as

    serial      T = c(n) * (alpha + 2(n-1) * gamma + 2(n-1)/n * B(S))
    overlapped  T = max(alpha + 2(n-1) * h,  2(n-1) * (gamma + S/n * beta))

``alpha`` is the fixed cost of one call, ``gamma`` the cost of one hop (the ring makes 2(n-1)
of them), ``beta`` seconds per byte on one link. On a CPU the ranks do every step themselves
(serial): ``B(S) = min(S, C) * beta_cache + max(0, S - C) * beta`` (the first ``C`` bytes,
C = the L2 cache, move faster), and ``c(n) = max(1, n / cores) ** kappa`` is the slowdown
when more ranks than cores share the machine (kappa = 1: a fair share of the cores). On a
GPU the host only launches (``h`` per hop, measured separately) while the device moves
bytes, so the slower of the two sets the pace (overlapped).

The fit (weighted least squares on relative error, parameters kept non-negative) reads its
points from ``bench/scaling_data.json``. The predictions combine the fitted GPU ring with
public interconnect figures and simulate a data-parallel step bucket by bucket, with the
all-reduce of each bucket overlapping the rest of the backward pass. ``docs/scaling.md``
states every assumption. The last line printed is one JSON object with ``max_fit_error``.

    python -m bench.scaling_model
    python -m bench.scaling_model --check docs/benchmarks-gpu-scaling.md   # a later run
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

DATA = Path(__file__).with_name("scaling_data.json")
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
BUCKET_BYTES = 25 * MIB  # engine.collective.buckets default
# NCCL's own cost model (src/graph/tuning.cc, NCCL 2.7-era table hwLat, Ring/Simple): the
# latency of one ring step in microseconds, per kind of link.
NCCL_HOP_US = {"nvlink": 3.4, "pci": 5.7, "net": 9.6}
NCCL_BASE_US = 8.4  # baseLat, Ring/Simple: once per call
NET_EFFICIENCY = 0.9  # share of a NIC's line rate a collective sustains (assumption)


# ---------------------------------------------------------------------------------- the fit


@dataclass(frozen=True, kw_only=True)
class RingFit:
    """One platform's fitted ring: seconds and seconds per byte."""

    platform: str
    alpha: float
    """Fixed cost of one call (s)."""
    gamma: float
    """Cost of one hop (s); 2(n-1) hops per all-reduce."""
    beta: float
    """Seconds per byte on one link."""
    model: str = "serial"
    """``serial`` (CPU: the ranks do everything) or ``overlapped`` (GPU: host launches)."""
    host_gamma: float = 0.0
    """Host time to launch one hop (s), overlapped model only; fixed, not fitted."""
    cores: int | None = None
    """Cores the ranks share (serial model); ``None``: one device per rank."""
    kappa: float = 1.0
    """Oversubscription exponent: ``max(1, n / cores) ** kappa`` (serial model, fitted)."""
    cache_bytes: float = 0.0
    """Bytes that move at ``beta_cache`` instead of ``beta`` (serial model; fixed)."""
    beta_cache: float = 0.0
    """Seconds per byte for the first ``cache_bytes`` (serial model)."""
    gamma_identified: bool = True
    """False when every point had the same rank count, so gamma was folded into alpha."""

    def time(self, n: int, size: float) -> float:
        """Predicted seconds for one all-reduce of ``size`` bytes over ``n`` ranks."""
        if n <= 1:
            return 0.0
        hops = 2 * (n - 1)
        if self.model == "overlapped":
            host = self.alpha + hops * self.host_gamma
            return max(host, hops * (self.gamma + size / n * self.beta))
        cached = min(size, self.cache_bytes)
        per_link = cached * self.beta_cache + (size - cached) * self.beta
        return _contention(n, self.cores, self.kappa) * (
            self.alpha + hops * self.gamma + hops / n * per_link
        )


def _contention(n: int, cores: int | None, kappa: float = 1.0) -> float:
    return max(1.0, n / cores) ** kappa if cores else 1.0


def fit_platform(spec: dict) -> RingFit:
    """Fit one platform of ``scaling_data.json``.

    Args:
        spec: the platform's entry: ``name``, ``model``, ``points`` and, as the model needs,
            ``cores`` or ``host_gamma_us``.

    Returns:
        The fitted ring.

    Raises:
        ValueError: if the entry names an unknown model or has fewer than three points.
    """
    n, size, y = _points(spec)
    if len(y) < 3:
        raise ValueError(f"platform {spec['name']!r}: need at least 3 points, got {len(y)}")
    one_n = len(set(n.tolist())) == 1
    if spec["model"] == "serial":
        return _fit_serial(spec, n, size, y, one_n)
    if spec["model"] == "overlapped":
        return _fit_overlapped(spec, n, size, y)
    raise ValueError(f"platform {spec['name']!r}: model must be 'serial' or 'overlapped'")


def _points(spec: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pts = spec["points"]
    n = np.array([p["procs"] for p in pts], dtype=float)
    size = np.array([p["bytes"] for p in pts], dtype=float)
    y = np.array([p["ms"] for p in pts], dtype=float) / 1e3
    return n, size, y


KAPPAS = np.round(np.arange(0.5, 2.0001, 0.05), 2)


def _fit_serial(spec: dict, n, size, y, one_n: bool) -> RingFit:
    """Linear least squares for alpha, gamma, beta(_cache) at each kappa of a grid; best kept."""
    cores, cache = spec.get("cores"), float(spec.get("cache_bytes", 0))
    hops = 2 * (n - 1)
    best = None
    for kappa in KAPPAS if cores and np.any(n > cores) else (1.0,):
        c = np.array([_contention(int(k), cores, kappa) for k in n])
        cached = np.minimum(size, cache)
        columns = [c, c * hops, c * hops / n * (size - cached), c * hops / n * cached]
        if one_n:  # alpha and 2(n-1)*gamma are the same column: keep one
            columns[1] = np.zeros_like(c)
        alpha, gamma, beta, beta_cache = nonneg_wls(np.column_stack(columns), y)
        fit = RingFit(
            platform=spec["name"],
            alpha=alpha,
            gamma=gamma,
            beta=beta,
            cores=cores,
            kappa=float(kappa),
            cache_bytes=cache,
            beta_cache=beta_cache,
            gamma_identified=not one_n,
        )
        err = _sq_rel_error(fit, n, size, y)
        if best is None or err < best[0]:
            best = (err, fit)
    return best[1]


def _fit_overlapped(spec: dict, n, size, y) -> RingFit:
    """Try every split into host-bound (small) and device-bound (large) points; keep the best.

    The device part is linear in (gamma, beta), the host part in alpha; the max of the two is
    what we measure, so the split that explains the points best is chosen exhaustively.
    """
    h = spec["host_gamma_us"] * 1e-6
    hops = 2 * (n - 1)
    order = np.argsort(size / n)
    best = None
    for k in range(0, len(y) - 1):
        host_i, dev_i = order[:k], order[k:]
        gamma, beta = nonneg_wls(np.column_stack([hops, hops / n * size])[dev_i], y[dev_i])
        base = y[host_i] - hops[host_i] * h if k else np.array([0.0])
        weights = 1 / y[host_i] ** 2 if k else np.array([1.0])
        alpha = max(0.0, float(np.sum(base * weights) / np.sum(weights)))
        fit = RingFit(
            platform=spec["name"],
            alpha=alpha,
            gamma=gamma,
            beta=beta,
            model="overlapped",
            host_gamma=h,
        )
        err = _sq_rel_error(fit, n, size, y)
        if best is None or err < best[0]:
            best = (err, fit)
    return best[1]


def _sq_rel_error(fit: RingFit, n, size, y) -> float:
    pred = np.array([fit.time(int(a), b) for a, b in zip(n, size, strict=True)])
    return float(np.sum(((pred - y) / y) ** 2))


def nonneg_wls(a: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares on relative error (rows weighted by 1/y), every coefficient >= 0.

    Active set: solve, pin the most negative coefficient to zero, solve again.
    """
    w = 1.0 / y
    free = [j for j in range(a.shape[1]) if np.any(a[:, j])]
    coef = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free] * w[:, None], y * w, rcond=None)
        if np.all(sol >= 0):
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


def fit_all(data: dict) -> tuple[dict[str, RingFit], list[dict]]:
    """Fit every platform; return the fits and one row per measured point."""
    fits, rows = {}, []
    for spec in data["platforms"]:
        fit = fit_platform(spec)
        fits[fit.platform] = fit
        for p in spec["points"]:
            pred = fit.time(p["procs"], p["bytes"]) * 1e3
            rows.append(
                {
                    "platform": fit.platform,
                    "procs": p["procs"],
                    "bytes": p["bytes"],
                    "measured_ms": p["ms"],
                    "predicted_ms": pred,
                    "error": (pred - p["ms"]) / p["ms"],
                }
            )
    return fits, rows


# ------------------------------------------------------------------------ clusters and rings


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of ``gpus_per_node`` GPUs: one kind of link inside a node, NICs between them."""

    name: str
    gpus_per_node: int
    intra_gamma: float
    """Seconds per hop on the link inside a node."""
    intra_beta: float
    """Seconds per byte on the link inside a node."""
    nic_gbps: float
    """Line rate of one NIC, Gbit/s."""
    nics_per_node: int
    net_gamma: float
    """Seconds per hop across nodes."""
    alpha: float
    """Fixed cost per call (s)."""
    host_gamma: float
    """Host time per hop (s), overlapped with the device; 0 for a library that runs a whole
    collective in one kernel (NCCL)."""

    def net_beta(self, rings_per_node: int) -> float:
        """Seconds per byte for one of ``rings_per_node`` rings that leave each node at once."""
        share = min(self.nics_per_node, rings_per_node) / rings_per_node
        return 8.0 / (self.nic_gbps * 1e9 * NET_EFFICIENCY * share)


def h100_clusters(gpu: RingFit) -> list[Cluster]:
    """H100 nodes (8 GPUs on NVLink, as we measured) joined by 100 to 400 Gb/s NICs.

    Inside a node: our fitted hop cost and bandwidth. Across nodes: the same hop cost plus the
    difference NCCL's model puts between a network step and an NVLink step (6.2 us), and the
    NIC's line rate. One NIC per node is a commodity cloud node; eight (one per GPU) is a
    DGX H100 / rail-optimised node (8 x 400 Gb/s ConnectX-7).
    """
    extra = (NCCL_HOP_US["net"] - NCCL_HOP_US["nvlink"]) * 1e-6
    common = {
        "gpus_per_node": 8,
        "intra_gamma": gpu.gamma,
        "intra_beta": gpu.beta,
        "net_gamma": gpu.gamma + extra,
        "alpha": gpu.alpha,
        "host_gamma": gpu.host_gamma,
    }
    return [
        Cluster(name=f"{gbps}G x{nics}", nic_gbps=gbps, nics_per_node=nics, **common)
        for gbps, nics in ((100, 1), (200, 1), (400, 1), (400, 8))
    ]


def allreduce_time(
    algorithm: str, n: int, size: float, cluster: Cluster, *, rings_per_node: int = 1
) -> float:
    """Seconds for one all-reduce of ``size`` bytes over ``n`` GPUs.

    Args:
        algorithm: ``flat`` (one ring through every GPU, node after node), ``hier`` (ring
            reduce-scatter inside the node, one ring per local rank across nodes on 1/L of the
            bytes, all-gather inside the node) or ``tree`` (inside the node as ``hier``, a
            double binary tree across nodes: the NCCL-style reference we do not have).
        n: GPUs in the group; spread over nodes ``local`` at a time (see ``rings_per_node``).
        size: bytes each GPU contributes.
        cluster: the machine.
        rings_per_node: independent groups all-reducing at the same time (pipeline stages),
            each with ``gpus_per_node / rings_per_node`` members per node.

    Returns:
        Seconds.
    """
    local = max(1, cluster.gpus_per_node // rings_per_node)
    if n <= local or algorithm == "flat":
        return _flat(n, size, cluster, local=local, rings_per_node=rings_per_node)
    nodes = n // local
    # Every GPU of the node drives one inter-node ring (hier) or tree (tree) at once.
    beta_net = cluster.net_beta(local * rings_per_node)
    intra = 2 * (local - 1) * (cluster.intra_gamma + size / local * cluster.intra_beta)
    if algorithm == "hier":
        inter_hops = 2 * (nodes - 1)
        inter = inter_hops * (cluster.net_gamma + size / local / nodes * beta_net)
    elif algorithm == "tree":
        inter_hops = 2 * math.ceil(math.log2(nodes))
        inter = inter_hops * cluster.net_gamma + 2 * size / local * beta_net / 0.9
    else:
        raise ValueError(f"algorithm must be 'flat', 'hier' or 'tree', got {algorithm!r}")
    host = cluster.alpha + (2 * (local - 1) + inter_hops) * cluster.host_gamma
    return max(host, intra + inter)


def _flat(n: int, size: float, cluster: Cluster, *, local: int, rings_per_node: int) -> float:
    if n <= 1:
        return 0.0
    gamma, beta = cluster.intra_gamma, cluster.intra_beta
    if n > local:  # every step waits for the slowest link: the one leaving the node
        gamma = max(gamma, cluster.net_gamma)
        beta = max(beta, cluster.net_beta(rings_per_node))
    hops = 2 * (n - 1)
    return max(cluster.alpha + hops * cluster.host_gamma, hops * (gamma + size / n * beta))


# ---------------------------------------------------------------------------- training steps


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model's step on one GPU and the gradients it all-reduces."""

    name: str
    grad_bytes: float
    compute_s: float
    """Forward + backward for one GPU's batch; the backward is 2/3 of it."""
    bucket_bytes: float = BUCKET_BYTES
    activation_bytes_per_sample: float = 0.0
    """Bytes a pipeline stage sends per sample (bf16 activations), for DP x PP."""
    samples_per_gpu: int = 1


RESNET50 = Workload(name="ResNet-50 (25.6M, fp32 grads)", grad_bytes=25.6e6 * 4, compute_s=0.085)
GPT_1_3B = Workload(
    name="Transformer 1.3B (fp32 grads)",
    grad_bytes=1.3e9 * 4,
    compute_s=0.323,
    activation_bytes_per_sample=2048 * 2048 * 2,  # seq 2048 x hidden 2048 x bf16
    samples_per_gpu=8,
)
GPT_1_3B_BIG = replace(GPT_1_3B, name="Transformer 1.3B, 256 MiB buckets", bucket_bytes=256 * MIB)


def backward_overlap_time(
    grad_bytes: float, backward_s: float, bucket_bytes: float, allreduce
) -> float:
    """When the last bucket's all-reduce ends, counted from the start of the backward pass.

    Gradients become ready at an even rate through the backward pass; a bucket is all-reduced
    as soon as it is full and the previous one is done (one all-reduce in flight, as ours).
    """
    done, end = 0.0, 0.0
    while done < grad_bytes:
        size = min(bucket_bytes, grad_bytes - done)
        done += size
        ready = backward_s * done / grad_bytes
        end = max(end, ready) + allreduce(size)
    return end


def dp_efficiency(work: Workload, n: int, cluster: Cluster, algorithm: str) -> float:
    """Scaling efficiency of data parallelism: one GPU's step time over the step on ``n``."""
    forward, backward = work.compute_s / 3, work.compute_s * 2 / 3
    end = backward_overlap_time(
        work.grad_bytes,
        backward,
        work.bucket_bytes,
        lambda s: allreduce_time(algorithm, n, s, cluster),
    )
    return work.compute_s / (forward + max(backward, end))


def dp_pp_efficiency(
    work: Workload, n: int, cluster: Cluster, algorithm: str, *, stages: int, micro: int
) -> float:
    """Scaling efficiency of ``n / stages`` replicas of a ``stages``-stage 1F1B pipeline.

    Each replica holds ``stages`` GPUs' worth of samples, so a stage computes as long per step
    as a GPU does in pure DP; the pipeline adds the bubble (P-1)/(M+P-1) and a send of
    activations forward and of their gradients back per micro-batch; stages sit inside one
    node. The gradients of a stage (1/P of the model) are all-reduced across replicas after
    the last micro-batch's backward begins: only that backward hides them.
    """
    slot = work.compute_s / micro
    act = work.activation_bytes_per_sample * work.samples_per_gpu * stages / micro
    p2p = cluster.intra_gamma + act * cluster.intra_beta
    pipeline = (micro + stages - 1) * (slot + 2 * p2p)
    last_backward = slot * 2 / 3
    replicas = n // stages
    end = backward_overlap_time(
        work.grad_bytes / stages,
        last_backward,
        work.bucket_bytes,
        lambda s: allreduce_time(algorithm, replicas, s, cluster, rings_per_node=stages),
    )
    return work.compute_s / (pipeline + max(0.0, end - last_backward))


# ------------------------------------------------------------------- Horovod's 512-GPU run


def horovod_cluster(gpu: RingFit | None) -> Cluster:
    """Horovod's benchmark: 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s (docs/benchmarks).

    With ``gpu=None``: NCCL 2 as Horovod used it (one kernel per collective, NCCL's own step
    latencies; PCIe at the 12 GB/s NCCL's model assumes). With our fit: our ring's call and
    hop costs on the same wires.
    """
    pci_extra = (NCCL_HOP_US["pci"] - NCCL_HOP_US["nvlink"]) * 1e-6
    net_extra = (NCCL_HOP_US["net"] - NCCL_HOP_US["nvlink"]) * 1e-6
    if gpu is None:
        alpha, host = NCCL_BASE_US * 1e-6, 0.0
        intra, net = NCCL_HOP_US["pci"] * 1e-6, NCCL_HOP_US["net"] * 1e-6
    else:
        alpha, host = gpu.alpha, gpu.host_gamma
        intra, net = gpu.gamma + pci_extra, gpu.gamma + net_extra
    return Cluster(
        name="ours" if gpu else "NCCL 2",
        gpus_per_node=4,
        intra_gamma=intra,
        intra_beta=1 / 12e9,
        nic_gbps=25,
        nics_per_node=1,
        net_gamma=net,
        alpha=alpha,
        host_gamma=host,
    )


# P100 (DGX-1) tf_cnn_benchmarks, synthetic data, batch 64 per GPU: InceptionV3 142 img/s,
# VGG16 154, ResNet-50 219, ResNet-152 91.8 (TensorFlow performance guide). ResNet-101 is not
# in that table: interpolated by FLOPs between ResNet-50 and ResNet-152 (about 129 img/s).
HOROVOD_MODELS = {
    "Inception V3": Workload(name="Inception V3", grad_bytes=23.8e6 * 4, compute_s=64 / 142),
    "ResNet-101": Workload(name="ResNet-101", grad_bytes=44.5e6 * 4, compute_s=64 / 129),
    "VGG-16": Workload(name="VGG-16", grad_bytes=138.4e6 * 4, compute_s=64 / 154),
}
HOROVOD_PUBLISHED = {"Inception V3": 0.90, "ResNet-101": 0.90, "VGG-16": 0.68}
HOROVOD_FUSION_BYTES = 64 * MIB  # Tensor Fusion buffer in the 2018 paper


# ---------------------------------------------------------------------------- --check FILE


def read_results(path: str) -> list[dict]:
    """Measured ring times from a results file: ``bench.allreduce`` output or a markdown table.

    Understood, in this order: the JSON summary line ``bench.allreduce`` prints (``rows``
    with ``procs``, ``bytes``, ``ring_ms``, ``native_ms``); its per-size lines (``n=4 16MiB
    native ... ms ... | ring ... ms``); markdown rows ``| procs | size | native ms | ring ms |``.

    Returns:
        Rows with ``procs``, ``bytes``, ``ring_ms`` and, where given, ``native_ms``.
    """
    text = Path(path).read_text()
    rows = _rows_from_json(text) or _rows_from_lines(text) or _rows_from_markdown(text)
    return rows


def _rows_from_json(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"rows"' in line:
            try:
                rows += [r for r in json.loads(line)["rows"] if "ring_ms" in r]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return rows


_LINE = re.compile(
    r"n=(\d+)\s+(\d+)(KiB|MiB|GiB|B)\s+native\s+([\d.]+)\s+ms.*?\|\s*ring\s+([\d.]+)\s+ms"
)
_UNITS = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB}


def _rows_from_lines(text: str) -> list[dict]:
    return [
        {
            "procs": int(m[1]),
            "bytes": int(m[2]) * _UNITS[m[3]],
            "native_ms": float(m[4]),
            "ring_ms": float(m[5]),
        }
        for m in _LINE.finditer(text)
    ]


_MD = re.compile(r"^\|\s*(\d+)\s*\|\s*([\d.]+)\s*(KiB|MiB|GiB)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)")


def _rows_from_markdown(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        m = _MD.match(line.strip())
        if m:
            rows.append(
                {
                    "procs": int(m[1]),
                    "bytes": int(float(m[2]) * _UNITS[m[3]]),
                    "native_ms": float(m[4]),
                    "ring_ms": float(m[5]),
                }
            )
    return rows


def check_rows(rows: list[dict], fits: dict[str, RingFit]) -> list[dict]:
    """Predicted against measured for a results file's rows (no refit)."""
    out = []
    for r in rows:
        for key, platform in (("ring_ms", "nccl-nvlink-h100"), ("native_ms", "nccl-native-h100")):
            if r.get(key) is None or platform not in fits:
                continue
            pred = fits[platform].time(int(r["procs"]), float(r["bytes"])) * 1e3
            out.append(
                {
                    "platform": platform,
                    "procs": int(r["procs"]),
                    "bytes": int(r["bytes"]),
                    "measured_ms": float(r[key]),
                    "predicted_ms": pred,
                    "error": (pred - float(r[key])) / float(r[key]),
                }
            )
    return out


# ------------------------------------------------------------------------------- reporting


def _human(size: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.3g} B"


def print_fits(fits: dict[str, RingFit]) -> None:
    print("## Fitted parameters")
    print("| platform | model | alpha (per call) | gamma (per hop) | 1/beta (per link) | other |")
    print("|---|---|---:|---:|---:|---|")
    for f in fits.values():
        other = ""
        if f.cores:
            cache = f"{1 / f.beta_cache / 1e9:.2f} GB/s" if f.beta_cache else "free"
            other = f"cores={f.cores}, kappa={f.kappa:.2f}, first {_human(f.cache_bytes)}: {cache}"
        if f.model == "overlapped":
            other = f"host {f.host_gamma * 1e6:.0f} us/hop (fixed)"
        gamma = f"{f.gamma * 1e6:.1f} us" if f.gamma_identified else "in alpha (one n)"
        bw = f"{1 / f.beta / 1e9:.1f} GB/s" if f.beta else "inf"
        print(f"| {f.platform} | {f.model} | {f.alpha * 1e6:.1f} us | {gamma} | {bw} | {other} |")


def print_errors(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    print("| platform | procs | size | measured ms | model ms | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['platform']} | {r['procs']} | {_human(r['bytes'])} | "
            f"{r['measured_ms']:.3f} | {r['predicted_ms']:.3f} | {r['error']:+.1%} |"
        )


def dp_table(works, clusters, algorithms) -> dict:
    """Efficiency per (workload, cluster, algorithm) and world size; printed as it goes."""
    results = {}
    print("\n## Predicted DP scaling efficiency (weak scaling, ours: flat / hier / tree)")
    print("| workload | interconnect | " + " | ".join(str(n) for n in WORLD_SIZES) + " |")
    print("|---|---|" + "---:|" * len(WORLD_SIZES))
    for work in works:
        for cluster in clusters:
            cells = []
            for n in WORLD_SIZES:
                effs = {a: dp_efficiency(work, n, cluster, a) for a in algorithms}
                results[(work.name, cluster.name, n)] = effs
                cells.append("/".join(f"{effs[a]:.0%}".rstrip("%") for a in algorithms))
            print(f"| {work.name} | NVLink + {cluster.name} | " + " | ".join(cells) + " |")
    return results


def dp_pp_table(work: Workload, cluster: Cluster, layouts) -> dict:
    results = {}
    print(f"\n## Predicted DP x PP efficiency: {work.name}, NVLink + {cluster.name} (flat/hier)")
    print("| layout (P stages, M micro) | bubble | " + " | ".join(map(str, WORLD_SIZES)) + " |")
    print("|---|---:|" + "---:|" * len(WORLD_SIZES))
    for stages, micro in layouts:
        cells = []
        for n in WORLD_SIZES:
            effs = {
                a: (
                    dp_pp_efficiency(work, n, cluster, a, stages=stages, micro=micro)
                    if stages > 1
                    else dp_efficiency(work, n, cluster, a)
                )
                for a in ("flat", "hier")
            }
            results[(stages, micro, n)] = effs
            cells.append(f"{effs['flat']:.0%}/{effs['hier']:.0%}".replace("%", ""))
        bubble = (stages - 1) / (micro + stages - 1)
        print(f"| P={stages}, M={micro} | {bubble:.0%} | " + " | ".join(cells) + " |")
    return results


def horovod_table(fits: dict[str, RingFit]) -> dict:
    print("\n## Horovod's 512-GPU run (128 x 4 P100, 25 Gbit/s RoCE), model vs published")
    print("| model | published | NCCL 2 flat ring (model) | ours flat | ours hier |")
    print("|---|---:|---:|---:|---:|")
    nccl, ours = horovod_cluster(None), horovod_cluster(fits["nccl-nvlink-h100"])
    out = {}
    for name, work in HOROVOD_MODELS.items():
        work = replace(work, bucket_bytes=HOROVOD_FUSION_BYTES)
        row = {
            "nccl": dp_efficiency(work, 512, nccl, "flat"),
            "ours_flat": dp_efficiency(work, 512, ours, "flat"),
            "ours_hier": dp_efficiency(work, 512, ours, "hier"),
        }
        out[name] = row
        print(
            f"| {name} | {HOROVOD_PUBLISHED[name]:.0%} | {row['nccl']:.0%} | "
            f"{row['ours_flat']:.0%} | {row['ours_hier']:.0%} |"
        )
    return out


def latency_bound_below(algorithm: str, n: int, cluster: Cluster) -> float:
    """The bucket size below which half or more of an all-reduce is latency (bisection)."""
    floor = allreduce_time(algorithm, n, 0.0, cluster)
    lo, hi = 1.0, float(1 << 50)
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if allreduce_time(algorithm, n, mid, cluster) < 2 * floor:
            lo = mid
        else:
            hi = mid
    return hi


def crossover_table(cluster: Cluster) -> dict:
    """Time of one 25 MiB bucket, and the size under which each algorithm is latency-bound."""
    print(f"\n## Where the ring turns latency-bound (NVLink + {cluster.name})")
    print("| GPUs | 25 MiB: flat ms | hier ms | tree ms | latency >= half below: flat | hier |")
    print("|---:|---:|---:|---:|---:|---:|")
    out = {}
    for n in WORLD_SIZES:
        t = {a: allreduce_time(a, n, BUCKET_BYTES, cluster) for a in ("flat", "hier", "tree")}
        knee = {a: latency_bound_below(a, n, cluster) for a in ("flat", "hier")}
        out[n] = {**t, "knee_flat": knee["flat"], "knee_hier": knee["hier"]}
        print(
            f"| {n} | {t['flat'] * 1e3:.2f} | {t['hier'] * 1e3:.2f} | {t['tree'] * 1e3:.2f} | "
            f"{_human(knee['flat'])} | {_human(knee['hier'])} |"
        )
    return out


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(DATA), help="measured points (JSON)")
    parser.add_argument("--check", default=None, help="a results file to compare, no refit")
    args = parser.parse_args(argv)

    data = json.loads(Path(args.data).read_text())
    fits, fit_rows = fit_all(data)
    print_fits(fits)
    print_errors("Fit: measured vs model", fit_rows)
    summary: dict = {"max_fit_error": round(max(abs(r["error"]) for r in fit_rows), 4)}
    summary["max_fit_error_by_platform"] = {
        p: round(max(abs(r["error"]) for r in fit_rows if r["platform"] == p), 4) for p in fits
    }
    summary.update(_check(args.check, fits))

    clusters = h100_clusters(fits["nccl-nvlink-h100"])
    dp = dp_table((RESNET50, GPT_1_3B, GPT_1_3B_BIG), clusters, ("flat", "hier", "tree"))
    rail, commodity = clusters[-1], clusters[0]
    pp = dp_pp_table(GPT_1_3B, rail, ((1, 1), (2, 16), (4, 16), (8, 32)))
    knees = crossover_table(rail)
    horovod = horovod_table(fits)

    summary.update(_headlines(dp, pp, knees, horovod, rail, commodity))
    print(json.dumps(summary), flush=True)
    return summary


def _check(path: str | None, fits: dict[str, RingFit]) -> dict:
    if not path:
        print("\n(no --check file: the 4-GPU results file was not given)")
        return {"check_file": None}
    if not Path(path).exists():
        print(f"\n(--check {path}: no such file yet)")
        return {"check_file": path, "check_rows": 0}
    rows = check_rows(read_results(path), fits)
    if not rows:
        print(f"\n(--check {path}: no all-reduce rows found)")
        return {"check_file": path, "check_rows": 0}
    print_errors(f"Check against {path} (predicted from the fit above, not refitted)", rows)
    ours = [abs(r["error"]) for r in rows if r["platform"] == "nccl-nvlink-h100"]
    return {
        "check_file": path,
        "check_rows": len(rows),
        "check_max_error": round(max(abs(r["error"]) for r in rows), 4),
        "check_max_error_ours": round(max(ours), 4) if ours else None,
    }


def _headlines(dp, pp, knees, horovod, rail: Cluster, commodity: Cluster) -> dict:
    r50, gpt = RESNET50.name, GPT_1_3B.name
    return {
        "resnet50_512_rail400x8": {
            a: round(dp[(r50, rail.name, 512)][a], 3) for a in ("flat", "hier", "tree")
        },
        "resnet50_512_100x1": {
            a: round(dp[(r50, commodity.name, 512)][a], 3) for a in ("flat", "hier", "tree")
        },
        "gpt1.3b_1024_rail400x8": {
            a: round(dp[(gpt, rail.name, 1024)][a], 3) for a in ("flat", "hier", "tree")
        },
        "gpt1.3b_256mib_1024_rail400x8": {
            a: round(dp[(GPT_1_3B_BIG.name, rail.name, 1024)][a], 3)
            for a in ("flat", "hier", "tree")
        },
        "gpt1.3b_1024_dp_pp8_rail400x8": {
            a: round(pp[(8, 32, 1024)][a], 3) for a in ("flat", "hier")
        },
        "latency_bound_below_bytes_1024": {
            "flat": round(knees[1024]["knee_flat"]),
            "hier": round(knees[1024]["knee_hier"]),
        },
        "horovod_512_model": {
            k: {a: round(v, 3) for a, v in r.items()} for k, r in horovod.items()
        },
        "horovod_512_published": HOROVOD_PUBLISHED,
    }


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
