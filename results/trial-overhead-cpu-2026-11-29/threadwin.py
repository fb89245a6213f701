"""python threadwin.py OUTDIR -- cmd...: per-thread CPU seconds of the process tree within the sweep's
trials phase (timing.json marks workers_ready..trials_done), from /proc samples every 5 ms."""
import os, subprocess, sys, time, collections, json
HZ = os.sysconf("SC_CLK_TCK")
out = sys.argv[1]; cmd = sys.argv[3:]
def tree(root):
    kids = collections.defaultdict(list)
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try: st = open(f"/proc/{p}/stat").read()
        except OSError: continue
        kids[int(st[st.rfind(")")+2:].split()[1])].append(int(p))
    res, todo = [], [root]
    while todo:
        x = todo.pop(); res.append(x); todo += kids.get(x, [])
    return res
p = subprocess.Popen(cmd)
series = collections.defaultdict(list)  # (pid,tid,comm) -> [(t, cpu)]
while p.poll() is None:
    now = time.time()
    for pid in tree(p.pid):
        try: tids = os.listdir(f"/proc/{pid}/task")
        except OSError: continue
        for t in tids:
            try:
                st = open(f"/proc/{pid}/task/{t}/stat").read()
                comm = st[st.find("(")+1:st.rfind(")")]
                r = st[st.rfind(")")+2:].split()
                series[(pid, int(t), comm)].append((now, (int(r[11]) + int(r[12])) / HZ))
            except OSError: pass
    time.sleep(0.005)
m = json.load(open(os.path.join(out, "timing.json")))["marks"]
a, b = m["workers_ready"], m["trials_done"]
def at(s, t):
    v = 0.0
    for ts, c in s:
        if ts <= t: v = c
    return v
print(f"trials phase {b-a:.3f} s")
tot = 0
for k, s in sorted(series.items()):
    d = at(s, b) - at(s, a)
    tot += d
    if d > 0: print(f"  pid {k[0]} tid {k[1]} {k[2]:<16} {d:.3f} s")
print(f"  all: {tot:.3f} s of CPU in {b-a:.3f} s wall ({tot/(b-a):.2f} cores)")
