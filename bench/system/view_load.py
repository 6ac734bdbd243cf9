"""How long the web view of a run takes to open, in a real headless browser.

    python bench/system/view_load.py RUN_DIR [--repeats N]
    python bench/system/view_load.py --synthetic STEPS,AGENTS,INSTANCES,SAMPLES_PER_STEP [--keep DIR]
    python bench/system/view_load.py RUN_DIR --idle SECONDS

The largest log the benches write is controller_scale's 1,024 instances x 32 agents
(`python bench/system/controller_scale.py --keep DIR --point '{"instances":1024,"agents":32,
"trainers":64,"shape":"chain","mode":"async","k":2}'` keeps it in DIR/run). `--synthetic`
writes a run directory of the given size first (events as the controller writes them:
groups of 4 opened, sent to instances and answered in parts, rewarded, trained in one
micro-batch per agent and step, synced; a metrics row per agent per step; two sample
texts per agent per step), to show what a thousand steps and a million samples cost.

Per repeat, one JSON row, in seconds from the start of `flexmarl view RUN_DIR` (a fresh
process: interpreter start and imports included):

    listening_s   the command printed its address (it reads the first slice of the log first)
    header_s      the page (a fresh browser page: nothing cached) shows the run's header
    curves_s      every agent's curves are drawn (all of metrics.jsonl's rows in the charts)
    read_s        the view has read the whole event log (the page's header says so)
    cluster_s     then the Cluster tab's timeline is drawn, a row per worker
    samples_s     then the Episodes tab's first page of samples is shown
    episode_s     then one episode is open (its groups drawn)

and the view process's peak resident memory (`rss_mb`), the log's size and the run's
samples and workers. The page is served and drawn while the log is still being read:
`header_s` and `curves_s` do not wait for `read_s`.

With `--idle SECONDS`, instead: what a running controller's view costs while no page is
open, as the CPU milliseconds per second an otherwise idle uvloop event loop spends
without the view and then with one started on RUN_DIR and never asked (`idle_ms_per_s`,
`view_ms_per_s`), each over SECONDS.

Needs node and npm (scripts/headless_chromium.sh unpacks the browser) and the playwright
package (the test extra); `--idle` needs neither.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flexmarl.controller.testing.browser import ViewProcess, headless_chromium
from flexmarl.runtime import events as ev
from flexmarl.runtime.eventlog import EventLog, segment_paths
from flexmarl.runtime.keys import GroupKey

GROUP = 4


async def write_synthetic(run_dir: Path, steps: int, agents: int, instances: int, per_step: int) -> None:
    """A finished run directory of `steps` steps of `per_step` samples each over `agents`
    agents and `instances` rollout instances (a wide run: each episode asks every agent once)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    names = [f"agent{a:02d}" for a in range(agents)]
    workers = [f"rollout-{i:04d}" for i in range(instances)]
    trainers = [f"trainer-{i:02d}" for i in range(max(1, agents // 2))]
    config = f"[run]\nsteps = {steps}\n\n" + "".join(f'[agents.{a}]\nmodel = "tiny"\ngroup_size = {GROUP}\n\n'
                                                       for a in names)
    (run_dir / "config.toml").write_text(config)
    now = [0.0]
    log = EventLog(run_dir / "events.log", clock=lambda: now[0])
    metrics = open(run_dir / "metrics.jsonl", "w")
    texts = open(run_dir / "samples.jsonl", "w")
    rng = random.Random(0)
    queries = max(1, per_step // (agents * GROUP))
    log.emit(ev.RunStarted(config, names, "async", 1, 0))
    for w in workers:
        log.emit(ev.WorkerJoined(w, "rollout", "host", 1))
    for w in trainers:
        log.emit(ev.WorkerJoined(w, "trainer", "host", 1))
    request = 0
    for step in range(1, steps + 1):
        log.emit(ev.BatchStarted(step, (step - 1) * queries))
        for a, agent in enumerate(names):
            keys = [GroupKey(f"s{step}q{q}", agent, f"{a * 7919 + q:08x}-0") for q in range(queries)]
            rewards = {}
            for key in keys:
                log.emit(ev.GroupOpened(key, step, GROUP))
            for first in range(0, len(keys), 4):  # four groups to a message, to one instance
                part = keys[first:first + 4]
                worker = workers[(request * 31) % len(workers)]
                request += 1
                parts = ev.whole([(key, GROUP) for key in part])
                log.emit(ev.RequestsDispatched(worker, agent, request, 8 * len(part), parts))
                now[0] += 0.0005
                log.emit(ev.RequestsCompleted(worker, agent, request, [step - 1] * len(part), 16 * len(part),
                                              parts=parts))
                for key in part:
                    rewards[key] = [round(rng.random(), 3) for _ in range(GROUP)]
                    log.emit(ev.GroupComplete(key, rewards[key], 24))
            trainer = trainers[a % len(trainers)]
            members = [(key, m) for key in keys for m in range(GROUP)]
            log.emit(ev.MicroBatchFormed(agent, trainer, step, ev.whole([(key, GROUP) for key in keys]),
                                         [step - 1] * len(members)))
            now[0] += 0.001
            log.emit(ev.MicroBatchTrained(agent, trainer, step, len(members), 0.001))
            log.emit(ev.OptimizerStep(agent, trainer, step, len(members)))
            log.emit(ev.WeightSyncStarted(agent, step, workers[a::agents] or workers[:1], "shm"))
            log.emit(ev.WeightSyncFinished(agent, step, 0.01, 1_000_000))
            mean = sum(sum(r) for r in rewards.values()) / (len(rewards) * GROUP)
            metrics.write(json.dumps({"step": step, "agent": agent, "version": step, "reward_mean": mean,
                                      "samples": len(members), "time": round(now[0], 3), "staleness_mean": 0.0,
                                      "loss": -mean, "grad_norm": 1.0 - mean / 2, "logprob_abs_diff": 1e-7}) + "\n")
            for key in keys[:2]:
                texts.write(json.dumps({"step": step, "agent": agent, "sample_id": key.sample(0),
                                        "group": [key.episode, key.agent, key.call], "member": 0,
                                        "reward": rewards[key][0],
                                        "versions": [step - 1], "turns": [{"role": "prompt", "text": f"query {key}"},
                                                                           {"role": "agent", "text": "an answer",
                                                                            "version": step - 1}]}) + "\n")
        now[0] += 0.5
        if step % 20 == 0:
            await log.flush()
    log.emit(ev.RunFinished(steps, now[0]))
    await log.close()
    metrics.close()
    texts.close()


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def one_load(browser: Any, run_dir: Path) -> dict[str, Any]:
    metrics_rows = sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                       if line.strip() and '"kind"' not in line) if (run_dir / "metrics.jsonl").exists() else 0
    t0 = time.perf_counter()
    row: dict[str, Any] = {}
    with ViewProcess(run_dir, timeout=600) as view:
        row["listening_s"] = time.perf_counter() - t0
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(view.url)

        def until(name: str, condition: str, timeout_s: float = 600) -> None:
            page.wait_for_function(condition, timeout=timeout_s * 1000, polling=50)
            row[name] = time.perf_counter() - t0

        until("header_s", "document.querySelector('#status').textContent !== 'connecting'")
        until("curves_s", f"window.flexmarlView.trainRows >= {metrics_rows} && "
                          "window.flexmarlView.charts.reward !== undefined")
        until("read_s", "window.flexmarlView.header && window.flexmarlView.header.log.caught_up")
        header = page.evaluate("window.flexmarlView.header")
        page.evaluate("location.hash = 'cluster'")
        until("cluster_s", f"window.flexmarlView.timeline && window.flexmarlView.timeline.workers.length === "
                           f"{header['workers']}")
        page.evaluate("location.hash = 'episodes'")
        until("samples_s", "document.querySelectorAll('#samples-table tbody tr').length > 0")
        page.click("#samples-table tbody tr:first-child")
        until("episode_s", "document.querySelectorAll('#episode .group').length > 0")
        errors = page.evaluate("window.flexmarlView.errors")
        page.close()
        row["rss_mb"] = peak_rss_mb(view.proc.pid)
    log_bytes = sum(p.stat().st_size for p in segment_paths(run_dir / "events.log"))
    return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
            "log_mb": round(log_bytes / 1e6, 1), "events": header["log"]["events"], "samples": header["samples"],
            "workers": header["workers"], "agents": len(header["agents"]), "steps": header["step"],
            "page_errors": errors}


async def idle_cost(run_dir: Path, seconds: float) -> dict[str, Any]:
    from flexmarl.controller.view.server import ViewServer
    from flexmarl.runtime.config import ViewConfig

    t = time.process_time()
    await asyncio.sleep(seconds)
    idle = time.process_time() - t
    server = ViewServer(run_dir, ViewConfig(), always=False)  # as a controller starts it
    await server.start()
    t = time.process_time()
    await asyncio.sleep(seconds)
    viewing = time.process_time() - t
    await server.stop()
    return {"seconds": seconds, "idle_ms_per_s": round(1e3 * idle / seconds, 3),
            "view_ms_per_s": round(1e3 * viewing / seconds, 3), "events_read": server.watch.events_read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", nargs="?", help="a run directory to open")
    parser.add_argument("--synthetic", metavar="STEPS,AGENTS,INSTANCES,SAMPLES_PER_STEP",
                        help="write a run of this size first (into --keep DIR, else a temporary folder)")
    parser.add_argument("--keep", default="", help="with --synthetic: write the run here and keep it")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--idle", type=float, metavar="SECONDS",
                        help="measure what an unwatched view costs an idle event loop instead")
    args = parser.parse_args()
    if bool(args.run_dir) == bool(args.synthetic):
        parser.error("give RUN_DIR or --synthetic")
    made = None
    if args.synthetic:
        steps, agents, instances, per_step = (int(x) for x in args.synthetic.split(","))
        made = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="flx-view-"))
        t = time.perf_counter()
        asyncio.run(write_synthetic(made, steps, agents, instances, per_step))
        print(f"wrote a synthetic run in {time.perf_counter() - t:.1f} s: {made}", file=sys.stderr)
    run_dir = Path(args.run_dir) if args.run_dir else made
    assert run_dir is not None
    if args.idle:
        import uvloop

        for _ in range(args.repeats):
            print(json.dumps(uvloop.run(idle_cost(run_dir, args.idle))), flush=True)
        return
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=headless_chromium())
            for _ in range(args.repeats):
                print(json.dumps(one_load(browser, run_dir)), flush=True)
            browser.close()
    finally:
        if made is not None and not args.keep:
            shutil.rmtree(made, ignore_errors=True)


if __name__ == "__main__":
    main()
