"""controller/view/server.py over real HTTP on loopback: the API's answers and refusals, the
key, and the files the page ships."""

import hashlib
import json
import re
from pathlib import Path

import httpx
import pytest

from flexmarl.controller.view.server import STATIC, ViewServer
from flexmarl.runtime import events as ev
from flexmarl.runtime.config import ConfigError, ViewConfig
from flexmarl.runtime.eventlog import EventLog
from flexmarl.runtime.keys import GroupKey


async def a_run(run_dir: Path) -> None:
    log = EventLog(run_dir / "events.log")
    log.emit(ev.RunStarted("[run]\nsteps = 1\n", ["a"], "sync", 0, 1))
    log.emit(ev.WorkerJoined("r0", "rollout", "h", 1))
    group = GroupKey("s1q0", "a", "0000000a-0")
    log.emit(ev.GroupOpened(group, 1, 2))
    log.emit(ev.RequestsDispatched("r0", "a", 1, 2, ev.whole([(group, 2)])))
    log.emit(ev.RequestsCompleted("r0", "a", 1, [0], 2, parts=ev.whole([(group, 2)])))
    log.emit(ev.GroupComplete(group, [0.0, 1.0]))
    log.emit(ev.WeightSyncStarted("a", 1, ["r0"], "shm"))
    log.emit(ev.WeightSyncFinished("a", 1, 0.25, 1000))
    await log.close()
    (run_dir / "config.toml").write_text('[run]\nsteps = 1\n\n[agents.a]\nmodel = "m"\n')
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "agent": "a", "reward_mean": 0.5}) + "\n")


@pytest.fixture
async def served(tmp_path):
    await a_run(tmp_path)
    server = ViewServer(tmp_path, ViewConfig())
    url = await server.start()
    async with httpx.AsyncClient(base_url=url) as client:
        yield server, client
    await server.stop()


async def test_the_api_answers_from_the_run_and_refuses_bad_parameters_in_words(served):
    server, client = served
    assert (await client.get("/")).text.startswith("<!doctype html>")
    assert (await client.get("/static/vendor/uPlot.iife.min.js")).status_code == 200
    header = (await client.get("/api/run")).json()
    assert header["agents"] == ["a"] and header["steps"] == 1 and header["samples"] == 2
    agents = (await client.get("/api/agents")).json()
    assert agents["train"]["reward"] == [0.5] and agents["latest"]["a"]["reward"] == 0.5
    assert (await client.get("/api/agents", params={"epoch": 0, "train": 1})).json()["train"]["reward"] == []
    samples = (await client.get("/api/samples", params={"order": "-reward", "limit": 1})).json()
    assert samples["total"] == 2 and [r["reward"] for r in samples["rows"]] == [1.0]
    episode = (await client.get("/api/episode", params={"name": "s1q0"})).json()
    assert [len(g["members"]) for g in episode["groups"]] == [2]
    assert [w["worker"] for w in (await client.get("/api/workers")).json()] == ["r0"]
    assert (await client.get("/api/timeline", params={"columns": 10})).json()["columns"] == 10
    assert "steps = 1" in (await client.get("/api/config")).text
    syncs = (await client.get("/api/syncs")).json()
    assert (syncs["agents"], syncs["version"], syncs["seconds"], syncs["bytes"]) == (["a"], [1], [0.25], [1000])
    assert (await client.get("/api/syncs", params={"since": 1})).json()["version"] == []
    happenings = (await client.get("/api/happenings", params={"kind": "sync"})).json()
    assert [h["what"] for h in happenings["rows"]] == ["v1 to 1 instance over shm, 0.0 MB"]
    for path, params, said in [("/api/samples", {"status": "eaten"}, "status must be one of trained"),
                               ("/api/samples", {"limit": 0}, "limit in [1, 500]"),
                               ("/api/samples", {"reward_min": "lots"}, "reward_min must be a number"),
                               ("/api/samples", {"step_from": "1.5"}, "step_from must be an integer"),
                               ("/api/happenings", {"kind": "party"}, "kind must be one of sync")]:
        response = await client.get(path, params=params)
        assert response.status_code == 400 and said in response.text, (path, params, response.text)
    missing = await client.get("/api/episode", params={"name": "s9q9"})
    assert missing.status_code == 404 and "no episode 's9q9'" in missing.text


async def test_a_view_with_a_key_lets_in_the_key_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXMARL_VIEW_KEY", "s3cret")
    await a_run(tmp_path)
    server = ViewServer(tmp_path, ViewConfig())
    url = await server.start()
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            refused = await client.get("/api/run")
            assert refused.status_code == 401 and "URL/?key=KEY" in refused.text
            assert (await client.get("/", params={"key": "guess"})).status_code == 401
            assert (await client.get("/api/run", headers={"authorization": "Bearer guess"})).status_code == 401
            assert (await client.get("/api/run", headers={"authorization": "Bearer s3cret"})).status_code == 200
            opened = await client.get("/", params={"key": "s3cret"})  # what a browser opens once
            assert opened.status_code == 303 and opened.headers["location"] == url
            assert "s3cret" not in opened.headers["set-cookie"]
            assert (await client.get("/api/run")).status_code == 200  # the cookie it set
    finally:
        await server.stop()


def test_off_loopback_the_view_needs_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEXMARL_VIEW_KEY", raising=False)
    with pytest.raises(ConfigError, match="view.host = '0.0.0.0' is not loopback.*FLEXMARL_VIEW_KEY"):
        ViewServer(tmp_path, ViewConfig(host="0.0.0.0"))
    monkeypatch.setenv("FLEXMARL_VIEW_KEY", "k")
    assert ViewServer(tmp_path, ViewConfig(host="0.0.0.0")).key == "k"


def test_the_page_loads_nothing_from_elsewhere_and_its_libraries_are_the_ones_recorded():
    page = (STATIC / "index.html").read_text()
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    script = (STATIC / "view.js").read_text()
    assert "http://" not in script and "https://" not in script
    table = (STATIC / "vendor" / "README.md").read_text()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        files = re.findall(r"`([\w.-]+\.(?:js|css))`", row.split("|")[1])
        sums = re.findall(r"`([0-9a-f]{64})`", row)
        assert len(files) == len(sums) == 2, row
        for name, digest in zip(files, sums):
            assert hashlib.sha256((STATIC / "vendor" / name).read_bytes()).hexdigest() == digest, name
    assert {p.name for p in (STATIC / "vendor").glob("*.LICENSE")} == {"uPlot.LICENSE", "gridjs.LICENSE"}


async def test_flexmarl_view_says_in_one_line_why_it_cannot_show_a_run(tmp_path, capsys, monkeypatch):
    import socket

    from flexmarl.controller.view.command import view

    monkeypatch.delenv("FLEXMARL_VIEW_KEY", raising=False)
    assert await view(str(tmp_path / "nowhere"), None, None) == 2
    assert "is not a run directory (none of events.log, metrics.jsonl, config.toml in it)" in capsys.readouterr().err
    await a_run(tmp_path)
    assert await view(str(tmp_path), "0.0.0.0", None) == 2
    assert "view.host = '0.0.0.0' is not loopback" in capsys.readouterr().err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        assert await view(str(tmp_path), None, taken.getsockname()[1]) == 2
        assert f"the web view cannot listen on 127.0.0.1:{taken.getsockname()[1]}" in capsys.readouterr().err
    finally:
        taken.close()
