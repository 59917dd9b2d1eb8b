"""Noticing a busy machine: trials that stalled, and CPU time that others took.

A shared VM stalls a run now and then (another process takes the cores, the hypervisor steals
them): one trial then takes 5-15x its pair. With few trials such a stall moves a prompt's median
and so a category's ratio. Two defences, both reported:

- Each trial records the CPU time the rest of the machine took while it ran (from /proc/stat,
  less this process's own). A trial during which others took more than TRIAL_CORES cores on
  average, or slower than STALL times the fastest other trial of its method and prompt,
  is run again (up to RERUN_ROUNDS times) and counted, per method. A competitor that takes a
  core for part of a trial slows it by less than STALL; what others took still shows it. Each
  re-run first waits for a quiet moment: a competitor that comes in bursts would otherwise meet
  the re-run too, and it slows plain decoding (many small passes) more than speculation. Three
  trials is the least that gives a median a stall cannot move; with two, a slow trial is found
  only against its pair.
- Over the whole run: a machine is flagged busy when others took more than BUSY_CORES cores on
  average, steal passed BUSY_STEAL of the time, more than BUSY_RERUNS of a method's trials
  had to be run again, or a trial still met interference after its last re-run (the machine was
  never quiet for as long as a trial takes).
"""
from __future__ import annotations

import os
import time

STALL = 1.3  # a trial this many times the fastest of its other trials is re-run
TRIAL_CORES = 0.2  # ... and one during which other processes took this many cores
RERUN_ROUNDS = 4
QUIET_WINDOW, QUIET_WAIT = 0.1, 10.0  # a re-run waits (at most QUIET_WAIT s) for one quiet window
BUSY_CORES, BUSY_STEAL, BUSY_RERUNS = 0.25, 0.05, 0.05


def stalled(records: list[dict]) -> list[int]:
    """Indexes of the trials that met interference: others took over TRIAL_CORES cores while they
    ran, or they took over STALL times the fastest other trial of their method and prompt (on a
    quiet VM 25 repeats of a call stayed within 1.5x their median; a stall takes 5-15x)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r["method"], r["prompt"]), []).append(i)
    out = []
    for idx in groups.values():
        for i in idx:
            others = [records[j]["seconds"] for j in idx if j != i]
            if (records[i].get("others_cores", 0.0) > TRIAL_CORES
                    or others and records[i]["seconds"] > STALL * min(others)):
                out.append(i)
    return sorted(out)


def rerun_stalls(records: list[dict], run, log=print) -> list[int]:
    """Run the trials that met interference again (run(record) -> a fresh record), each after a
    quiet moment, keeping each earlier time in the record's "stalled_seconds". Returns the
    trials that still met interference on their last run."""
    for _ in range(RERUN_ROUNDS):
        slow = stalled(records)
        if not slow:
            return []
        log(f"re-running {len(slow)} trial(s) that met interference")
        for i in slow:
            old = records[i]
            wait_quiet()
            records[i] = run(old) | {"stalled_seconds": old.get("stalled_seconds", []) + [old["seconds"]]}
    return stalled(records)


def wait_quiet(window: float = QUIET_WINDOW, limit: float = QUIET_WAIT) -> bool:
    """Wait until other processes took under TRIAL_CORES cores for one window; False after limit s."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        before = snapshot()
        time.sleep(window)
        if others(before, snapshot()).get("others_cores", 0.0) < TRIAL_CORES:
            return True
    return False


def snapshot() -> tuple:
    """(wall clock, this process's CPU seconds, the machine's busy, steal and total jiffies or None)."""
    t = os.times()
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        jiffies = (user + nice + system + irq + softirq, steal, sum(fields[:8]))
    except (OSError, ValueError):
        jiffies = None
    return time.monotonic(), t.user + t.system, jiffies  # its threads; not processes it started


def others(a: tuple, b: tuple) -> dict:
    """Between two snapshots: the cores other processes took on average, and the share stolen."""
    wall, own = b[0] - a[0], b[1] - a[1]
    if a[2] is None or b[2] is None or wall <= 0:
        return {}
    busy, steal, total = (y - x for x, y in zip(a[2], b[2]))
    return {"others_cores": max(0.0, busy / os.sysconf("SC_CLK_TCK") - own) / wall,
            "steal_share": steal / total if total else 0.0}


class MachineLoad:
    """What the rest of the machine did between start() and stop()."""

    def start(self) -> "MachineLoad":
        self.first = snapshot()
        return self

    def stop(self, reruns: dict[str, tuple[int, int, int]]) -> dict:
        """reruns: method -> (trials re-run, trials, trials that met interference on their last
        run too). The report's "machine" entry."""
        last = snapshot()
        out = {"wall_seconds": last[0] - self.first[0], "own_cpu_seconds": last[1] - self.first[1],
               "loadavg": list(os.getloadavg()), **others(self.first, last),
               "reruns": {m: {"rerun": n, "trials": t, "unclean": u} for m, (n, t, u) in reruns.items()}}
        reasons = []
        if out.get("others_cores", 0.0) > BUSY_CORES:
            reasons.append(f"other processes took {out['others_cores']:.2f} cores on average")
        if out.get("steal_share", 0.0) > BUSY_STEAL:
            reasons.append(f"the hypervisor stole {100 * out['steal_share']:.0f}% of the CPU time")
        for m, (n, t, u) in reruns.items():
            if t and n / t > BUSY_RERUNS:
                reasons.append(f"{n} of {t} trials of {m} met interference and were run again")
            if u:
                reasons.append(f"{u} trial(s) of {m} met interference on every run")
        out["busy"], out["reasons"] = bool(reasons), reasons
        return out
