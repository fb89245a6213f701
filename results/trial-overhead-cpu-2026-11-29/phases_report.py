import sys, collections, statistics, json, os
lines=[l.split() for l in open(sys.argv[1])]
d=collections.defaultdict(list)
for pid,name,t0,dur in lines: d[name].append(float(dur)*1e3)
for name,v in d.items():
    print(f"{name:<34} n={len(v):>3} median {statistics.median(v):7.2f} ms  max {max(v):7.2f}  sum {sum(v):7.1f}")
if len(sys.argv)>2:
    t=json.load(open(os.path.join(sys.argv[2],'timing.json')))
    o=[x['s']*1e3 for x in t['overhead_s']]
    m=t['marks']
    print("overhead_s ms:", [round(x,1) for x in o], "median", round(statistics.median(o),1))
    print("setup_s ms:", [round(x['setup_s']*1e3,1) for x in t['overhead_s']], "group_s ms:", [round((x['group_s'] or 0)*1e3,1) for x in t['overhead_s']])
    print("trials phase s:", round(m['trials_done']-m['workers_ready'],3), "training_s", round(t['training_s'],3), "eval_s", round(t['eval_s'],3))
