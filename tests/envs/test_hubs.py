"""Each hub's adapter on the real hub package: a rollout over the real capture server (real HTTP for verifiers)
scores what the model said exactly as the hub's own scorer does on the same text, computed here apart from
Molt (a fresh environment replayed with the recorded replies, or the hub's scoring function called directly).
The model's replies are scripted so that both right and wrong answers occur; `test_env_e2e.py` runs the real
tiny model through `molt train`."""

import asyncio
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from molt.capture.render import ChatRenderer
from molt.capture.server import CaptureServer
from molt.envs import EnvRunner, env_rows, env_specs, load_hub
from molt.testing.scripted import ScriptedEngine
from molt.types import SamplingParams

HERE = Path(__file__).parent


def need(module):
    return pytest.importorskip(module, reason=f"the envs extra (`make envs`) does not provide {module}")


def play(tokenizer, spec, row, replies, args=None, max_turns=16):
    """One rollout of `row` of env `spec`, the model answering `replies` in turn; (trajectory, engine)."""
    engine = ScriptedEngine(tokenizer, replies, max_model_len=1 << 16)
    server = CaptureServer(engine, ChatRenderer(tokenizer))
    runner = EnvRunner([(spec, args or {})], max_turns=max_turns)

    async def go():
        await server.start()
        try:
            return await runner.run(
                {**row, "env": spec},
                sessions=server,
                rollout_id="r0",
                sampling_params=SamplingParams(max_tokens=64),
            )
        finally:
            await server.stop()

    traj = asyncio.run(go())
    assert traj.ok, traj.error
    return traj, engine


def test_reasoning_gym_reward_is_the_datasets_score(tokenizer):
    rg = need("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    args = {"min_terms": 2, "max_terms": 2, "max_digits": 1}
    hub = load_hub("reasoning_gym:chain_sum", args)
    row = hub.rows(4, 7, False)[2]
    entry = rg.create_dataset("chain_sum", size=4, seed=7, **args)[2]
    assert row["label"]["question"] == entry["question"]  # a group replays the same entry
    for text in (f"so <answer>{entry['answer']}</answer>", "<answer>1000</answer>", "no tags"):
        traj, _ = play(tokenizer, "reasoning_gym:chain_sum", row, [text], args)
        expected = rg.create_dataset("chain_sum", size=1, seed=0, **args).score_answer(
            extract_answer(text), entry
        )
        assert traj.reward == expected
    assert traj.reward == 0.0 and expected == 0.0
    right = f"<answer>{entry['answer']}</answer>"
    assert play(tokenizer, "reasoning_gym:chain_sum", row, [right], args)[0].reward == 1.0
    args = {**args, "answer": "-?[0-9]+"}  # the last number of the reply is the answer
    for text, expected in ((f"it is 12, no: {entry['answer']}", 1.0), (f"{entry['answer']} or 12", 0.0)):
        assert play(tokenizer, "reasoning_gym:chain_sum", row, [text], args)[0].reward == expected


def test_gem_game_reward_is_the_games_own_over_the_same_guesses(tokenizer):
    gem = need("gem")

    spec = "gem:game:GuessTheNumber-v0-easy"
    guesses = [f"I guess \\boxed{{{k}}}" for k in (5, 8, 3, 9, 1, 2)]
    for seed in (0, 1, 2):
        traj, engine = play(tokenizer, spec, {"label": {"seed": seed}}, guesses)
        env, total, turns = gem.make("game:GuessTheNumber-v0-easy"), 0.0, 0
        env.reset(seed=seed)
        for text in guesses:
            _, reward, terminated, truncated, _ = env.step(text)
            total, turns = total + reward, turns + 1
            if terminated or truncated:
                break
        assert traj.reward == total and len(engine.calls) == turns
        assert len(traj.segments) == 1  # feedback continues the conversation: one segment


def test_textarena_seats_are_roles_each_with_its_reward(tokenizer):
    ta = need("textarena")

    moves = ["[4]", "[0]", "[8]", "[2]", "[1]", "[6]", "[3]", "[5]", "[7]"]
    for seed, shift in ((0, 0), (1, 1)):  # seat 0 wins in one game, loses in the other
        replies = moves[shift:] + moves[:shift]
        traj, engine = play(tokenizer, "textarena:TicTacToe-v0", {"label": {"seed": seed}}, replies)
        env = ta.make("TicTacToe-v0")
        env.reset(num_players=2, seed=seed)
        played = 0
        for move in replies:
            played += 1
            if env.step(move)[0]:
                break
        rewards, _ = env.close()
        assert traj.rewards == {"seat0": rewards[0], "seat1": rewards[1]} and traj.score == rewards[0]
        assert len(engine.calls) == played and len({c["session_id"] for c in engine.calls}) == 1
        # each turn is its own segment (the observation is the player's whole history), the seats alternate
        assert [s.role for s in traj.segments] == ["seat0", "seat1"] * (played // 2) + ["seat0"] * (
            played % 2
        )
        assert {s.break_reason for s in traj.segments[1:]} == {"role"}


def test_skyrl_gym_reward_is_the_envs_own(tokenizer):
    skyrl_gym = need("skyrl_gym")

    row = {"messages": [{"role": "user", "content": "6 * 7?"}], "label": "42"}
    for text in ("#### 42", "#### 41"):
        traj, _ = play(tokenizer, "skyrl_gym:gsm8k", row, [text])
        env = skyrl_gym.make("gsm8k", env_config={}, extras={"reward_spec": {"ground_truth": "42"}})
        env.init(row["messages"])
        assert traj.reward == env.step(text)["reward"]
    assert traj.reward == 0.0 and play(tokenizer, "skyrl_gym:gsm8k", row, ["#### 42"])[0].reward == 1.0


def test_openenv_in_process_and_over_its_server(tokenizer):
    import uvicorn

    need("openenv")
    from openenv.core.env_server import create_fastapi_app

    sys.path.insert(0, str(HERE))
    from openenv_guess import GuessAction, GuessEnv, GuessObservation

    replies = ["3", '{"guess": 9}', "7", "5"]  # the target of seed 4 is 7 (openenv_guess)
    local, engine = play(tokenizer, "openenv:openenv_guess:GuessEnv", {"label": {"seed": 4}}, replies)
    assert local.reward == 1.0 and len(engine.calls) == 3
    refused, _ = play(tokenizer, "openenv:openenv_guess:GuessEnv", {"label": {"seed": 4}}, ["seven"])
    assert refused.info["invalid_action"] == 1.0 and refused.reward == 0.0
    app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=2)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        remote, engine = play(tokenizer, f"openenv:http://127.0.0.1:{port}", {"label": {"seed": 4}}, replies)
    finally:
        server.should_exit = True
        thread.join(10)
    assert remote.reward == local.reward and len(engine.calls) == 3


def test_verifiers_rubric_over_the_capture_server(tokenizer):
    need("verifiers")
    spec = "verifiers:" + str(HERE / "vf_sums.py")
    hub = load_hub(spec, {})
    row = hub.rows(8, 0, False)[3]  # What is 3 + 4?
    for text, expected in (("<answer>7</answer>", 1.5), ("<answer>6</answer> and a long tail of words", 0.0)):
        traj, engine = play(tokenizer, spec, row, [text])
        assert traj.reward == expected  # weights 1.0 and 0.5 (vf_sums)
        assert traj.info["correct"] == float(expected > 0) and traj.info["short"] == float(expected > 0)
        assert len(traj.segments) == 1 and engine.calls  # the env's own request, captured


def test_nemo_gym_reward_is_its_resources_servers_verify(tokenizer):
    """NeMo Gym needs Python 3.12: its shipped mcqa resources server runs in the venv of `make nemo-gym`."""
    import httpx

    python = Path(__file__).parents[2] / ".cache" / "nemo" / "bin" / "python"
    site = next(python.parents[1].glob("lib/python3.*/site-packages"), None)
    if site is None or not (site / "nemo_gym").is_dir():
        pytest.skip("NeMo Gym's Python 3.12 venv (`make nemo-gym`) is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(python), str(HERE / "nemo_gym_server.py"), "mcqa", str(port)])
    try:
        for _ in range(600):  # its start-up: imports of a few seconds
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.TransportError:
                threading.Event().wait(0.1)
        spec = f"nemo_gym:http://127.0.0.1:{port}"
        args = {"data": str(site / "resources_servers" / "mcqa" / "data" / "example.jsonl")}
        row = load_hub(spec, args).rows(5, 0, False)[0]
        assert row["label"]["expected_answer"] == "B"
        for text, expected in (("So \\boxed{B}", 1.0), ("\\boxed{A}", 0.0), ("B", 0.0)):  # strict: boxed only
            traj, engine = play(tokenizer, spec, row, [text], args)
            assert traj.reward == expected and len(engine.calls) == 1
    finally:
        server.terminate()
        server.wait(10)


def test_errors_name_the_package_the_ids_and_the_field(monkeypatch):
    need("reasoning_gym")
    need("textarena")
    from molt.envs import hubs

    with pytest.raises(ValueError, match="HUB one of reasoning_gym, gem"):
        load_hub("nohub:x", {})
    with pytest.raises(ValueError, match="no such id; 104 there, among them ab, acre"):
        load_hub("reasoning_gym:nope", {})
    with pytest.raises(ValueError, match="env.args of reasoning_gym:chain_sum: TypeError"):
        load_hub("reasoning_gym:chain_sum", {"bogus": 1})
    with pytest.raises(ValueError, match="refuses num_players 5"):
        load_hub("textarena:TicTacToe-v0", {"num_players": 5})
    monkeypatch.setattr(hubs.Gem, "module", "gem_not_installed")
    with pytest.raises(ValueError, match=r"needs the package gem-llm \(pip install -e '.\[envs\]'\)"):
        load_hub("gem:game:GuessTheNumber-v0-easy", {})
    with pytest.raises(ValueError, match="env.args: a JSON object, or a list of 2"):
        env_specs("a:b,c:d", '{"x": 1}')
    with pytest.raises(ValueError, match="env.args: not JSON"):
        env_specs("a:b", "{x")
    with pytest.raises(ValueError, match="plays dataset rows: give data.prompt_dataset"):
        env_rows([load_hub("skyrl_gym:gsm8k", {})], 10, 0, False, [])
