"""The web view in a real headless browser (Playwright driving Chromium) on one short real
run of the default job: the controller's own view while it runs, then `flexmarl view` on
the finished run. Screenshots are kept under the test's temporary folder (their paths are
printed; `pytest -s` shows them).

The browser is the Chromium build scripts/headless_chromium.sh unpacks (from the npm
package @sparticuz/chromium, cached in the user's cache folder); without node or npm the
tests are skipped, saying so. Nothing is timed: the waits only bound how long a broken
page may keep the suite waiting.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from flexmarl.controller.testing.browser import BrowserMissing, ViewProcess, headless_chromium

STEPS = 2
SETUP_S = 900  # models built on first use, engines started (minutes on 2 shared cores)


@pytest.fixture(scope="module")
def browser():
    try:
        launcher = headless_chromium()
    except BrowserMissing as exc:
        pytest.skip(f"no headless browser here: {exc}")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package (the test extra) is missing")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=launcher)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`flexmarl run` of the default job, STEPS steps, two samples per agent per step as
    text; started once for the module, stopped (by its handle) if still running at the end."""
    root = tmp_path_factory.mktemp("view-run")
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    log = open(root / "run.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flexmarl.controller.cli", "run", "--steps", str(STEPS),
                             "--out", str(root / "run"), "--no-progress", "--set", "run.samples_per_step=2"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    yield proc, root / "run", root
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()


def shot(page, root, name):
    path = root / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def shown_step(page):
    text = page.inner_text("#step")
    found = re.match(r"step (\d+)", text)
    return int(found.group(1)) if found else -1


def test_the_controllers_own_view_of_a_live_run_gains_a_step_while_the_page_watches(browser, run):
    proc, run_dir, root = run
    deadline = time.monotonic() + SETUP_S
    while not (run_dir / "view.url").exists():
        assert proc.poll() is None, (root / "run.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never wrote view.url"
        time.sleep(0.5)
    url = (run_dir / "view.url").read_text().strip()
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.goto(url)
    page.wait_for_function("document.querySelector('#status').textContent === 'running'", timeout=60_000)
    first = shown_step(page)
    assert first < STEPS and proc.poll() is None  # opened while the run is still short of its last step
    page.wait_for_function(f"/step (\\d+)/.test(document.querySelector('#step').textContent) && "
                           f"+document.querySelector('#step').textContent.match(/step (\\d+)/)[1] > {first}",
                           timeout=SETUP_S * 1000)
    assert shown_step(page) > first
    # the step's header and the curves' rows come by separate requests: wait for the rows
    page.wait_for_function("window.flexmarlView.trainRows > 0", timeout=60_000)
    shot(page, root, "live-agents")
    page.goto(url + "#cluster")
    page.wait_for_function("window.flexmarlView.timeline && window.flexmarlView.timeline.workers.length >= 4",
                           timeout=60_000)
    shot(page, root, "live-cluster")
    assert page.evaluate("window.flexmarlView.errors") == []
    page.close()


def test_a_finished_runs_page_ends_each_agents_curve_at_its_metrics_and_shows_an_episodes_texts(browser, run):
    proc, run_dir, root = run
    assert proc.wait(SETUP_S) == 0, (root / "run.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = {r["agent"]: r["reward_mean"] for r in rows if "kind" not in r}  # each agent's last step
    assert sorted(last) == ["checker", "planner", "solver"]
    printed = subprocess.run([sys.executable, "-m", "flexmarl.controller.cli", "samples", str(run_dir)],
                             capture_output=True, text=True, check=True).stdout
    with ViewProcess(run_dir) as view:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(view.url)
        page.wait_for_function("document.querySelector('#status').textContent === 'finished'", timeout=60_000)
        assert shown_step(page) == STEPS
        page.wait_for_function("window.flexmarlView.charts.reward !== undefined", timeout=30_000)
        curves = page.evaluate("""() => { const c = window.flexmarlView.charts.reward;
            return c.series.slice(1).map((s, i) => [s.label, c.data[i + 1].filter((v) => v !== null)]); }""")
        ends = {label: values[-1] for label, values in curves if "held-out" not in label}
        assert ends == pytest.approx(last, abs=1e-12)
        # the table is drawn by the grid after the charts; wait for its rows, not its header
        page.wait_for_function("document.querySelectorAll('#agents-table tbody tr').length === 3", timeout=30_000)
        table = page.inner_text("#agents-table")
        for agent, reward in last.items():
            assert re.search(rf"{agent}\s+{STEPS}\s+{re.escape(str(round(reward, 3)))}\b", table), table
        shot(page, root, "finished-agents")

        page.goto(view.url + "#episodes")
        page.check("#sample-filters input[name=text]")
        page.click("#sample-filters button[type=submit]")
        page.wait_for_function("document.querySelectorAll('#samples-table td').length > 0 && "
                               "[...document.querySelectorAll('#samples-table td')].some((td) => td.textContent === 'yes')",
                               timeout=30_000)
        page.click("#samples-table tbody tr:first-child")
        page.wait_for_selector(".member.chosen .turn", timeout=30_000)
        sample = page.get_attribute(".member.chosen", "data-sample")
        turns = [t.strip() for t in page.locator(".member.chosen .turn").all_inner_texts()]
        block = printed.split(f"--- {sample} ", 1)[1].split("\n--- ", 1)[0].split("\n===", 1)[0]
        expected = [line.strip() for line in block.splitlines()[1:] if line.startswith("  ") and line.strip()]
        assert turns == expected and len(turns) >= 2, (turns, expected)
        groups = page.locator("#episode .group").count()
        assert groups >= 3  # the planner's group and the groups of the agents after it in the chain
        shot(page, root, "finished-episode")

        page.goto(view.url + "#cluster")
        page.wait_for_function("window.flexmarlView.timeline && window.flexmarlView.timeline.workers.length === 4 && "
                               "document.querySelectorAll('#workers-table tbody tr').length === 4", timeout=30_000)
        workers = page.inner_text("#workers-table")
        assert all(w in workers for w in ("rollout-0", "rollout-1", "rollout-2", "trainer-0")), workers
        shot(page, root, "finished-cluster")
        assert page.evaluate("window.flexmarlView.errors") == []
        page.close()
