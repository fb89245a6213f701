"""python phased.py OUTFILE -- shmlearn CLI args: wrap functions, log (pid, name, start, dur) lines."""
import functools, importlib, os, sys, time
out = sys.argv[1]; args = sys.argv[3:]
NAMES = """shmlearn.launch.worker:_run_task shmlearn.launch.worker:_join_group shmlearn.train.entry:run_worker
shmlearn.train.entry:trial_main shmlearn.config.train_config:validate shmlearn.train.entry:settle
shmlearn.train.rank:run_rank shmlearn.train.inputs:run_data shmlearn.train.inputs:run_model shmlearn.train.inputs:run_loader
shmlearn.train.inputs:gathered_loader shmlearn.train.guard:check_agreement shmlearn.train.guard:check_replicas
shmlearn.sync.base:SyncStrategy.setup shmlearn.user.optim:build_optimizer shmlearn.user.optim:build_schedule
shmlearn.train.loop:Loop.__init__ shmlearn.record.runs:RunDir.__init__ shmlearn.train.guard:Heartbeat.__init__
shmlearn.step.fast:Stepper.__init__ shmlearn.train.eval_graph:for_step shmlearn.train.loop:Loop._evaluate shmlearn.train.loop:Loop._finish
shmlearn.train.result:gather_ranks shmlearn.record.runs:summarize shmlearn.record.runs:write_results
shmlearn.record.runs:RunDir.write_summary shmlearn.record.runs:RunDir.write_trace shmlearn.record.weights:save
shmlearn.train.guard:Heartbeat.stop shmlearn.step.fast:Stepper.close
shmlearn.sweeps.trials:TrialRunner.done shmlearn.sweeps.trials:TrialRunner.record shmlearn.sweeps.trials:TrialRunner.start
shmlearn.launch.pool:Pool.start shmlearn.sweeps.trials:_fix_out shmlearn.sweeps.trials:TrialRunner.post_bounds
shmlearn.sync.shm:open_collectives shmlearn.models:apply_init""".split()
def log(name, t0, dur):
    with open(out, "a") as f:
        f.write(f"{os.getpid()} {name} {t0:.6f} {dur:.6f}\n")
def wrap(name):
    mod_name, qual = name.split(":")
    try:
        owner = importlib.import_module(mod_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)
    except Exception as e:
        print("no", name, e, file=sys.stderr); return
    @functools.wraps(fn)
    def w(*a, **k):
        t0 = time.time(); p0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            log(name.split(":")[1], t0, time.perf_counter() - p0)
    setattr(owner, attr, w)
    if isinstance(owner, type(sys)):
        for m in list(sys.modules.values()):
            if m is not None and m is not owner and getattr(m, attr, None) is fn:
                setattr(m, attr, w)
import torch  # noqa
import shmlearn.sweeps.trials, shmlearn.train.entry, shmlearn.train.loop, shmlearn.step.fast, shmlearn.sync.shm  # noqa
for n in NAMES: wrap(n)
from shmlearn.cli.main import main
from shmlearn.user import user_main
user_main.program_owns_main()
sys.argv = ["shmlearn"] + args
sys.exit(main(early_workers=True))
