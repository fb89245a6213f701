"""The campaign's runner: each case in a folder of its own, its verdict (first match wins: hang,
orphan, outside, traceback, lost, wrong, else survived; error if its fixture could not be built),
the totals per class, the bounds measured, the JSON and README.md."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.faults.core import RESULTS, SETTLE_S, Cmd, Running, code, orphans_after, use_code
from benchmarks.faults.registry import CASES, LEGACY, Case, out_of
from benchmarks.faults.written import changes, digest, make_sentinel, sha, summary


def run_case(c: Case, tmp: str, logdir: str, limit: float) -> Dict[str, Any]:
    """One run of case `c` in folder `tmp`. Beside it: the sentinel folder tmp/outside (its files
    may be a symlink's target; nothing may change there) and, for issue 53's classes, an empty
    cwd of its own (tmp/cwd)."""
    tag = uuid.uuid4().hex
    outside = make_sentinel(os.path.join(tmp, "outside"))
    cwd = code() if c.klass in LEGACY else os.path.join(tmp, "cwd")
    os.makedirs(cwd, exist_ok=True)
    try:
        cmds = c.build(tmp)
    except Exception as e:  # a fixture that could not be built: the case did not run
        return {"results": [], "lost": [], "outside": [], "error": f"{type(e).__name__}: {e}"[:500],
                "verdict": "error"}
    seen = digest(outside)
    kept = {p: digest(p) for p in (c.keep(tmp) if c.keep else [])}
    results: List[Dict[str, Any]] = []
    if c.concurrent:
        results = run_concurrent(cmds, tag, logdir, c.name, limit)
    else:
        for i, cmd in enumerate(cmds):
            r = Running(cmd, tag, logdir, f"{c.name}.{i}", cwd)
            res = r.wait(min(limit, cmd.limit or limit))
            if "first" in r.state:
                res["first_rows"] = r.state["first"]
            if i == 0 and c.name in ("sweep-disk-full-report", "i38-study-on-a-grid-out"):
                res["results_sha"] = sha(os.path.join(out_of(tmp, "s"), "results.jsonl"))
            res["orphans"] = orphans_after(tag)
            res["summary"] = _summary_of(cmd)
            results.append(res)
            if res["hang"]:
                break
            if i == 0 and c.between is not None:
                c.between(tmp)
    lost = c.check(tmp, results) if c.check and not any(r["hang"] for r in results) else []
    for p, before in kept.items():  # a sweep's trials/.tmp is its scratch space, not a result
        lost += [f"{os.path.basename(p)}/{x}" for x in changes(before, digest(p), added_ok=True)
                 if not x.startswith("trials/.tmp")]
    moved = [f"outside --out: {x}" for x in changes(seen, digest(outside))]
    for r in results:
        r.pop("first_rows", None)
    return {"results": results, "lost": lost, "outside": moved, "verdict": verdict(results, lost, moved)}


def _summary_of(cmd: Cmd) -> Optional[Dict[str, Any]]:
    """What the run's summary.json says now (status, steps, where it resumed from), if any."""
    if "--out" not in cmd.args:
        return None
    s = summary(cmd.args[cmd.args.index("--out") + 1])
    return {k: s.get(k) for k in ("status", "steps", "planned_steps", "resumed_from_step")} if s else None


def run_concurrent(cmds: List[Cmd], tag: str, logdir: str, name: str, limit: float) -> List[Dict[str, Any]]:
    """Start cmds[0]; cmds[1] once cmds[0] trains (or at once if both expect {0, 2})."""
    together = isinstance(cmds[0].expect, set)
    first = Running(cmds[0], tag, logdir, f"{name}.0")
    metrics = os.path.join(cmds[0].args[cmds[0].args.index("--out") + 1], "metrics.jsonl")
    t_end = time.monotonic() + limit
    while not together and not os.path.exists(metrics) and first.proc.poll() is None and time.monotonic() < t_end:
        time.sleep(0.02)
    second = Running(cmds[1], tag, logdir, f"{name}.1")
    r2 = second.wait(limit)
    r1 = first.wait(limit)
    if together and sorted([r1["exit"], r2["exit"]]) != [0, 2]:
        r1["wrong"].append(f"exits {r1['exit']} and {r2['exit']}, expected one 0 and one 2")
    r1["orphans"] = r2["orphans"] = orphans_after(tag)
    return [r1, r2]


def verdict(results: List[Dict[str, Any]], lost: List[str], outside: Sequence[str] = ()) -> str:
    if any(r["hang"] for r in results):
        return "hang"
    if any(r["orphans"].get("pids") for r in results):
        return "orphan"
    if outside:
        return "outside"
    if any(r["traceback"] for r in results):
        return "traceback"
    if lost:
        return "lost"
    if any(r["wrong"] for r in results):
        return "wrong"
    return "survived"


CATEGORIES = ("survived", "hang", "orphan", "outside", "traceback", "lost", "wrong", "error")


def totals(flat: List[Dict[str, Any]]) -> Dict[str, int]:
    return {"tried": len(flat), **{k: sum(f["verdict"] == k for f in flat) for k in CATEGORIES}}


BOUNDS = [  # (label, case prefixes, what is measured)
    ("a stopped rank (SIGSTOP) is named and the run exits", ("stop-",), "timeout"),
    ("a hung rank (asleep before a collective) is named and the run exits", ("hang-",), "timeout"),
    ("a killed worker is named and the run exits", ("kill-worker-fault", "kill-worker-signal"), "fault"),
    ("a killed launcher's processes are all gone", ("kill-launcher-",), "gone"),
]


def bounds(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst run per kind of fault: seconds from the fault to the exit (and their slack over
    --timeout), or from a launcher's death to its last process's."""
    out = {}
    for label, prefixes, kind in BOUNDS:
        worst = None
        for rec in records:
            if not rec["name"].startswith(prefixes) or rec["verdict"] != "survived":
                continue
            r = rec["results"][0]
            if kind == "gone":
                v = {"value_s": r["orphans"].get("all_gone_s"), "case": rec["name"], "key": "value_s"}
            else:
                if r["fault_to_exit_s"] is None:
                    continue
                t = _timeout_of(r["command"])
                v = {"value_s": r["fault_to_exit_s"], "timeout_s": t, "case": rec["name"], "key": "value_s"}
                if kind == "timeout" and t is not None:
                    v.update(slack_s=round(r["fault_to_exit_s"] - t, 2), key="slack_s")
            if v["value_s"] is None:
                continue
            if worst is None or v[v["key"]] > worst[worst["key"]]:
                worst = v
        if worst:
            worst.pop("key")
            out[label] = {**worst, "kind": kind}
    return out


def _timeout_of(command: str) -> Optional[float]:
    parts = command.split()
    return float(parts[parts.index("--timeout") + 1]) if "--timeout" in parts else None


def write_readme(doc: Dict[str, Any], json_name: str) -> str:
    recs = doc["cases"]
    tot = doc["totals"]
    lines = [
        "# Fault campaign (issues 15, 38 and 53)",
        "",
        f"`python benchmarks/fault_campaign.py`, {doc['environment']['date']}, on {doc['environment']['cpu']} "
        f"({doc['environment']['cpu_count']} cores), torch {doc['environment']['torch_version']}, code at "
        f"{doc['code']['head'][:10]}{' + uncommitted changes' if doc['code']['dirty'] else ''}. "
        f"Every run is a real `python -m shmlearn` subprocess (2 CPU workers, digits). Raw data: "
        f"[{json_name}]({json_name}).",
        "",
        f"Load average at the start and end: {doc['environment']['loadavg_start'][0]:.1f}, "
        f"{doc['environment']['loadavg_end'][0]:.1f} (other sessions shared the machine; the bounds below are "
        f"under that load).",
        "",
        "| faults | tried | survived | " + " | ".join(CATEGORIES[1:]) + " |",
        "|---|---|---|" + "---|" * (len(CATEGORIES) - 1),
        *(f"| {label} | {t['tried']} | {t['survived']} | " + " | ".join(str(t.get(k, 0)) for k in CATEGORIES[1:])
          + " |" for label, t in [*_class_totals(doc), ("**all**", tot)]),
        "",
        "A run is a *hang* if it did not exit within the campaign's limit "
        f"({doc['limit_s']:g} s, or the case's own bound: 60-180 s), an *orphan* if any process it started "
        f"was alive {SETTLE_S:g} s after it exited, *outside* if anything changed in the sentinel folder beside "
        "its --out, a *traceback* if stderr held one (or C++ frames, or Python's 'Exception ignored' at exit), "
        "*lost* if a row, summary or result already written was lost or torn (or a temporary file left), "
        "*wrong* if the exit code or message was not the promised one (exit 2: one line naming the input), "
        "*error* if the case's fixture could not be built.",
        "",
        "*Fault to exit*: from the fault (a worker seen stopped, the signal sent, or for a hang the last "
        "metrics row before it, an upper bound) to the exit; for a killed launcher, from the kill to "
        "the end of its last process. The worst run is shown.",
        "",
        "| case | class | item | fault | runs | exit (expected) | wall s | fault to exit s | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rec in recs:
        for_runs = rec["runs"]
        exits = sorted({", ".join(str(r["exit"]) for r in run["results"]) for run in for_runs})
        exp = ", ".join(str(r["expected"]) for r in for_runs[-1]["results"])
        walls = [sum(r["wall_s"] for r in run["results"]) for run in for_runs]
        if rec["name"].startswith("kill-launcher-"):  # the exit is the kill: the bound is the workers' end
            fte = [run["results"][0]["orphans"].get("all_gone_s") or 0.0 for run in for_runs]
        else:
            fte = [run["results"][0]["fault_to_exit_s"] for run in for_runs
                   if run["results"] and run["results"][0]["fault_to_exit_s"]]
        verdicts = sorted({run["verdict"] for run in for_runs})
        v = ", ".join(verdicts)
        if verdicts != ["survived"]:
            why = "; ".join(sorted({p for run in for_runs for p in _why(run)}))[:300]
            v = f"**{v}**: {why}"
        what, v = rec["what"].replace("|", "\\|"), v.replace("|", "\\|")
        lines.append(f"| {rec['name']} | {rec.get('class', '')} | {rec['item']} | {what} | {len(for_runs)} | "
                     f"{' / '.join(exits)} ({exp}) | {max(walls):.1f} | {f'{max(fte):.2f}' if fte else ''} | {v} |")
    lines += ["", "## Bounds measured (worst run)", ""]
    for label, b in doc["bounds"].items():
        if b["kind"] == "timeout":
            lines.append(f"- {label}: {b['value_s']:.1f} s after the fault at --timeout {b['timeout_s']:g}, "
                         f"i.e. timeout + {b['slack_s']:.1f} s ({b['case']})")
        elif b["kind"] == "gone":
            lines.append(f"- {label}: {b['value_s']:.1f} s after the kill ({b['case']})")
        else:
            lines.append(f"- {label}: {b['value_s']:.1f} s after the fault ({b['case']})")
    lines.append("")
    return "\n".join(lines)


def _class_totals(doc: Dict[str, Any]) -> List[Any]:
    """(label, totals) per class; a campaign from before issue 53 kept two groups."""
    if "totals_by_class" in doc:
        return [(f"class {k}", t) for k, t in doc["totals_by_class"].items()]
    return [("issue 15's items and the classic faults", doc["totals_issue15_and_classic"]),
            ("beyond the issue (one rank, nobody waiting on it)", doc["totals_beyond"])]


def _why(run: Dict[str, Any]) -> List[str]:
    out = list(run.get("outside", [])) + list(run["lost"]) + ([run["error"]] if run.get("error") else [])
    for r in run["results"]:
        out += r["wrong"]
        if r["hang"]:
            out.append("no exit within the limit")
        if r["traceback"]:
            out.append("traceback: " + r["stderr_tail"].splitlines()[-1][:120] if r["stderr_tail"] else "traceback")
        if r["orphans"].get("pids"):
            out.append(f"{len(r['orphans']['pids'])} processes left ({r['orphans'].get('gone_after_s')} s)")
    return out


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=code(), capture_output=True, text=True).stdout.strip()


def main(argv: Optional[List[str]] = None) -> int:
    from benchmarks.faults import load_all
    from shmlearn.bench.common import environment
    load_all()
    p = argparse.ArgumentParser(description="The fault campaign: every fault and bad input of issues 15, 38 "
                                "and 53 as real subprocesses of python -m shmlearn.")
    p.add_argument("--only", help="comma-separated case names (prefixes; NAME$: that case alone) to run")
    p.add_argument("--class", dest="klass", metavar="NAME[,NAME...]",
                   help="run only these classes (issue15, issue38, and issue 53's: see --list)")
    p.add_argument("--list", action="store_true", help="list the cases (after --only/--class) and their classes")
    p.add_argument("--repeat", type=int, default=None, help="runs per case (default: each case's own, 1-3)")
    p.add_argument("--limit", type=float, default=180.0, help="seconds before a run counts as a hang")
    p.add_argument("--out", default=RESULTS, help="where the JSON and README.md go")
    p.add_argument("--keep", action="store_true", help="keep the run directories and logs (printed)")
    p.add_argument("--readme", metavar="FILE.json", help="only write README.md again from a campaign's JSON")
    p.add_argument("--code", metavar="DIR", help="run the cases against the shmlearn of this checkout (e.g. a "
                   "worktree of an older commit: `git worktree add DIR COMMIT`) [this repository]")
    p.add_argument("--json", metavar="NAME.json", help="the JSON's file name in --out [<date>.json, or "
                   "<date>-partial.json with --only/--class]")
    a = p.parse_args(argv)
    if a.code:
        if not os.path.isfile(os.path.join(a.code, "shmlearn", "__init__.py")):
            raise SystemExit(f"--code {a.code}: no shmlearn/__init__.py there; expected a checkout of the project")
        use_code(a.code)
    if a.readme:
        with open(a.readme) as f:
            doc = json.load(f)
        with open(os.path.join(os.path.dirname(os.path.abspath(a.readme)), "README.md"), "w") as f:
            f.write(write_readme(doc, os.path.basename(a.readme)))
        return 0
    classes = sorted({c.klass for c in CASES})
    if a.klass and not set(a.klass.split(",")) <= set(classes):
        raise SystemExit(f"--class {a.klass}: no such class; classes: {', '.join(classes)}")
    cases = [c for c in CASES if (not a.only or any(c.name == o[:-1] if o.endswith("$") else c.name.startswith(o)
                                                    for o in a.only.split(",")))
             and (not a.klass or c.klass in a.klass.split(","))]
    if a.list:
        for c in cases:
            print(f"{c.klass:12} {c.name:48} {c.what}")
        print(f"{len(cases)} cases; " + ", ".join(f"{k} {sum(c.klass == k for c in cases)}" for k in classes))
        return 0
    if not cases:
        raise SystemExit(f"--only {a.only}: no such case; cases: {', '.join(c.name for c in CASES)}")
    doc: Dict[str, Any] = {"environment": environment("gloo"),
                           "code": {"head": git("rev-parse", "HEAD"),
                                    "dirty": bool(git("status", "--porcelain", "shmlearn"))},
                           "limit_s": a.limit, "settle_s": SETTLE_S, "cases": []}
    work = tempfile.mkdtemp(prefix="shmlearn-faults-")
    t_start = time.monotonic()
    for c in cases:
        runs = []
        for i in range(a.repeat or c.repeat):
            tmp = os.path.join(work, f"{c.name}.{i}")
            os.makedirs(tmp)
            run = run_case(c, tmp, tmp, a.limit)
            runs.append(run)
            r0 = (run["results"] or [{"fault_to_exit_s": None}])[0]
            print(f"{c.name} [{i + 1}] {run['verdict']}: exit {[r['exit'] for r in run['results']]} "
                  f"wall {sum(r['wall_s'] for r in run['results']):.1f} s"
                  + (f", fault to exit {r0['fault_to_exit_s']} s" if r0["fault_to_exit_s"] else "")
                  + ("" if run["verdict"] == "survived" else f" | {'; '.join(_why(run))[:400]}"), flush=True)
        doc["cases"].append({"name": c.name, "class": c.klass, "item": c.item, "what": c.what, "runs": runs})
    flat = [{"name": rec["name"], "class": rec["class"], "item": rec["item"], "verdict": run["verdict"],
             "results": run["results"]} for rec in doc["cases"] for run in rec["runs"]]
    doc["totals"] = totals(flat)
    doc["totals_by_class"] = {k: totals([f for f in flat if f["class"] == k]) for k in classes
                              if any(f["class"] == k for f in flat)}
    doc["bounds"] = bounds(flat)
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    doc["environment"]["loadavg_end"] = list(os.getloadavg())
    os.makedirs(a.out, exist_ok=True)
    name = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d") + ".json"
    if a.only or a.klass:
        name = name.replace(".json", "-partial.json")
    name = a.json or name
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(doc, f, indent=1)
    if not a.only and not a.klass and not a.code:
        with open(os.path.join(a.out, "README.md"), "w") as f:
            f.write(write_readme(doc, name))
    print(json.dumps(doc["totals"]), json.dumps(doc["bounds"], indent=1), sep="\n")
    if a.keep:
        print(f"run directories and logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if doc["totals"]["survived"] == doc["totals"]["tried"] else 1


if __name__ == "__main__":
    sys.exit(main())