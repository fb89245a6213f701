"""A/B interleaved sweeps: python ab.py N label1=tree1 label2=tree2 ... ; prints per-run and median stats."""
import json, os, statistics, subprocess, sys, time
n = int(sys.argv[1]); trees = [a.split("=", 1) for a in sys.argv[2:]]
SWEEP = "sweep --dataset digits --model mlp --samples 8192 --workers 1,2 --batch-size 32,64 --lr 0.1,0.3 --device cpu --no-report".split()
res = {l: [] for l, _ in trees}
losses = {}
for i in range(n):
    for label, tree in trees:
        out = f"/tmp/s30t/ab/{label}-{i}-{int(time.time()*1000)}"
        la = open("/proc/loadavg").read().split()[0]
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "shmlearn", *SWEEP, "--out", out], cwd=tree,
                           env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode: print(p.stderr[-2000:]); sys.exit(1)
        t = json.load(open(f"{out}/timing.json"))
        m = t["marks"]
        over = [o["s"] * 1e3 for o in t["overhead_s"]]
        o1 = [o["s"] * 1e3 for o in t["overhead_s"] if o["workers"] == 1]
        o2 = [o["s"] * 1e3 for o in t["overhead_s"] if o["workers"] == 2]
        rows = [json.loads(l) for l in open(f"{out}/results.jsonl")]
        fl = {r["id"]: r["summary"]["final_loss"] for r in rows}
        losses.setdefault(label, []).append(fl)
        rec = dict(load=float(la), wall=wall, trials=m["trials_done"] - m["workers_ready"], train=t["training_s"],
                   eval=t["eval_s"], over_med=statistics.median(over), over1=statistics.median(o1), over2=statistics.median(o2),
                   over_sum=sum(over) / 1e3)
        res[label].append(rec)
        print(label, i, " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
for label, rs in res.items():
    print(f"== {label}: median over {len(rs)}: " + " ".join(f"{k}={statistics.median(r[k] for r in rs):.3f}" for k in rs[0]))
labels = list(losses)
same = all(fl == losses[labels[0]][0] for l in labels for fl in losses[l])
print("final losses identical across all runs:", same)
json.dump({"res": res, "losses": losses}, open(f"/tmp/s30t/ab/ab-{int(time.time())}.json", "w"), indent=1)
