"""Measure what `shmlearn simulate` is checked against, and commit it (issue 7).

On one machine, in one go: `bench comm` (the alpha-beta fit's input), `bench ps-sim` (the seed's
benchmark), and real `shmlearn train` runs whose step times the predictor must match: a
one-worker run (the compute source) and 2..N-worker runs of each strategy. The runs' summaries go
into one bundle JSON (`simulate --measured` reads it). On CPU it also runs `bench comm` a second time
with `--compute-ms` (the one-worker compute phase before each call), which `simulate
--comm-after-compute` compares with the back-to-back run. Example, the committed CPU results:

    python benchmarks/comm_validation.py --device cpu --tag cpu --workers 2,3,4 --shared-memory off

(the committed Gloo files, from before shared memory; without --shared-memory off the CPU's train
runs and bench comm take the shared-memory path and the files are named comm-shm-*),

and on the 2-GPU device machine (NCCL; comm sizes to 256 MB; alexnet-small and resnet34):

    python benchmarks/comm_validation.py --device cuda --tag h200 --workers 2 --models alexnet-small,resnet34
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _busy_s() -> float:
    """CPU-seconds all processes on the machine have spent busy since boot (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _ours_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # every waited-for descendant: the ranks too
    return r.ru_utime + r.ru_stime


class Interference:
    """How much of the machine's CPU time OTHER processes used while ours ran: the busy time of
    the whole machine minus our descendants' CPU time, over wall time x cores. On a shared
    machine a run with more than --max-interference is repeated (up to --max-tries)."""

    def __enter__(self):
        self.t0, self.b0, self.o0 = time.perf_counter(), _busy_s(), _ours_s()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        others = (_busy_s() - self.b0) - (_ours_s() - self.o0)
        self.fraction = max(0.0, others) / (wall * (os.cpu_count() or 1))


def wait_quiet(limit: float, timeout_s: float = 20.0) -> float:
    """Wait (up to timeout_s) for a 2-second sample in which the machine is under `limit` busy."""
    t_end = time.monotonic() + timeout_s
    while True:
        b0, t0 = _busy_s(), time.perf_counter()
        time.sleep(2.0)
        frac = (_busy_s() - b0) / ((time.perf_counter() - t0) * (os.cpu_count() or 1))
        if frac < limit or time.monotonic() > t_end:
            return frac


def sh(cmd, log):
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}\n[exit {p.returncode}, {time.perf_counter() - t0:.1f} s]\n")
    log.flush()
    print(p.stdout[-2000:] + p.stderr[-2000:], flush=True)
    return p.returncode


ESTIMATOR = ("step time of a run = the median over its --log-every windows of (time_s delta / steps); "
             "CPU: each configuration is run until --min-tries runs in which other processes used at most "
             "--max-interference of the machine's CPU time (busy time from /proc/stat minus our processes' own), "
             "at most --max-tries times; of those quiet tries the median (by step time) is kept (of all tries, "
             "the least disturbed, if none was quiet); phase_s is that try's median window's")


def summarize(runs, max_interference: float = 1.0):
    """One configuration's tries [(run_dir, interference)] -> the entry simulate reads (ESTIMATOR)."""
    reps = []
    for d, frac in runs:
        with open(os.path.join(d, "summary.json")) as f:
            s = json.load(f)
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        windows, prev = [], (0, 0.0)
        for r in rows:
            n = r["step"] - prev[0]
            if n > 0:
                windows.append(((r["time_s"] - prev[1]) / n, r["phase_s"]))
            prev = (r["step"], r["time_s"])
        windows.sort(key=lambda x: x[0])
        med = windows[len(windows) // 2]
        reps.append({"run_dir": d, "interference": frac, "median_step_s": med[0], "median_window_phase_s": med[1],
                     "wall_step_s": s["wall_time_s"] / s["steps"], "windows": len(windows), "summary": s})
    quiet = sorted((r for r in reps if r["interference"] <= max_interference), key=lambda r: r["median_step_s"])
    best = quiet[(len(quiet) - 1) // 2] if quiet else min(reps, key=lambda r: r["interference"])
    s = best["summary"]
    return {"strategy": s["strategy"], "workers": s["workers"], "processes": s["processes"],
            "model": s["model"], "dataset": s["dataset"], "batch_size": s["batch_size"], "device": s["device"],
            "step_s": best["median_step_s"], "phase_s": best["median_window_phase_s"], "status": s["status"],
            "interference": best["interference"],
            "steps": s["steps"], "wall_time_s": s["wall_time_s"],
            "tries": [{k: v for k, v in r.items() if k != "summary"} for r in reps], "summary": s,
            **({"strategy_params": s["strategy_params"]} if "strategy_params" in s else {})}


def sh_many(cmds, log):
    """Start the commands together (P independent one-worker runs computing at once)."""
    for c in cmds:
        print("$", " ".join(c), "&", flush=True)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    outs = [p.communicate()[0] for p in procs]
    for c, p, o in zip(cmds, procs, outs):
        log.write(f"$ {' '.join(c)} &\n{o}\n[exit {p.returncode}]\n")
        print(o[-300:], flush=True)
    log.write(f"[{len(cmds)} together: {time.perf_counter() - t0:.1f} s]\n")
    log.flush()
    return [p.returncode for p in procs]


CONCURRENT = ("P processes at once: each process's step time by the rule above, the median over the P "
              "processes of the least-disturbed try")


def summarize_concurrent(groups, max_interference: float = 1.0):
    """Repeats of P simultaneous one-worker runs -> the compute of one worker while P compute."""
    reps = []
    for dirs, frac in groups:
        per = sorted((summarize([(d, frac)]) for d in dirs), key=lambda e: e["step_s"])
        mid = per[len(per) // 2]
        reps.append({"interference": frac, "step_s": mid["step_s"], "phase_s": mid["phase_s"],
                     "per_process_step_s": [e["step_s"] for e in per], "run_dirs": list(dirs),
                     "summary": mid["summary"]})
    quiet = sorted((r for r in reps if r["interference"] <= max_interference), key=lambda r: r["step_s"])
    best = quiet[(len(quiet) - 1) // 2] if quiet else min(reps, key=lambda r: r["interference"])
    s = best["summary"]
    return {"processes": len(groups[0][0]), "interference": best["interference"], "model": s["model"], "dataset": s["dataset"], "device": s["device"],
            "batch_size": s["batch_size"], "step_s": best["step_s"], "phase_s": best["phase_s"],
            "torch_version": s["torch_version"],
            "tries": [{k: v for k, v in r.items() if k != "summary"} for r in reps]}


def compute_path(a, model: str) -> str:
    """The compute source the train part writes for `model` (and the after-compute comm reads)."""
    return os.path.join(a.results, f"simulate-compute-{a.tag}-{model}.json")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="cpu", help="suffix of the result files")
    ap.add_argument("--workers", default="2,3,4", help="worker counts of the train runs")
    ap.add_argument("--models", default="alexnet-small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=120, help="training steps per run")
    # 10 = train's CPU --check-every: the fast step interpolates time_s between its reads of the
    # loss, so a window must end at a read to hold measured, not interpolated, time.
    ap.add_argument("--log-every", type=int, default=10, help="steps per timing window")
    ap.add_argument("--max-tries", type=int, default=5, help="CPU: runs of a configuration at most")
    ap.add_argument("--min-tries", type=int, default=3,
                    help="CPU: quiet runs of a configuration to take the median of (one try can be an outlier)")
    ap.add_argument("--max-interference", type=float, default=0.10,
                    help="CPU: the share of the machine other processes may use during a kept run")
    ap.add_argument("--max-processes", type=int, default=4, help="skip ps-dedicated runs needing more")
    ap.add_argument("--strategies", default="allreduce,ps,ps-dedicated,weight-avg")
    ap.add_argument("--avg-period", type=int, default=4)
    ap.add_argument("--comm-workers", default=None, help="bench comm world sizes [gloo: --workers; nccl: 1-2]")
    ap.add_argument("--comm-max-size", default="256M")
    ap.add_argument("--comm-factor", default="4")
    ap.add_argument("--comm-compute-ms", default="auto",
                    help="bench comm --compute-ms of the second, after-compute comm run (CPU): the one-worker "
                         "compute phase of the first model [auto]; 0 skips it")
    ap.add_argument("--shared-memory", default="auto", choices=("auto", "off"),
                    help="CPU: the train runs' and bench comm's path (auto: shared memory, the files named comm-shm-*; "
                         "off: Gloo, comm-gloo-*) [auto]")
    ap.add_argument("--ps-sim-workers", default="1-4")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: train,comm,ps-sim")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(HERE), "results"))
    ap.add_argument("--runs", default=None, help="where the run directories go [a fresh temp dir]")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    os.makedirs(a.results, exist_ok=True)
    runs_root = a.runs or os.path.join("/tmp", f"shmlearn-validation-{a.tag}-{int(time.time())}")
    os.makedirs(runs_root, exist_ok=True)
    py = [sys.executable, "-m", "shmlearn"]
    backend = "nccl" if a.device == "cuda" else "gloo"
    path = "shm" if backend == "gloo" and a.shared_memory == "auto" else backend  # the comm files' name
    log = open(os.path.join(a.results, f"simulate-measured-{a.tag}.log"), "a")
    workers = [int(w) for w in a.workers.split(",")]

    if "train" not in skip:
        bundle = {"what": "shmlearn train runs for simulate's validation",
                  "estimator": ESTIMATOR, "device": a.device, "max_tries": a.max_tries,
                  "max_interference": a.max_interference,
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": list(os.getloadavg()),
                  "runs": []}
        for model in a.models.split(","):
            # The compute source: P independent one-worker runs at once (P = 1: the plain one). On
            # a CPU, P processes share cores, caches and memory bandwidth: this is the compute of
            # one worker while P compute, measured without any communication.
            # Ordered by W, each compute measurement next to the runs it predicts: load from other
            # jobs drifts over minutes, so neighbours in time see similar conditions.
            def runs_of(w):
                for strat in a.strategies.split(","):
                    if strat == "ps-dedicated":
                        if w + 1 <= a.max_processes:
                            yield ("ps", w, ["--ps-dedicated"])
                    elif strat == "weight-avg":
                        yield ("weight-avg", w, ["--avg-period", str(a.avg_period)])
                    else:
                        yield (strat, w, [])

            plan = []
            if a.device == "cpu":
                for w in range(1, max(workers) + 1):
                    plan.append(("concurrent", w, []))
                    plan += list(runs_of(w)) if w in workers else []
            else:  # one GPU per worker: nothing is shared, one compute measurement serves all
                plan = [("concurrent", 1, [])] + [r for w in workers for r in runs_of(w)]
            results = {}
            for strat, w, extra in plan:
                name = (f"{model}-{strat}{'-dedicated' if extra[:1] == ['--ps-dedicated'] else ''}"
                        f"{'-k' + extra[1] if strat == 'weight-avg' else ''}-w{w}-b{a.batch}")
                if strat == "concurrent":
                    name = f"{model}-compute-p{w}-b{a.batch}"
                # One thread per worker on CPU: the compute source runs like each of N workers does.
                threads = ["--threads", "1"] if a.device == "cpu" else []
                quiet = 0
                for t in range(a.max_tries):  # until --min-tries runs that other processes left alone
                    out = os.path.join(runs_root, f"{name}-t{t}")
                    cmd = py + ["train", "--model", model, "--dataset", "synthetic", "--device", a.device,
                                "--workers", str(w), "--strategy", strat, "--batch-size", str(a.batch),
                                "--samples", str(a.steps * w * a.batch), "--lr-schedule", "constant", "--lr", "0.01",
                                "--log-every", str(a.log_every), "--eval-points", "1", "--no-progress",
                                "--out", out] + threads + extra
                    if a.device == "cpu":  # the path the comm files measure
                        cmd += ["--shared-memory", a.shared_memory]
                    if a.device == "cpu":
                        wait_quiet(a.max_interference)
                    if strat == "concurrent":
                        cmds = []
                        for i in range(w):
                            c = list(cmd)
                            c[c.index("--workers") + 1], c[c.index("--strategy") + 1] = "1", "allreduce"
                            c[c.index("--samples") + 1] = str(a.steps * a.batch)
                            c[c.index("--out") + 1] = f"{out}-i{i}"
                            cmds.append(c)
                        with Interference() as it:
                            ok = all(rc == 0 for rc in sh_many(cmds, log))
                        run = [c[c.index("--out") + 1] for c in cmds]
                    else:
                        with Interference() as it:
                            ok = sh(cmd, log) == 0
                        run = out
                    print(f"   others used {it.fraction:.0%} of the CPUs during {name} try {t}", flush=True)
                    log.write(f"[interference {it.fraction:.3f}]\n")
                    if ok:
                        results.setdefault(name, {"cmd": cmd, "strat": strat, "extra": extra, "runs": []})
                        results[name]["runs"].append((run, it.fraction))
                        quiet += it.fraction <= a.max_interference
                        if a.device != "cpu" or quiet >= a.min_tries:
                            break
            concurrent = []
            for name, r in results.items():
                if r["strat"] == "concurrent":
                    entry = summarize_concurrent(r["runs"], a.max_interference)
                    entry.update(name=name, command=" ".join(["shmlearn"] + r["cmd"][3:]).rsplit(" --out ", 1)[0]
                                 + f"  (x{entry['processes']} at once)")
                    concurrent.append(entry)
                    continue
                entry = summarize(r["runs"], a.max_interference)
                entry.update(name=name, command=" ".join(["shmlearn"] + r["cmd"][3:]).rsplit(" --out ", 1)[0])
                if r["strat"] == "weight-avg":
                    entry["avg_period"] = int(r["extra"][1])
                bundle["runs"].append(entry)
            # The compute source, in the throughput-JSON shape simulate reads.
            one = min(concurrent, key=lambda e: e["processes"])
            src = {k: one[k] for k in ("device", "model", "dataset", "batch_size", "step_s", "phase_s")}
            src.update(samples_per_s=one["batch_size"] / one["step_s"], estimator=ESTIMATOR + "; " + CONCURRENT,
                       source=one["command"], torch_version=one["torch_version"], date=bundle["date"],
                       concurrent=[{k: e[k] for k in ("processes", "step_s", "phase_s", "command", "tries")}
                                   for e in sorted(concurrent, key=lambda e: e["processes"])])
            with open(compute_path(a, model), "w") as f:
                json.dump(src, f, indent=1)
        bundle["loadavg_end"] = list(os.getloadavg())
        with open(os.path.join(a.results, f"simulate-measured-{a.tag}.json"), "w") as f:
            json.dump(bundle, f, indent=1)

    if "comm" not in skip:
        cw = a.comm_workers or (a.workers if backend == "gloo" else "1-2")
        sh(py + ["bench", "comm", "--backend", backend, "--workers", cw, "--max-size", a.comm_max_size,
                 "--size-factor", a.comm_factor, "--shared-memory", a.shared_memory,
                 "--out", os.path.join(a.results, f"comm-{path}-{a.tag}.json")], log)
        # The collectives as a training step meets them, after its compute: on a CPU whose cores
        # the ranks share this is what simulate must be fitted to (bench/comm.py, docs/scaling.md).
        ms = a.comm_compute_ms
        if ms == "auto":
            ms = "0"
            if a.device == "cpu":
                with open(compute_path(a, a.models.split(",")[0])) as f:
                    ms = f"{json.load(f)['phase_s']['compute'] * 1e3:.1f}"
        if float(ms) > 0:
            if a.device == "cpu":
                wait_quiet(a.max_interference)
            sh(py + ["bench", "comm", "--backend", backend, "--workers", cw, "--max-size", a.comm_max_size,
                     "--size-factor", a.comm_factor, "--compute-ms", ms,
                     "--shared-memory", a.shared_memory,
                     "--out", os.path.join(a.results, f"comm-{path}-{a.tag}-after-compute.json")], log)

    if "ps-sim" not in skip:
        sh(py + ["bench", "ps-sim", "--backend", backend, "--workers", a.ps_sim_workers, "--steps", "20",
                 "--out", os.path.join(a.results, f"ps-sim-{backend}-{a.tag}.json")], log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
