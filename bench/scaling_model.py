"""Performance model of the ring at scale: fit alpha-beta-gamma to what we measured, predict.

The time of one ring all-reduce of ``S`` bytes over ``n`` ranks is modelled as

    serial      T = c(n) * (alpha + 2(n-1) * gamma + 2(n-1)/n * B(S))
    overlapped  T = max(alpha + 2(n-1) * h,  2(n-1) * (gamma + S/n * beta_n))

``alpha`` is the fixed cost of one call, ``gamma`` the cost of one hop (the ring makes 2(n-1)
of them), ``beta`` seconds per byte on one link. On a CPU the ranks do every step themselves
(serial): ``B(S) = min(S, C) * beta_cache + max(0, S - C) * beta`` (the first ``C`` bytes,
C = the L2 cache, move faster), and ``c(n) = max(1, n / cores) ** kappa`` is the slowdown
when more ranks than cores share the machine (kappa = 1: a fair share of the cores). On a
GPU the host only launches (``h`` per hop) while the device moves bytes, so the slower of the
two sets the pace (overlapped). ``h`` is fitted when the host-bound points span two rank
counts (else fixed from the data file). ``beta_n`` is ``beta`` for n = 2 (each hop sends to
and receives from one peer) and, where the data file asks for it, a separately fitted
``beta_multi`` for n >= 3 (two different peers per hop): on 4 H100s the per-byte cost is
1.7x the 2-GPU one, which the hop count does not explain (docs/scaling.md, section 1).

The fit (weighted least squares on relative error, parameters kept non-negative) reads its
points from ``bench/scaling_data.json``. The predictions combine the fitted GPU ring with
public interconnect figures and simulate a data-parallel step bucket by bucket, with the
all-reduce of each bucket overlapping the rest of the backward pass, and check the step
model against the measured 4-GPU data-parallel efficiency. ``docs/scaling.md`` states every
assumption. The last line printed is one JSON object with ``max_fit_error``.

    python -m bench.scaling_model
    python -m bench.scaling_model --check docs/benchmarks.md   # its GPU all-reduce tables
    python -m bench.scaling_model --check "$OUT/allreduce.txt" # bench/scaling_run.sh output
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
    """Host time to launch one hop (s), overlapped model only."""
    host_gamma_fitted: bool = False
    """True when ``host_gamma`` was fitted (host-bound points at two or more rank counts)."""
    beta_multi: float | None = None
    """Seconds per byte when n >= 3 (send and receive go to different peers); ``None``: as
    ``beta``. Overlapped model, only where the data file sets ``beta_by_peers``."""
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

    def beta_at(self, n: int) -> float:
        """Seconds per byte on one link in a ring of ``n``."""
        return self.beta_multi if n >= 3 and self.beta_multi is not None else self.beta

    def time(self, n: int, size: float) -> float:
        """Predicted seconds for one all-reduce of ``size`` bytes over ``n`` ranks."""
        if n <= 1:
            return 0.0
        hops = 2 * (n - 1)
        if self.model == "overlapped":
            host = self.alpha + hops * self.host_gamma
            return max(host, hops * (self.gamma + size / n * self.beta_at(n)))
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

    The device part is linear in (gamma, beta[, beta_multi]), the host part in (alpha, h);
    the max of the two is what we measure, so the split that explains the points best is
    chosen exhaustively (points ordered by bytes per rank). ``h`` is fitted when the
    host-bound points span two or more rank counts, else fixed at ``host_gamma_us``.
    """
    fixed_h = spec.get("host_gamma_us")
    fixed_h = None if fixed_h is None else fixed_h * 1e-6
    by_peers = bool(spec.get("beta_by_peers")) and bool(np.any(n >= 3))
    hops = 2 * (n - 1)
    per_link = hops / n * size
    multi = n >= 3
    device_cols = [hops, per_link * ~multi, per_link * multi] if by_peers else [hops, per_link]
    device = np.column_stack(device_cols)
    order = np.argsort(size / n, kind="stable")
    best = None
    for k in range(0, len(y) - 1):
        host_i, dev_i = order[:k], order[k:]
        gamma, beta, *rest = nonneg_wls(device[dev_i], y[dev_i])
        beta_multi = (rest[0] or None) if by_peers else None
        alpha, h, h_fitted = _fit_host(n[host_i], y[host_i], fixed_h)
        fit = RingFit(
            platform=spec["name"],
            alpha=alpha,
            gamma=gamma,
            beta=beta,
            model="overlapped",
            host_gamma=h,
            host_gamma_fitted=h_fitted,
            beta_multi=beta_multi,
        )
        err = _sq_rel_error(fit, n, size, y)
        if best is None or err < best[0]:
            best = (err, fit)
    return best[1]


def _fit_host(n, y, fixed_h: float | None) -> tuple[float, float, bool]:
    """alpha and h of the host floor ``alpha + 2(n-1) h`` from host-bound points."""
    if not len(y):
        return 0.0, fixed_h or 0.0, False
    hops = 2 * (n - 1)
    if len(set(n.tolist())) >= 2:
        alpha, h = nonneg_wls(np.column_stack([np.ones_like(y), hops]), y)
        return alpha, h, True
    h = fixed_h or 0.0
    alpha, _ = nonneg_wls(np.column_stack([np.ones_like(y), np.zeros_like(y)]), y - hops * h)
    return alpha, h, False


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

    Inside a node: our fitted hop cost and bandwidth (the n >= 3 bandwidth where fitted: a
    ring of 8 sends and receives to different peers, as on 4 GPUs). Across nodes: the same
    hop cost plus the difference NCCL's model puts between a network step and an NVLink step
    (6.2 us), and the NIC's line rate. One NIC per node is a commodity cloud node; eight (one
    per GPU) is a DGX H100 / rail-optimised node (8 x 400 Gb/s ConnectX-7).
    """
    extra = (NCCL_HOP_US["net"] - NCCL_HOP_US["nvlink"]) * 1e-6
    common = {
        "gpus_per_node": 8,
        "intra_gamma": gpu.gamma,
        "intra_beta": gpu.beta_at(8),
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
    """Measured ring times from a results file: markdown tables or ``bench.allreduce`` output.

    Understood, in this order (the first that yields rows wins):

    - markdown GPU all-reduce tables, recognised by their header: first column ``GPUs``, and
      columns ``size``, ``native ms`` and ``ring ms`` found by name wherever they stand
      (``| GPUs | size | native ms | native GiB/s | ring ms | ... |``). Every other table
      (the CPU table's ``procs``, a 2-GPU table with no count column) is skipped;
    - the JSON summary line ``bench.allreduce`` prints (``rows`` with ``procs``, ``bytes``,
      ``ring_ms``, ``native_ms``);
    - its per-size lines (``n=4 16MiB native ... ms ... | ring ... ms``).

    Returns:
        Rows with ``procs``, ``bytes``, ``ring_ms`` and, where given, ``native_ms``.
    """
    text = Path(path).read_text()
    return _rows_from_markdown(text) or _rows_from_json(text) or _rows_from_lines(text)


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


_SIZE = re.compile(r"^([\d.]+)\s*(B|KiB|MiB|GiB)$")
_NUMBER = re.compile(r"[\d.]+")


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*").strip() for c in line.strip().strip("|").split("|")]


def _rows_from_markdown(text: str) -> list[dict]:
    """Rows of every GPU all-reduce table (see ``read_results``); other tables are skipped."""
    rows: list[dict] = []
    cols: dict[str, int] | None = None
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            cols = None  # a table ends at the first line that is not a row
            continue
        cells = _cells(line)
        names = [c.lower() for c in cells]
        if names[0] == "gpus" and {"size", "native ms", "ring ms"} <= set(names):
            cols = {name: names.index(name) for name in ("size", "native ms", "ring ms")}
            continue
        if cols is None or not cells[0].isdigit():
            continue  # not in a GPU table, or its |---| line
        size = _SIZE.match(cells[cols["size"]].replace(" ", ""))
        ring = _NUMBER.fullmatch(cells[cols["ring ms"]])
        if not size or not ring:
            continue
        native = _NUMBER.fullmatch(cells[cols["native ms"]])
        rows.append(
            {
                "procs": int(cells[0]),
                "bytes": int(float(size[1]) * _UNITS[size[2]]),
                "native_ms": float(native[0]) if native else None,
                "ring_ms": float(ring[0]),
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


# ------------------------------------------------------------- the step model, checked on 4 GPUs


def dp_check(spec: dict, fits: dict[str, RingFit]) -> list[dict]:
    """Predicted against measured DP efficiency of the 4-GPU run (``dp_check`` in the data).

    Weak scaling; the 1-GPU step is measured (batch / samples per second). Each bucket's
    all-reduce is the fitted ring of the case (``ring``) at n ranks. With ``overlap`` false
    (our GPU ring: its additions run on the compute stream and every hop makes that stream
    wait on NCCL's, so nothing of the backward pass runs under a hop) the step is the 1-GPU
    step plus every bucket's all-reduce. With ``overlap`` true (DDP) both bounds are given:
    nothing hidden, and the bucket-by-bucket overlap of ``backward_overlap_time`` (backward =
    2/3 of the step) with no contention for the SMs.
    """
    buckets = [float(b) for b in spec["buckets_bytes"]]
    out = []
    for case in spec["cases"]:
        fit = fits[case["ring"]]
        step1 = spec["batch_per_gpu"] / case["samples_per_s"]["1"]
        for n_str, measured in case["efficiency"].items():
            n = int(n_str)
            comm = sum(fit.time(n, b) for b in buckets)
            exposed = step1 / (step1 + comm)
            row = {
                "case": case["name"],
                "procs": n,
                "step1_ms": step1 * 1e3,
                "allreduce_ms": comm * 1e3,
                "no_overlap": exposed,
                "overlap": None,
                "measured": measured,
            }
            if case.get("overlap"):
                backward = step1 * 2 / 3
                done, end = 0.0, 0.0
                for b in buckets:
                    done += b
                    end = max(end, backward * done / sum(buckets)) + fit.time(n, b)
                row["overlap"] = step1 / (step1 / 3 + max(backward, end))
            predicted = row["overlap"] if case.get("overlap") else exposed
            row["error"] = (predicted - measured) / measured
            row["error_no_overlap"] = (exposed - measured) / measured
            out.append(row)
    return out


def print_dp_check(rows: list[dict]) -> None:
    print("\n## DP efficiency, model vs the 4 x H100 run (MLP 470M, 1,024 samples per GPU)")
    print(
        "| case | GPUs | 1-GPU step ms | all-reduce ms (model) | model, nothing hidden | "
        "model, overlapped | measured | error (nothing hidden) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        over = f"{r['overlap']:.3f}" if r["overlap"] is not None else "n/a"
        print(
            f"| {r['case']} | {r['procs']} | {r['step1_ms']:.1f} | {r['allreduce_ms']:.1f} | "
            f"{r['no_overlap']:.3f} | {over} | {r['measured']:.3f} | "
            f"{r['error_no_overlap']:+.1%} |"
        )


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
            how = "fitted" if f.host_gamma_fitted else "fixed"
            other = f"h = {f.host_gamma * 1e6:.1f} us/hop host ({how})"
            if f.beta_multi:
                other += f"; n >= 3: 1/beta = {1 / f.beta_multi / 1e9:.1f} GB/s"
        gamma = f"{f.gamma * 1e6:.1f} us" if f.gamma_identified else "in alpha (one n)"
        bw = f"{1 / f.beta / 1e9:.1f} GB/s" if f.beta else "inf"
        if f.beta_multi:
            bw += " (n = 2)"
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
    alt = _one_beta_alternative(data)
    if alt:
        summary["max_fit_error_one_beta"] = alt
    summary.update(_check(args.check, fits))
    if "dp_check" in data:
        dp_rows = dp_check(data["dp_check"], fits)
        print_dp_check(dp_rows)
        summary["dp_check"] = {
            f"{r['case']} n={r['procs']}": {
                "model_no_overlap": round(r["no_overlap"], 3),
                "model_overlap": None if r["overlap"] is None else round(r["overlap"], 3),
                "measured": r["measured"],
            }
            for r in dp_rows
        }
        ours = [abs(r["error"]) for r in dp_rows if r["case"].startswith("ours")]
        summary["dp_check_max_error_ours"] = round(max(ours), 4) if ours else None

    clusters = h100_clusters(fits["nccl-nvlink-h100"])
    dp = dp_table((RESNET50, GPT_1_3B, GPT_1_3B_BIG), clusters, ("flat", "hier", "tree"))
    rail, commodity = clusters[-1], clusters[0]
    pp = dp_pp_table(GPT_1_3B, rail, ((1, 1), (2, 16), (4, 16), (8, 32)))
    knees = crossover_table(rail)
    horovod = horovod_table(fits)

    summary.update(_headlines(dp, pp, knees, horovod, rail, commodity))
    print(json.dumps(summary), flush=True)
    return summary


def _one_beta_alternative(data: dict) -> dict:
    """The worst fit error of each ``beta_by_peers`` platform refitted with one beta for all n.

    Printed so that what the extra term buys is visible, not hidden.
    """
    out = {}
    for spec in data["platforms"]:
        if not spec.get("beta_by_peers"):
            continue
        fit = fit_platform({**spec, "beta_by_peers": False})
        n, size, y = _points(spec)
        errs = [(fit.time(int(a), b) - t) / t for a, b, t in zip(n, size, y, strict=True)]
        worst = int(np.argmax(np.abs(errs)))
        print(
            f"\n(one beta for every n, {spec['name']}: h = {fit.host_gamma * 1e6:.1f} us, "
            f"gamma = {fit.gamma * 1e6:.1f} us, 1/beta = {1 / fit.beta / 1e9:.1f} GB/s; "
            f"worst {errs[worst]:+.1%} at n = {int(n[worst])}, {_human(size[worst])})"
        )
        out[spec["name"]] = round(float(np.max(np.abs(errs))), 4)
    return out


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
