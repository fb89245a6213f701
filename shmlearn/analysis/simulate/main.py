"""`shmlearn simulate`: predict step time, samples/s and scaling efficiency at 1..1024 workers
from measured compute and communication costs, and check the prediction against measured runs.

Communication: alpha-beta (Hockney) model per collective and backend, fitted to `bench comm`
JSON (--comm; without it or --net-bw, a CPU compute source takes the repository's measurement of
the path a CPU run of one host takes: results/comm-shm-cpu.json, shared memory, with its
after-compute file; --shared-memory off: comm-gloo-cpu.json; a file's path is its env.collectives,
its backend's in files from before the field: analysis/simulate/comm.py). A collective of S bytes (nccl-tests size convention) on W ranks takes

    t = alpha * L(W) + B(W, S) / bw

where L is the number of sequential message steps and B the bytes the busiest link carries, fixed
by the algorithm's form:

    form       L(W)              B(W, S)                 used for
    ring       2(W-1) | W-1      2(W-1)/W S | (W-1)/W S  all_reduce | all_gather, reduce_scatter
    flat       W-1               (W-1)/W S  (gather)     the root talks to every rank in turn:
                                 (W-1) S    (broadcast,  a parameter server's link
                                             reduce)
    tree       ceil(log2 W)      as flat (gather),       binomial tree
                                 ceil(log2 W) S (bcast)
               2 ceil(log2 W)    2(W-1)/W S (all_reduce) double binary tree (NCCL at scale)
    pipelined  W-1               S                       chunked chain (NCCL broadcast/reduce)

alpha (seconds per step) and bw (bytes/s on the link) are fitted by least squares on the
relative error, sum(((pred - t) / t)^2), which is linear in (alpha, 1/bw) and weighs a 4 KB
point as much as a 256 MB one (an absolute fit would ignore every small message); both are kept
>= 0. Every form listed for an op is fitted and the best (lowest RMS relative error) is reported,
which is how the paper's Fig. 6.5-6.6 puzzle is read off our own data (docs/scaling.md).

Compute: from a one-worker shmlearn run (summary.json: phase_s data, compute, update, and the
rest of wall_time_s / steps as `other`) or a throughput JSON {device, model, batch_size, step_s
or samples_per_s, optional phase_s, optional concurrent: [{processes, step_s, phase_s}]}.
`concurrent` holds CPU measurements of one worker's step while P independent one-worker
processes compute at once (no communication): processes on one machine share cores, caches and
memory bandwidth, and that is a property of the compute, not of the network. Beyond the largest
measured P, workers that outnumber the compute slots (`--slots`, e.g. 2 cores) are slowed by
P / max(P measured, slots). On GPUs (one per worker) there is nothing to share.

Strategies (per-worker batch B fixed, as shmlearn's --batch-size is; S = 4 x parameters):
    allreduce       c(data + compute + other + update) + ctl + allreduce(S)
    ps              c(data + compute + other) + ctl + gather(W S) + average(W rows) + update
                    + broadcast(S); gather and broadcast in the flat form: the server's link
                    carries (W-1) gradients in and (W-1) weight copies out per step
    ps-dedicated    as ps with W+1 processes: W workers, and a server that only serves
    weight-avg      c(data + compute + other + update) + ctl + allreduce(S) / K
    ddp             c(data + compute + other + update) + ctl
                    + max(allreduce(last 25 MB bucket), allreduce(S) - 2/3 c compute)
                    (backward, ~2/3 of compute, hides the all-reduce; not validated here)
Each step's first collective after the compute phase (ps: the gather; the others: the
all-reduce) also pays `wake(op, W)` (W computing ranks; weight-avg: wake / K) when
`--comm-after-compute FILE` is given: a second `bench comm` JSON measured with `--compute-ms T` (T ms of computation on every rank before each call, then the
barrier), against which the back-to-back --comm JSON is compared point by point. wake(op, W) =
the median over the sizes measured at W of (after-compute - back-to-back); between and
beyond the measured W, a least-squares line in W - 1 through them (wake(1) = 0). It is not a
property of the links: on a CPU whose cores the ranks share, a collective right after compute
waits for the ranks' communication threads to be scheduled again (2 Gloo ranks on 2 cores: several
times slower after compute than back to back), and a back-to-back fit alone under-predicts a
CPU run's step (the numbers: docs/scaling.md). Without
the file wake is 0, as for GPUs, where no such cost was seen.
all_reduce is the fitted ring unless --allreduce-algo tree (same alpha and bw, log-depth latency:
a what-if for W far beyond the measured, where NCCL leaves the ring).
ctl is the training loop's control all-reduce of 8(KP+2) bytes (P processes), paid once per K
steps: K = train's --check-every (1 in the classic loop; by default 10 on CPU and 50 on CUDA
for the strategies with a fast step, 1 for ddp); c() is
the compute of one worker while W workers compute (see Compute). Scaling efficiency = samples/s at W / (W x samples/s of one worker).

The parts: the network's fits (analysis/simulate/comm.py), one worker's compute (analysis/simulate/compute.py),
the predictor and the check against measured runs (analysis/simulate/predict.py); here the tables, the
plot, `simulate()` and the command line.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from shmlearn.bench.common import MAX_WORKERS, parse_int_list, try_pyplot
from shmlearn.record import safe_write
from shmlearn.errors import BadInput
from shmlearn.config.limits import number, whole
from shmlearn.analysis.simulate.comm import (FORMS, Fit, Network, Wake, best_form, fit_alpha_beta,  # noqa: F401
                                    fit_comm, steps_and_bytes, check_path, collectives_of, cpu_path, default_comm)
from shmlearn.analysis.simulate.compute import (DATASET_SHAPES, Compute, _read_json, load_compute,  # noqa: F401
                                       parameter_count, throughput_compute)
from shmlearn.analysis.simulate.predict import (Machine, _entry, _variant, control_period, default_strategies,  # noqa: F401
                                       load_measured, predict, predict_more, scaling_table, validate)

# --- output ------------------------------------------------------------------------------------

def format_table(rows: List[Dict[str, Any]], strategies: Sequence[str], workers: Sequence[int]) -> str:
    head = f"{'W':>5} " + "".join(f"| {s:^28} " for s in strategies)
    sub = f"{'':>5} " + "".join(f"| {'step ms':>9} {'samples/s':>10} {'eff':>5} " for _ in strategies)
    lines = [head, sub]
    idx = {(r["strategy"], r["workers"]): r for r in rows}
    for w in workers:
        cells = []
        for s in strategies:
            r = idx[(s, w)]
            cells.append(f"| {r['step_s'] * 1e3:>9.2f} {r['samples_per_s']:>10.0f} {r['efficiency']:>5.2f} ")
        lines.append(f"{w:>5} " + "".join(cells))
    return "\n".join(lines)


def format_validation(rows: List[Dict[str, Any]]) -> str:
    lines = [f"{'run':<44}{'measured ms':>12}{'predicted ms':>13}{'error':>8}"]
    for r in rows:
        lines.append(f"{r['name']:<44}{r['measured_step_s'] * 1e3:>12.2f}{r['predicted_step_s'] * 1e3:>13.2f}"
                     f"{r['error'] * 100:>7.1f}%")
    return "\n".join(lines)


def plot(doc: Dict[str, Any], path: str) -> Optional[str]:
    plt = try_pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {}
    for s in doc["strategies"]:
        rs = [r for r in doc["predictions"] if r["strategy"] == s]
        ws = [r["workers"] for r in rs]
        label = f"{s} (K={doc['avg_period']})" if _entry(s).rounds else s
        line, = axes[0].plot(ws, [r["step_s"] * 1e3 for r in rs], label=label)
        colors[s] = line.get_color()
        axes[1].plot(ws, [r["samples_per_s"] for r in rs], color=colors[s], label=label)
        axes[2].plot(ws, [r["efficiency"] for r in rs], color=colors[s], label=label)
    for v in doc.get("validation", []):
        col = colors.get(v["strategy"], "k")
        axes[0].plot(v["workers"], v["measured_step_s"] * 1e3, "o", color=col, mfc="none")
        sps = v["workers"] * doc["compute"]["batch_size"] / v["measured_step_s"]
        axes[1].plot(v["workers"], sps, "o", color=col, mfc="none")
    if doc.get("validation"):
        axes[0].plot([], [], "ko", mfc="none", label="measured")
    axes[0].set(xscale="log", yscale="log", xlabel="workers", ylabel="step time (ms)")
    axes[1].set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s")
    axes[2].set(xscale="log", xlabel="workers", ylabel="scaling efficiency", ylim=(0, 1.05))
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    c = doc["compute"]
    fig.suptitle(f"simulate: {c['model']}, batch {c['batch_size']}/worker, compute on {c['device']}; "
                 f"network: {doc['network']['name']}", fontsize=10)
    return safe_write.finish_figure(fig, path, dpi=110)  # whole or as it was


def _fit_dict(f: Fit) -> Dict[str, Any]:
    d = asdict(f)
    d["bw_GBps"] = f.bw_Bps / 1e9 if f.bw_Bps != math.inf else None
    d["alpha_us"] = f.alpha_s * 1e6
    del d["bw_Bps"]
    return d


def simulate(*, comm: Optional[str] = None, compute: str, ps_sim: Optional[str] = None, net_bw: Optional[float] = None,
             net_latency_us: Optional[float] = None, net_name: Optional[str] = None,
             strategies: Optional[Sequence[str]] = None, workers: Sequence[int] = (),
             avg_period: int = 4, slots: Optional[float] = None, measured: Sequence[str] = (),
             allreduce_algo: str = "ring", check_every: Optional[int] = None, batch: Optional[int] = None,
             comm_after_compute: Optional[str] = None, shared_memory: Optional[str] = None) -> Dict[str, Any]:
    """Fit, predict, validate: the JSON document the CLI writes. Without --comm or --net-bw, a CPU
    compute source takes the repository's measurement of the path its run would use (train's
    --shared-memory, `shared_memory`: auto, the default, is shared memory; off is Gloo)."""
    number("net-bw", net_bw, 0, lo_open=True, unit=" GB/s")  # 0 would divide by zero, nan predicts nan
    number("net-latency-us", net_latency_us, 0, unit=" us")
    number("slots", slots, 0, lo_open=True, unit=" (compute units the workers share)")
    whole("batch", batch, 1)
    whole("avg-period", avg_period, 1)
    comp = load_compute(compute, batch)
    if shared_memory not in (None, "auto", "off"):
        raise BadInput(f"--shared-memory {shared_memory}: choose auto or off")
    all_fits, wake, path, chosen = {}, None, None, "--net-bw" if net_bw is not None else "--comm"
    if net_bw is None and not comm and not comm_after_compute:
        comm, comm_after_compute = default_comm(comp.device, shared_memory)
        chosen = (f"the repository's measurement for a CPU run of one host, --shared-memory "
                  f"{shared_memory or 'auto'}: {cpu_path(shared_memory)}")
    if net_bw is not None:
        net = Network.assumed(net_bw, net_latency_us or 0.0, net_name or f"{net_bw} GB/s network")
    elif comm:
        doc = _read_json("--comm", comm)
        path = collectives_of(doc)
        if shared_memory is not None and path != "nccl":  # a CPU file: the path the flag says a run takes
            check_path(doc, comm, "--comm", cpu_path(shared_memory))
        net = Network.from_comm(doc, comm)
        if comm_after_compute:
            after = _read_json("--comm-after-compute", comm_after_compute)
            check_path(after, comm_after_compute, "--comm-after-compute", path)  # one path, two conditions
            wake = Wake.from_comm(doc, after, comm_after_compute)
        all_fits = {op: {form: _fit_dict(f) for form, f in fs.items()} for op, fs in fit_comm(doc).items()}
    else:
        raise BadInput("give --comm FILE.json (a bench comm result) or --net-bw GBPS [--net-latency-us US]")
    if comm_after_compute and not comm:
        raise BadInput("--comm-after-compute needs --comm: the back-to-back bench comm JSON it is compared with")
    if allreduce_algo not in ("ring", "tree"):
        raise BadInput(f"--allreduce-algo {allreduce_algo}: choose ring or tree")
    if check_every is not None and check_every < 1:
        raise BadInput(f"--check-every {check_every}: must be >= 1")
    m = Machine(compute=comp, net=net, slots=slots, avg_period=avg_period, allreduce_algo=allreduce_algo,
                check_every=check_every, wake=wake)
    avg_src = "estimated: update phase x (rows + 1) / 5"
    if ps_sim:
        ps = _read_json("--ps-sim", ps_sim)
        pts = [(r["workers"], ps["gradient_bytes"], r["stats"]["avg_s"]["median"]) for r in ps["results"]]
        if len({w for w, _, _ in pts}) < 2:
            raise BadInput(f"--ps-sim {ps_sim}: needs at least 2 worker counts to fit the averaging cost")
        x = np.array([[1.0, w * b] for w, b, _ in pts])
        t = np.array([p[2] for p in pts])
        coef = np.linalg.lstsq(x / t[:, None], np.ones_like(t), rcond=None)[0]
        m.avg_alpha_s, m.avg_bps = max(0.0, coef[0]), (1 / coef[1] if coef[1] > 0 else None)
        avg_src = f"fitted to {ps_sim} (gradient average vs workers)"
    workers = sorted(set(workers or [2 ** i for i in range(11)]))
    strategies = list(strategies) if strategies else default_strategies()
    for s in strategies:
        _variant(s, m)  # BadInput for an unknown name
    meas = load_measured(measured)
    workers = sorted(set(workers) | {r["workers"] for r in meas if r["model"] in (None, comp.model)})
    preds = scaling_table(m, strategies, workers)
    val = validate(m, meas)
    return {"schema": 1, "compute": asdict(comp), "network": {
                "name": net.name, "source": net.source, "collectives": path, "chosen": chosen,
                "used": {op: _fit_dict(getattr(net, op)) for op in ("all_reduce", "gather", "broadcast")},
                "all_fits": all_fits,
                "best_forms": {op: min(fs, key=lambda k: fs[k]["rms_rel_err"]) for op, fs in all_fits.items()},
                "fit_method": "least squares on relative error, alpha and 1/bw >= 0",
                "after_compute": None if wake is None else {
                    "source": wake.source, "compute_ms": wake.compute_ms, "points": wake.points,
                    "wake_s": {op: {str(w): v for w, v in per_w.items()} for op, per_w in wake.by_op.items()},
                    "slope_s_per_rank": wake.slope_s}},
            "slots": slots, "avg_period": avg_period, "allreduce_algo": allreduce_algo, "check_every": check_every,
            "check_every_used": {s: control_period(m, s) for s in strategies}, "averaging": avg_src, "strategies": list(strategies),
            "workers": workers, "predictions": preds, "validation": val}


# --- command line (its parser: analysis/simulate/parser.py, without torch) ------------------------

def cmd_simulate(ns) -> int:
    workers = parse_int_list(ns.workers, flag="--workers", most=MAX_WORKERS) if ns.workers else []
    if ns.avg_period < 1:
        raise BadInput(f"--avg-period {ns.avg_period}: must be >= 1")
    doc = simulate(comm=ns.comm, compute=ns.compute, ps_sim=ns.ps_sim, net_bw=ns.net_bw,
                   net_latency_us=ns.net_latency_us, net_name=ns.net_name,
                   strategies=[s for s in ns.strategies.split(",") if s], workers=workers,
                   avg_period=ns.avg_period, slots=ns.slots, measured=ns.measured,
                   allreduce_algo=ns.allreduce_algo, check_every=ns.check_every, batch=ns.batch,
                   comm_after_compute=ns.comm_after_compute, shared_memory=ns.shared_memory)
    with safe_write.cli_output(f"simulate --out {ns.out}"):  # a full disk, a read-only folder: one line
        os.makedirs(ns.out, exist_ok=True)
        safe_write.write_json(os.path.join(ns.out, "simulate.json"), doc, indent=1)
    n = doc["network"]
    print(f"network: {n['name']} ({n['source']}" + (f"; {n['chosen']}" if n["chosen"] not in ("--comm", "--net-bw")
                                                  else "") + ")")
    for op, f in n["used"].items():
        bw = f"{f['bw_GBps']:.3f} GB/s" if f["bw_GBps"] else "inf"
        fit = f", fit RMS rel. error {f['rms_rel_err'] * 100:.1f}% over {f['points']} points" if f["points"] else ""
        print(f"  {op:<10} {f['form']:<5} alpha {f['alpha_us']:.1f} us/step, bw {bw}{fit}")
    if n["after_compute"]:
        a = n["after_compute"]
        per_op = [f"{op} " + ", ".join(f"W={w} +{v * 1e3:.2f} ms" for w, v in a["wake_s"][op].items())
                  for op in ("all_reduce", "gather") if op in a["wake_s"]]
        print(f"  after {a['compute_ms']:g} ms of compute ({a['points']} points), a step's first collective "
              f"costs more: {'; '.join(per_op)}")
    c = doc["compute"]
    print(f"compute: {c['model']}, batch {c['batch_size']}, {c['device']}: data {c['data_s'] * 1e3:.2f} + compute "
          f"{c['compute_s'] * 1e3:.2f} + update {c['update_s'] * 1e3:.2f} + other {c['other_s'] * 1e3:.2f} ms/step; "
          f"{c['parameters']} parameters")
    print(format_table(doc["predictions"], doc["strategies"], doc["workers"]))
    if doc["validation"]:
        print(format_validation(doc["validation"]))
    print(f"wrote {os.path.join(ns.out, 'simulate.json')}")
    with safe_write.cli_output(f"simulate --out {ns.out}"):
        png = plot(doc, os.path.join(ns.out, "simulate.png"))
    print(f"wrote {png}" if png else "no plot: matplotlib is not installed")
    return 0
