"""benchmarks/fashion_recipe.py: reads the runs' summary.json files, and says a target is met
only when the mean accuracy and mean training time both are, over n >= 5 completed runs."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fashion_recipe as fr  # noqa: E402


def _runs(tmp_path, recipe, accs, times, status="completed"):
    for seed, (a, t) in enumerate(zip(accs, times)):
        d = tmp_path / recipe / f"seed-{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"status": status, "test_accuracy": a, "wall_time_s": t,
                                                    "setup_time_s": 2.0, "device": "GPU X",
                                                    "torch_version": "9.9"}))


def test_summary_and_targets(tmp_path):
    _runs(tmp_path, "fashion-93", [0.931, 0.929, 0.932, 0.930, 0.933], [1.4, 1.45, 1.42, 1.41, 1.43])
    _runs(tmp_path, "fashion-94", [0.941, 0.939, 0.940, 0.942, 0.938], [5.1, 5.0, 5.05, 5.02, 5.03])
    rows = fr.read_runs(str(tmp_path), ["fashion-93", "fashion-94"])
    s93, s94 = fr.summarize(rows)
    assert (s93["n"], round(s93["acc_mean"], 4), s93["acc_min"], s93["acc_max"]) == (5, 0.931, 0.929, 0.933)
    assert s93["met"] and s93["accuracy_met"] and s93["time_met"]
    assert s94["accuracy_met"] and not s94["time_met"] and not s94["met"]
    assert "NO (time)" in fr.table([s93, s94], {"device": "GPU X", "torch_version": "9.9", "date": "d"})


def test_fewer_than_five_or_a_failed_run_is_not_met(tmp_path):
    _runs(tmp_path, "fashion-93", [0.95] * 4, [1.0] * 4)
    (s,) = fr.summarize(fr.read_runs(str(tmp_path), ["fashion-93"]))
    assert s["accuracy_met"] and s["time_met"] and not s["met"]
    launched = [{"recipe": "fashion-93", "seed": i, "rc": 0} for i in range(5)]  # seed 4 left no summary
    (s,) = fr.summarize(fr.read_runs(str(tmp_path), ["fashion-93"], launched))
    assert s["n"] == 4 and s["failed"] == [{"seed": 4, "status": "missing", "rc": 0}] and not s["met"]


def test_the_device_suite_runs_both_recipes_through_this_script():
    import device_suite
    cmd, limit = device_suite.part_commands(lambda n: f"/r/{n}", "1")["fashion-recipe"]
    assert cmd[1].endswith("fashion_recipe.py") and cmd[2] == "run" and "--seeds" in cmd and limit <= 480
    assert fr.TARGETS == {"fashion-93": (0.93, 1.5), "fashion-94": (0.94, 5.0)}
