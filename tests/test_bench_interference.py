"""The benchmark notices a busy machine (specdec/bench/interference.py): trials far off their pair
are run again and counted, the CPU time others took is measured, and a real competing process,
started and stopped by the test, neither goes unreported nor stays in a prompt's median."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from specdec.bench.interference import RERUN_ROUNDS, STALL, MachineLoad, rerun_stalls, stalled
from specdec.bench.runner import BenchConfig, _per_prompt, run_benchmark
from tiny import needs_model

MODEL = "smollm2-135m-instruct"
TORCH_THREADS = 2  # read by conftest.py


def rec(method, prompt, trial, seconds):
    return {"method": method, "prompt": prompt, "trial": trial, "seconds": seconds}


def test_a_trial_far_off_its_pair_is_stalled():
    records = [rec("a", "p", 0, 1.0), rec("a", "p", 1, 1.1), rec("a", "p", 2, 5.0),  # the third stalled
               rec("b", "p", 0, 1.0), rec("b", "p", 1, 1.25),  # under STALL times its pair: kept
               rec("a", "q", 0, 9.0)]  # alone: nothing to compare with
    assert stalled(records) == [2]
    # Two trials: the slower of a pair far apart is the stalled one.
    assert stalled([rec("a", "p", 0, 1.0), rec("a", "p", 1, STALL * 1.0 + 0.1)]) == [1]
    # A trial during which other processes took the cores, however long it took.
    assert stalled([rec("a", "p", 0, 1.0), rec("a", "p", 1, 1.0) | {"others_cores": 0.9}]) == [1]


def test_stalled_trials_are_run_again_and_keep_their_stalled_time():
    records = [rec("a", "p", 0, 1.0), rec("a", "p", 1, 1.1), rec("a", "p", 2, 5.0)]
    times = iter([6.0, 1.05])  # stalled again once, then a clean trial
    rerun_stalls(records, lambda r: r | {"seconds": next(times)}, log=lambda msg: None)
    assert records[2]["seconds"] == 1.05 and records[2]["stalled_seconds"] == [5.0, 6.0]
    assert "stalled_seconds" not in records[0]


def test_a_trial_that_meets_interference_on_every_run_is_reported_and_left_out(monkeypatch):
    monkeypatch.setattr("specdec.bench.interference.QUIET_WAIT", 0.0)  # no quiet moment comes
    records = [rec("a", "p", 0, 1.0), rec("a", "p", 1, 1.1), rec("a", "p", 2, 5.0)]
    unclean = rerun_stalls(records, lambda r: r | {"seconds": 4.0}, log=lambda msg: None)
    assert unclean == [2] and len(records[2]["stalled_seconds"]) == RERUN_ROUNDS
    machine = MachineLoad().start().stop({"a": (1, 3, 1)})
    assert machine["busy"] and any("every run" in reason for reason in machine["reasons"])
    # The prompt's median then comes from its clean trials.
    for r in records:
        r |= {"tokens": [1, 2], "prefill_seconds": None, "stats": None}
    records[2]["unclean"] = True
    prompt = type("Prompt", (), {"id": "p"})
    assert _per_prompt(records, "a", [prompt])["p"]["seconds"] == 1.05


BURN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    t = time.time() + {on}\n" \
       "    while time.time() < t: pass\n    time.sleep({off})\n"


def competitors(n: int, on: float, off: float, seconds: float) -> list[subprocess.Popen]:
    """n processes that each spin a core for `on` seconds, then sleep `off`, for at most `seconds`."""
    code = BURN.format(seconds=seconds, on=on, off=off)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def test_machine_load_sees_another_process():
    load = MachineLoad().start()
    procs = competitors(1, on=1.0, off=0.0, seconds=1.5)
    try:
        time.sleep(1.5)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    m = load.stop({})
    if "others_cores" not in m:
        pytest.skip("no /proc/stat here")
    assert m["others_cores"] > 0.5 and m["busy"] and "other processes" in m["reasons"][0]


PROMPTS = [
    {"id": "rag", "category": "rag", "turns": [
        "Read the passage and answer the question.\n\nPassage: The Lindenfeld public library opened in 1892 in two "
        "rooms above the old grain exchange. It moved to its present building on Canal Street in 1958 and today "
        "holds about 310,000 books.\n\nQuestion: Where is the library today, and since when? Quote the passage."]},
    {"id": "sum", "category": "summarization", "turns": [
        "Summarize in two sentences: The river Alder floods most springs. In 1911 the town built a stone wall "
        "along its east bank, and in 1974 a second wall on the west bank. Since then the town square has stayed "
        "dry, but the fields downstream flood more often than before."]},
]


@needs_model
def test_a_competing_process_is_flagged_and_its_trials_are_run_again(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in PROMPTS) + "\n")
    cfg = BenchConfig(model=MODEL, threads=TORCH_THREADS, prompts=str(path), max_tokens=96, trials=3, ks=["auto"],
                      peers=False, llama_cpp_peers=False)
    clean = run_benchmark(cfg, progress=False, log=lambda msg: None)
    # Two processes that take both cores in bursts: trials that meet a burst stall. Between bursts
    # the machine is quiet for twice the longest trial (at least 1.2 s), so a re-run can be clean;
    # a machine never quiet that long is flagged instead (the test above).
    longest = max(r["seconds"] for r in clean["records"])
    procs = competitors(2, on=0.5, off=max(1.2, 2 * longest), seconds=300)
    try:
        busy = run_benchmark(cfg, progress=False, log=lambda msg: None)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    machine, records = busy["machine"], busy["records"]
    assert machine["busy"], machine
    # Over the whole run the two took 0.10-0.21 cores on a Zen 3 VM (re-runs wait for quiet), against
    # 0.01 without them: a margin of 0.1 failed now and then.
    assert machine["others_cores"] > clean["machine"]["others_cores"] + 0.05
    # The trials that met a burst were run again, and each kept the time of the run that met it.
    rerun = [r for r in records if "stalled_seconds" in r]
    assert rerun and sum(m["rerun"] for m in machine["reruns"].values()) == len(rerun)
    # What a prompt's median reads is clean: no trial kept for it met interference, by the bench's
    # own rule; one that met it on every run is marked and left out. (Whether the ratio then equals
    # the clean run's is not asserted: on a shared VM two clean runs of this file differ by up to
    # 14% in their ratio, as much as these bursts move it when nothing is re-run.)
    assert all(records[i].get("unclean") for i in stalled(records)), [records[i] for i in stalled(records)]
