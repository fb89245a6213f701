"""Issue 53's acceptance 1: each case its "Why" lists, the test that covers it, and what the
fault campaign's case for it did at cdb77e3 (the code the issue was filed against) and does now.

The tests were written after the package move and do not import at cdb77e3, so the behaviour is
checked instead: the campaign's case (benchmarks/faults/) runs against each checkout, as
real `python -m shmlearn` subprocesses.

    git worktree add /work/wt53old cdb77e3
    python benchmarks/issue53_acceptance.py --cases            # the campaign's cases, comma-separated
    python benchmarks/fault_campaign.py --only "$(python benchmarks/issue53_acceptance.py --cases)" \\
        --code /work/wt53old --json issue53-at-cdb77e3.json
    python benchmarks/fault_campaign.py --only "$(...)" --json issue53-now.json
    python benchmarks/issue53_acceptance.py --table OLD.json NOW.json   # the table of docs/reliability.md

A case "fails" at a checkout when its verdict is not *survived* (hang, orphan, outside,
traceback, lost, wrong: runner.verdict); the cell shows the verdict and what went wrong.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from typing import Any, Dict, List, Tuple

R = "tests/test_reliability.py::"
Y = "tests/config/test_yaml_types.py::"
RB = "tests/record/test_readback.py::"
SW = "tests/record/test_safe_write.py::"
ENV = "tests/launch/test_detect.py::"
NUM = "tests/analysis/test_numbers.py::"
SIG = "tests/cli/test_signals.py::"
START = "tests/cli/test_cli_start.py::"

MAP: List[Tuple[str, str, str]] = [
    # (the case, the campaign's case, the test: file::name)
    ("data loss: `--resume` of a finished run without checkpoints trains it again", "resume-finished-w1",
     R + "test_resume_of_a_finished_run_without_checkpoints_changes_nothing"),
    ("data loss: `--resume` truncates the file `metrics.jsonl` links to", "link-resume-finished-metrics",
     R + "test_resume_does_not_truncate_a_file_that_metrics_jsonl_links_to"),
    ("config.yaml created where a link in --out points", "link-train-config.yaml-dangling",
     R + "test_a_link_planted_in_out_is_refused_and_nothing_is_created_where_it_points"),
    (".lock created where a link in --out points", "link-train-lock-dangling",
     R + "test_a_link_planted_in_out_is_refused_and_nothing_is_created_where_it_points"),
    ("hang: `MASTER_ADDR=no-such-host.invalid`", "env-master-addr-unresolvable-w1-default-timeout", ""),
    ("YAML: an int for `init`", "yaml-init-int", ""),
    ("YAML: an int for `optimizer`", "yaml-optimizer-int", ""),
    ("YAML: an int for `augment`", "yaml-augment-int", ""),
    ("YAML: an int for `data_dir`", "yaml-data_dir-int", ""),
    ("YAML: a list for `out`", "yaml-out-list", ""),
    ("YAML: a date for `out`", "yaml-out-date", ""),
    ("`sweep.json` not JSON", "read-sweep-rerun-sweep-not-json", ""),
    ("`sweep.json` a list", "read-sweep-report-sweep-a-list", ""),
    ("`results.jsonl` row without `workers`", "read-sweep-report-results-row-without-workers", ""),
    ("`results.jsonl` row with `summary: null`", "read-sweep-advise-results-summary-null", ""),
    ("`results.jsonl` a directory", "read-sweep-report-results-a-directory", ""),
    ("a run's `summary.json` a list", "read-report-summary-a-list", ""),
    ("a run's `config.yaml` a list", "read-report-config-yaml-list", ""),
    ("a garbage line in `metrics.jsonl` for `advise`", "read-advise-metrics-garbage-line", ""),
    ("a missing `metrics.jsonl`", "read-advise-metrics-missing", ""),
    ("a string accuracy in `eval.jsonl` for `report`", "read-report-eval-eval-string-accuracy", ""),
    ("`WORLD_SIZE=two`", "env-world-size-two", ""),
    ("`OMPI_COMM_WORLD_RANK` without its size", "env-ompi-rank-without-size", ""),
    ("`SLURM_NTASKS=x`", "env-slurm-ntasks-x", ""),
    ("`MASTER_PORT=70000`", "env-master-port-70000", ""),
    ("`MASTER_PORT` already taken", "env-master-port-taken-w1", ""),
    ("rank 0 alone in a world of 2", "env-rank0-alone-of-2", ""),
    ("the report's output on a full disk", "full-report-run", ""),
    ("`simulate`'s output on a full disk", "full-simulate", ""),
    ("the report into a read-only folder", "full-report-out-sys", ""),
    ("the report onto a path that is a directory", "full-report-out-a-directory", ""),
    ("`simulate --net-bw 0` (ZeroDivisionError)", "num-simulate--net-bw=0", ""),
    ("`advise` over a huge worker range (MemoryError)", "num-advise--workers=1-100000000000000", ""),
    ("Ctrl-C 0.5 s after start", "int-train-w2-at-0.5s", ""),
    ("Ctrl-C 2.5 s after start", "int-train-w2-at-2.5s", ""),
    ("stdout closed by the reader (`| head -1`)", "pipe-simulate-head", ""),
    ("a strategy file that raises at import", "import-strategy-raises-train", ""),
    ("a `--model` import that loops, then Ctrl-C", "import-model-loops-then-ctrl-c", ""),
    ("a planted `model.pt` in `load_model`", "read-load-model-planted-bytes", ""),
    ("a wrong structure in `load_model`", "read-load-model-wrong-structure", ""),
    ("the Python API from stdin (`python - <<EOF`)", "api-from-stdin-w2", ""),
    ("`simulate --slots 0` exits 0", "num-simulate--slots=0", ""),
    ("`simulate --net-bw nan` exits 0", "num-simulate--net-bw=nan", ""),
    ("`simulate --net-bw -5` exits 0", "num-simulate--net-bw=-5", ""),
    ("a sweep threshold of nan exits 0", "num-sweep--threshold=nan", ""),
    ("YAML `\"yes\"`/`\"no\"` for a boolean (a truthy string)", "yaml-save_model-quoted-no", ""),
    ("a checkpoint that is a list: exit 1", "read-resume-checkpoint-a-list", ""),
    ("a checkpoint missing keys: exit 1", "read-resume-checkpoint-missing-keys", ""),
    ("a checkpoint of wrong shapes: exit 1", "read-resume-checkpoint-wrong-shapes", ""),
    ("a checkpoint that is a FIFO: exit 1", "read-resume-checkpoint-a-fifo", ""),
    ("a renamed checkpoint folder says completed after 80 of 100 steps", "read-resume-checkpoint-renamed", ""),
    ("`--scheduler-args step_size=0` exits 1", "num-scheduler-args-step_size=0", ""),
    ("`--scheduler-args gamma=nan` exits 1", "num-scheduler-args-gamma=nan", ""),
    ("`RANK=3 WORLD_SIZE=2` exits 1", "env-rank-3-of-2", ""),
    ("`sys.exit()` inside a user loss exits 0", "user-loss-sys-exit-0-w2", ""),
    ("SIGHUP to a training run exits 0", "hup-train-w2-launcher-only", ""),
    ("a second Ctrl-C exits -2, not 130", "int-train-w2-training-twice", ""),
    ("a YAML alias bomb's refusal prints 58 MB", "yaml-alias-bomb-train", ""),
    ("a full disk at checkpoint time leaves a `.ckpt.tmp`", "full-checkpoint-w1", ""),
    ("a Dataset whose label dtype changes mid-stream trains on", "user-data-label-dtype-drift", ""),
    ("YAML `off` read as `False`, refused without saying why", "yaml-compile-bare-off", ""),
    ("a user loss returning a float fails in evaluation", "user-loss-returns-float-w2", ""),
    ("a user loss returning a non-scalar fails in evaluation", "user-loss-non-scalar-w2", ""),
    ("a script without the main guard: 'another run is writing there'", "script-without-main-guard-w2", ""),
    ("`WORLD_SIZE=0` reported as a strategy error", "env-world-size-0", ""),
    ("newcomer: a `shmlearn/` folder in the cwd: every worker dies", "cwd-shmlearn-folder-runs-w2", ""),
    ("newcomer: `sweep --out RUN` writes into a train run", "sweep-out-into-train-run", ""),
    ("newcomer: `--no-save-model` help says the opposite", "help-no-save-model", START + "test_a_no_flag_says_what_it_does"),
    ("newcomer: `--worker 1` taken as `--workers`", "abbrev-train--worker", START + "test_no_parser_takes_a_prefix_for_a_flag"),
    ("newcomer: the Ctrl-C line glued to the progress bar, no word of `--resume`", "int-train-progress-bar", ""),
    ("newcomer: a resumed finished run prints nothing", "resume-finished-w2", ""),
]
"""The 1-worker threads case (24x under load) is a measurement, not a pass/fail case:
results/threads_under_load/ and docs/reliability.md."""


def cases() -> List[str]:
    """The campaign's cases, each as `NAME$` (that case alone, not the cases it is a prefix of)."""
    return [c + "$" for _, c, _ in MAP]


def _load(path: str) -> Dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return {rec["name"]: rec for rec in doc["cases"]}


def _cell(rec: Any) -> str:
    if rec is None:
        return "not run"
    verdicts = sorted({run["verdict"] for run in rec["runs"]})
    if verdicts == ["survived"]:
        return "passes"
    why: List[str] = []
    for run in rec["runs"]:
        why += run.get("outside", []) + run["lost"] + ([run["error"]] if run.get("error") else [])
        for r in run["results"]:
            why += r["wrong"] + (["no exit within the limit"] if r["hang"] else [])
            if r["traceback"] and r["stderr_tail"]:
                why.append("traceback: " + r["stderr_tail"].splitlines()[-1][:90])
    text = "; ".join(dict.fromkeys(why))[:160].replace("|", "\\|").replace("\n", " ")
    return f"**{', '.join(verdicts)}**: {text}"


def table(old: str, now: str) -> str:
    a, b = _load(old), _load(now)
    rows = ["| # | case (issue 53, Why) | campaign case | test | at cdb77e3 | now |", "|---|---|---|---|---|---|"]
    for i, (what, c, test) in enumerate(MAP, 1):
        rows.append(f"| {i} | {what} | `{c}` | `{test}` | {_cell(a.get(c))} | {_cell(b.get(c))} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", action="store_true", help="print the campaign's cases, comma-separated")
    p.add_argument("--table", nargs=2, metavar=("OLD.json", "NOW.json"), help="print the markdown table")
    a = p.parse_args(argv)
    if a.cases:
        print(",".join(cases()))
    if a.table:
        print(table(*a.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
