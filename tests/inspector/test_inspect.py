"""`molt inspect`: the JSON routes on a real run directory (one tiny-model run for the module), the 4xx cases,
older dumps and live files on hand-written run directories, per-token pieces, and the page in headless Chromium."""

import asyncio
import json
import math
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from molt.inspect.app import create_app

AGENT = Path(__file__).parent / "agents" / "tool_env.py"
GATE = (0.97, 1.03)  # a narrow band, so that later steps' stale tokens are rejected by the gate


@pytest.fixture(scope="module")
def run_dir(tiny_llama_dir, tmp_path_factory):
    """3 steps of the tool Env (async, partial rollouts), every step dumped; 2 prompts, so they recur."""
    import ray

    sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))
    from test_train_e2e import _cfg

    from molt.runtime.loop import run_training

    if not ray.is_initialized():
        ray.init(
            "local",
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    out = tmp_path_factory.mktemp("inspect") / "run"
    cfg = _cfg(
        tiny_llama_dir,
        out,
        str(AGENT),
        train__max_staleness=1,
        train__partial_rollout_enable=True,
        data__max_samples=2,
    )  # an absolute agent path replaces _cfg's folder
    cfg.algo.advantage.is_correction_threshold = GATE
    asyncio.run(run_training(cfg))
    return out


@pytest.fixture(scope="module")
def client(run_dir):
    return TestClient(create_app(run_dir))


def _dump(run_dir, step):
    return [json.loads(line) for line in (run_dir / "dumps" / f"step_{step}.jsonl").read_text().splitlines()]


def test_run_and_steps(client, run_dir):
    run = client.get("/api/run").json()
    assert run["dumped"] == [1, 2, 3] and [m["step"] for m in run["steps"]] == [1, 2, 3]
    assert all("rollout/reward_mean" in m and "is_filter_ratio" in m for m in run["steps"])
    for step in (1, 2, 3):
        data = client.get(f"/api/steps/{step}").json()
        rows = _dump(run_dir, step)
        assert len(data["groups"]) == 2 and {g["prompt"] for g in data["groups"]} <= {0, 1}
        for g in data["groups"]:
            assert len(g["rollouts"]) == 4
            assert abs(sum(r["advantage"] for r in g["rollouts"])) < 1e-5  # grpo: centred in the group
            for r in g["rollouts"]:
                mine = [x for x in rows if x["rollout_id"] == r["rollout_id"]]
                assert r["reward"] == mine[0]["reward"] and r["segments"] == len(mine)
                assert r["action_tokens"] == sum(sum(x["action_mask"]) for x in mine)
                assert r["rejected"] == sum(
                    m and w == 0 for x in mine for m, w in zip(x["action_mask"], x["is_weights"])
                )


def test_rollout_carries_pieces_trainer_logprobs_and_the_gate(client, run_dir):
    rejected = 0
    for step in (1, 2, 3):
        for row in _dump(run_dir, step):
            r = client.get(f"/api/steps/{step}/rollouts/{row['rollout_id']}").json()
            seg = r["segments"][row["segment"]]
            assert seg["segment"] == row["segment"] and "".join(seg["pieces"]) == seg["text"]
            assert (
                "<|im_start|>tool\nAgain, with more e.<|im_end|>" in seg["text"]
            )  # the tool turn, as the template renders it
            lo, hi = GATE
            for m, b, t, w in zip(
                seg["action_mask"], seg["behavior_logprobs"], seg["trainer_logprobs"], seg["is_weights"]
            ):
                ratio = math.exp(t - b)  # the gate by hand: token level, mask mode
                assert w == pytest.approx((ratio if lo <= ratio <= hi else 0.0) if m else 1.0, rel=1e-6)
                rejected += bool(m and w == 0)
                if step == 1 and m:  # step 1 trains version-0 tokens under version 0: the trainer agrees
                    assert abs(t - b) < 1e-3
    assert rejected > 0, "stale tokens of steps 2-3 must fall outside the narrow band"


def test_same_prompt_across_steps_and_search(client, run_dir):
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    rows = client.get(f"/api/prompts/{ledger[0]['key'][1]}").json()
    same = {r["group_id"] for r in ledger if r["key"][1] == ledger[0]["key"][1]}
    assert {r["group_id"] for r in rows} == same and len({r["step"] for r in rows}) >= 2
    assert all(len([x for x in rows if x["group_id"] == g]) == 4 for g in same)
    hits = client.get("/api/search", params={"q": "WITH MORE e.<|im_end|>\n<|im_start|>assistant"}).json()
    assert len(hits) == sum(len(_dump(run_dir, s)) for s in (1, 2, 3)) and hits[0]["step"] == 3
    assert all("with more e.<|im_end|>" in h["snippet"] for h in hits)
    assert client.get("/api/search", params={"q": "no such text anywhere"}).json() == []


def test_bad_requests_are_4xx_and_reads_stay_inside(client, run_dir, tmp_path):
    (tmp_path / "secret.txt").write_text("SECRET-CONTENT")
    (run_dir / "link").symlink_to(tmp_path / "secret.txt")
    assert client.get("/api/file", params={"path": "config.yaml"}).status_code == 200
    for path, code in [
        ("../secret.txt", 403),
        (str(tmp_path / "secret.txt"), 403),
        ("/etc/passwd", 403),
        ("link", 403),
        ("dumps/../../secret.txt", 403),
        ("nope.txt", 404),
        ("dumps", 404),
        ("a\x00b", 400),
    ]:
        r = client.get("/api/file", params={"path": path})
        assert r.status_code == code, (path, r.status_code)
        assert "SECRET-CONTENT" not in r.text
    assert client.get("/api/steps/99").status_code == 404
    assert client.get("/api/steps/1/rollouts/nope").status_code == 404
    assert client.get("/api/steps/..%2F..%2Fetc/rollouts/x").status_code in (404, 422)
    assert client.get("/api/steps/abc").status_code == 422
    assert client.get("/api/search").status_code == 422
    assert client.get("/api/prompts/x").status_code == 422


def test_older_dumps_and_files_being_written(tmp_path):
    """A dump from before the inspector (no pieces, trainer log-probs, gate weights or advantage) opens; an
    unfinished last line is skipped and shows up once written."""
    (tmp_path / "dumps").mkdir()
    old = {
        "group_id": "e0-p3",
        "rollout_id": "r0",
        "segment": 0,
        "break_reason": "start",
        "reward": 1.0,
        "text": "ab",
        "action_text": "b",
        "token_ids": [5, 6],
        "action_mask": [0, 1],
        "behavior_logprobs": [0.0, -0.5],
        "versions": [-1, 0],
    }
    (tmp_path / "dumps" / "step_2.jsonl").write_text(json.dumps(old) + "\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout/reward_mean": 0.5}\n{"step": 2, "rollo')
    client = TestClient(create_app(tmp_path))
    run = client.get("/api/run").json()
    assert run["dumped"] == [2] and run["steps"] == [{"step": 1, "rollout/reward_mean": 0.5}]
    step = client.get("/api/steps/2").json()
    assert step["groups"][0]["prompt"] is None  # no ledger
    assert (
        step["groups"][0]["rollouts"][0] | {"response": "b", "rejected": None, "advantage": None}
        == step["groups"][0]["rollouts"][0]
    )
    assert client.get("/api/steps/2/rollouts/r0").json()["segments"][0]["token_ids"] == [5, 6]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ut/reward_mean": 0.75}\n{"step": 2, "eval/accuracy": 0.25}\n')
    assert client.get("/api/run").json()["steps"][1] == {
        "step": 2,
        "rollout/reward_mean": 0.75,
        "eval/accuracy": 0.25,
    }
    with pytest.raises(ValueError, match="not a directory"):
        create_app(tmp_path / "missing")


def test_non_finite_metrics_are_shown_as_text(tmp_path):
    """A skipped step's NaN loss (metrics.jsonl keeps it, as Python's json writes it): JSON has no such number."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "policy_loss": NaN, "actor_grad_norm": Infinity}\n')
    run = TestClient(create_app(tmp_path)).get("/api/run").json()
    assert run["steps"] == [{"step": 1, "policy_loss": "nan", "actor_grad_norm": "inf"}]


def test_pieces_join_and_carry_split_characters(tokenizer):
    from molt.runtime.dump import _pieces

    ids = tokenizer.encode("héllo wörld → 你好 🙂 done", add_special_tokens=False)
    pieces = _pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # a character split over byte tokens: one carries it whole
    assert "" in pieces and any("🙂" in p for p in pieces)


def test_cli_inspect_help_and_bad_dir(capsys):
    from molt.cli import main

    assert main(["inspect", str(Path("/nonexistent/run"))]) == 2
    assert "not a directory" in capsys.readouterr().err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install -y chromium)")
def test_page_in_headless_chromium(run_dir):
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
    )
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(create_app(run_dir), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{port}/")
            page.click("tr.dumped >> nth=2")  # step 3
            page.click(".card >> nth=0")
            page.wait_for_selector(".tok.act")
            backgrounds = page.eval_on_selector_all(
                ".tok",
                "els => els.map(e => [e.classList.contains('act'), getComputedStyle(e).backgroundColor])",
            )
            assert all(bg != "rgba(0, 0, 0, 0)" for act, bg in backgrounds if act)  # coloured by advantage
            assert all(bg == "rgba(0, 0, 0, 0)" for act, bg in backgrounds if not act)  # context: plain
            assert page.locator(".tok.result").count() > 0 and page.locator(".tag.result").count() > 0
            page.select_option("#color", "gate")
            page.wait_for_url("**color=gate*")
            page.wait_for_selector(".tok.act")
            rollout = page.url.split("rollout=")[1].split("&")[0]
            seg = [x for x in _dump(run_dir, 3) if x["rollout_id"] == rollout]
            expected = sum(m and w == 0 for x in seg for m, w in zip(x["action_mask"], x["is_weights"]))
            count_red = (
                "() => [...document.querySelectorAll('.tok.act')].filter(e => "
                "getComputedStyle(e).backgroundColor === 'rgba(230, 60, 60, 0.8)').length"
            )
            # the page redraws after the URL changes: wait for the redraw (an event), not a fixed time. The arrow
            # function is parenthesised: `() => x.length` followed by `()` would call `.length` (the old flake)
            page.wait_for_function(f"({count_red})() === {expected}", timeout=20_000)
            assert page.evaluate(count_red) == expected
            page.hover(".tok.act:not(:empty) >> nth=0")
            assert "id " in page.inner_text("#tip") and "gate weight" in page.inner_text("#tip")
            page.select_option("select >> nth=1", index=1)  # compare with another rollout of the same prompt
            page.wait_for_selector("#diff .diff")
            page.screenshot(
                path=os.environ.get("MOLT_INSPECTOR_SCREENSHOT") or str(run_dir / "inspector.png")
            )
            assert not errors
            browser.close()
    finally:
        server.should_exit = True
        thread.join()
