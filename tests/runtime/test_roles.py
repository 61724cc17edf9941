"""Several agents in one rollout: rewards per role, advantages normalised within a prompt's group and a role,
metrics that count a rollout once. Expected values computed by hand (docs/algo.md, "Several agents")."""

import math

import pytest

from molt.agents.contract import Result
from molt.agents.runners import Episode
from molt.runtime.metrics import eval_metrics, rollout_metrics
from molt.runtime.pool import Group, RolloutOutcome
from molt.runtime.trainer_group import credit_rows, rollout_advantages
from molt.types import Experience, Trajectory


def outcome(rid, roles, reward=0.0, rewards=None):
    exps = [Experience(rid, "g", i, 0.0, 4, 2, 0, role=role) for i, role in enumerate(roles)]
    return RolloutOutcome(rid, "g", reward=reward, rewards=rewards or {}, experiences=exps)


def test_a_reward_per_role_and_the_rollouts_mean():
    episode = Episode(Trajectory("r", "g"))
    episode.add(Result(reward={"planner": 1.0, "coder": 0.0}), "agent")
    episode.add(Result(reward={"planner": 0.5, "coder": 2.0}), "agent")  # per-step rewards add up per role
    assert episode.traj.rewards == {"planner": 1.5, "coder": 2.0}
    assert episode.traj.reward == 0.5 + 1.25  # each step's mean over its roles


def test_advantages_are_normalised_per_role_and_a_plain_reward_is_broadcast():
    # planner rewards 1, 0, 1 and coder rewards 10, 20, 30 in one prompt's group: GRPO within each role
    outcomes = [
        outcome("a", ["planner", "coder", "planner"], rewards={"planner": 1.0, "coder": 10.0}),
        outcome("b", ["planner", "coder"], rewards={"planner": 0.0, "coder": 20.0}),
        outcome("c", ["planner", "coder"], reward=7.0, rewards={"planner": 1.0, "coder": 30.0}),
    ]
    rows = credit_rows([Group((0, 0), "g", {}, outcomes)], -100.0, 100.0)
    assert [(c, g) for c, g, _ in rows][:2] == [(("a", "coder"), "g/coder"), (("a", "planner"), "g/planner")]
    adv = rollout_advantages("grpo", rows)
    # planner: mean 2/3, sample std sqrt(1/3); coder: mean 20, std 10 (torch.std, unbiased: n - 1)
    s = math.sqrt(1 / 3)
    assert adv[("a", "planner")] == pytest.approx((1 - 2 / 3) / s, abs=1e-5)
    assert adv[("b", "planner")] == pytest.approx((0 - 2 / 3) / s, abs=1e-5)
    assert adv[("a", "coder")] == pytest.approx(-1.0, abs=1e-5)
    assert adv[("c", "coder")] == pytest.approx(
        1.0, abs=1e-5
    )  # the coder's scale does not swamp the planner's
    broadcast = credit_rows([Group((0, 0), "g", {}, [outcome("d", ["planner", "coder"], reward=3.0)])], -9, 9)
    assert [r for _, _, r in broadcast] == [3.0, 3.0]
    single = credit_rows([Group((0, 0), "g", {}, [outcome("e", ["", ""], reward=2.0)])], 0, 1)
    assert single == [(("e", ""), "g/", 1.0)]  # one agent: one row, clamped, as before roles


def test_rollout_metrics_count_a_rollout_once_and_roles_apart():
    # a rollout with three segments over two roles, and one with one segment
    outcomes = [
        outcome("a", ["planner", "coder", "planner"], reward=0.5, rewards={"planner": 1.0, "coder": 0.0}),
        outcome("b", ["planner"], reward=1.0),
    ]
    m = rollout_metrics([Group((0, 0), "g", {}, outcomes)], version=0)
    assert m["rollout/reward_mean"] == 0.75 and m["rollout/count"] == 2.0
    assert m["rollout/role/planner/reward_mean"] == 1.0  # a: its own 1.0; b: the broadcast 1.0
    assert m["rollout/role/coder/reward_mean"] == 0.0 and m["rollout/role/coder/segments"] == 1.0
    assert m["rollout/role/planner/segments"] == 1.5 and m["rollout/role/planner/tokens"] == 3.0
    ev = eval_metrics(outcomes, [0, 0], "set", 2)
    assert ev["eval/accuracy"] == 1.0 and ev["eval_set_pass2"] == 1.0  # per rollout, not per segment


def test_two_roles_end_to_end_train_only_the_planner(tiny_llama_dir, tmp_path, ray_local):
    import asyncio
    import json
    from pathlib import Path

    from molt.cli import load_config
    from molt.runtime.loop import run_training

    out = tmp_path / "run"
    cfg = load_config(
        [
            *("--actor.model_name_or_path", str(tiny_llama_dir), "--ckpt.output_dir", str(out)),
            *("--train.agent_path", str(Path(__file__).parent / "agents" / "two_roles.py")),
            *(
                "--data.prompt_dataset",
                str(Path(__file__).parents[2] / "recipes/math/data/single_train.jsonl"),
            ),
            *("--multiagent.roles", "planner,coder", "--multiagent.train_roles", "planner"),
            *("--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.max_steps", "2"),
            *(
                "--rollout.no_engine_process",
                "--train.dump_trajectories_steps",
                "1",
                "--fsdp.no_packing_samples",
            ),
        ]
    )
    asyncio.run(run_training(cfg))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dumped = [json.loads(line) for line in (out / "dumps" / "step_1.jsonl").read_text().splitlines()]
    assert {d["role"] for d in dumped} == {"planner", "coder"}
    assert {d["break_reason"] for d in dumped if d["role"] == "coder"} == {"role"}
    # advantages per turn: the planner's one turn, the coder's two, each against the same turn of its group
    assert {len(d["advantage"]) for d in dumped if d["role"] == "coder"} == {2}
    assert {len(d["advantage"]) for d in dumped if d["role"] == "planner"} == {1}
    for group in {d["group_id"] for d in dumped}:
        turns = [d["advantage"] for d in dumped if d["group_id"] == group and d["role"] == "coder"]
        assert [sum(t) for t in zip(*turns)] == pytest.approx([0.0, 0.0], abs=1e-5)  # GRPO: zero mean a turn
    planner = sum(sum(d["action_mask"]) for d in dumped if d["role"] == "planner")
    assert metrics[0]["actor_window_tokens"] == planner  # the coder's tokens were recorded, not trained
    for role in ("planner", "coder"):
        assert f"rollout/role/{role}/reward_mean" in metrics[0]


async def test_a_request_names_its_role_by_model_or_header_and_an_unknown_header_is_refused(tokenizer):
    import openai

    from molt.testing.scripted import ScriptedEngine, live_capture_server

    engine = ScriptedEngine(tokenizer, ["plan", "work", "more"])
    async with live_capture_server(engine, tokenizer, roles="planner,coder") as server:
        session = await server.open_session()
        api = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        ask = [{"role": "user", "content": "go"}]
        await api.chat.completions.create(model="planner", messages=ask)
        await api.chat.completions.create(model="other", messages=ask, extra_headers={"x-molt-role": "coder"})
        await api.chat.completions.create(model="other", messages=ask)  # no declared role: as before
        as_planner = session.base_url.replace(session.session_id, f"{session.session_id}+planner")
        url = openai.AsyncOpenAI(base_url=as_planner, api_key=session.api_key, max_retries=0)
        await url.chat.completions.create(model="other", messages=ask)  # the URL names the role
        with pytest.raises(
            openai.BadRequestError, match="role 'judge' .x-molt-role or the session URL. is not one"
        ):
            await api.chat.completions.create(model="m", messages=ask, extra_headers={"x-molt-role": "judge"})
        judge = openai.AsyncOpenAI(base_url=as_planner.replace("+planner", "+judge"), api_key=session.api_key)
        with pytest.raises(openai.BadRequestError, match="role 'judge'"):
            await judge.with_options(max_retries=0).chat.completions.create(model="m", messages=ask)
        segments = await session.close()
    assert [(s.role, s.break_reason) for s in segments] == [
        ("planner", "start"),
        ("coder", "role"),
        ("", "role"),
        ("planner", "role"),
    ]


def test_role_baseline_is_a_running_mean_per_environment_and_role():
    from molt.runtime.trainer_group import running_baselines

    def game(gid, seat0, seat1):
        return Group(
            (0, 0),
            gid,
            {"env": "ta"},
            [outcome(gid + "r", ["seat0", "seat1"], rewards={"seat0": seat0, "seat1": seat1})],
        )

    baselines = {}
    step1 = [game("g1", 1.0, -1.0), game("g2", 1.0, -1.0)]
    rows = credit_rows(step1, -1, 1)
    adv = rollout_advantages("role_baseline", rows, running_baselines(step1, rows, baselines, decay=0.9))
    assert adv[("g1r", "seat0")] == 1.0 and adv[("g1r", "seat1")] == -1.0  # baselines start at 0
    assert baselines == {
        "ta/seat0": pytest.approx(0.1),
        "ta/seat1": pytest.approx(-0.1),
    }  # 0.9 * 0 + 0.1 * mean
    step2 = [game("g3", -1.0, 1.0)]
    rows = credit_rows(step2, -1, 1)
    adv = rollout_advantages("role_baseline", rows, running_baselines(step2, rows, baselines, decay=0.9))
    assert adv[("g3r", "seat0")] == pytest.approx(-1.1) and adv[("g3r", "seat1")] == pytest.approx(1.1)
    assert baselines["ta/seat0"] == pytest.approx(
        0.9 * 0.1 - 0.1
    )  # a group of one still learns: no group mean


# ------------------------------------------------------------------------------------------- per-turn rewards
def test_turn_rewards_credit_each_turn_with_its_return_against_the_same_turn_of_the_group():
    import numpy as np

    def turned(rid, segments, reward=0.0, turn_rewards=None):
        exps = [
            Experience(rid, "g", i, 0.0, len(mask), sum(mask), 0, action_mask=mask, turns=turns)
            for i, (mask, turns) in enumerate(segments)
        ]
        return RolloutOutcome(rid, "g", reward=reward, turn_rewards=turn_rewards or {}, experiences=exps)

    a_segments = [([0, 1, 1, 0, 1, 1, 1], [(0, 2), (1, 3)]), ([0, 0, 1], [(2, 1)])]
    outcomes = [
        turned("a", a_segments, turn_rewards={0: 1.0, 2: 0.5}),  # returns by turn: 1.5, 0.5, 0.5
        turned("b", [([0, 1, 0, 1], [(0, 1), (1, 1)])], turn_rewards={1: 2.0}),  # 2.0, 2.0
        turned("c", [([0, 1], [(0, 1)])], reward=2.5),  # no turn rewards: its reward on its one turn
    ]
    rows = credit_rows([Group((0, 0), "g", {}, outcomes)], -10.0, 10.0)
    assert sorted(rows) == sorted(
        [
            (("a", "", 0), "g//0", 1.5),
            (("a", "", 1), "g//1", 0.5),
            (("a", "", 2), "g//2", 0.5),
            (("b", "", 0), "g//0", 2.0),
            (("b", "", 1), "g//1", 2.0),
            (("c", "", 0), "g//0", 2.5),
        ]
    )
    adv = rollout_advantages("dr_grpo", rows)  # r - the mean of the same turn's returns in the group
    # turn 0: mean of 1.5, 2.0, 2.5 is 2.0; turn 1: mean of 0.5, 2.0 is 1.25; turn 2: a's alone
    assert adv == pytest.approx(
        {("a", "", 0): -0.5, ("b", "", 0): 0.0, ("c", "", 0): 0.5, ("a", "", 1): -0.75, ("b", "", 1): 0.75}
        | {("a", "", 2): 0.0}
    )
    first, second = outcomes[0].experiences
    assert np.array_equal(first.credited(adv), np.float32([0, -0.5, -0.5, 0, -0.75, -0.75, -0.75]))
    assert np.array_equal(second.credited(adv), np.zeros(3, np.float32))


def test_turn_rewards_are_recorded_by_model_call_from_an_agent_and_from_env_steps():
    episode = Episode(Trajectory("r", "g"))
    episode.add(Result(reward=1.0, turn_rewards=[0.0, 0.25, 1]), "agent")
    assert episode.traj.turn_rewards == {0: 0.0, 1: 0.25, 2: 1.0} and episode.traj.reward == 1.0
    steps = Episode(Trajectory("r", "g"))
    steps.add(Result(reward=0.5, turn_rewards=[0.5]), "env.step", 0)
    steps.add(Result(reward=0.0), "env.step", 1)
    steps.add(Result(reward=2.0, turn_rewards=[2.0]), "env.step", 2)
    assert steps.traj.turn_rewards == {0: 0.5, 2: 2.0} and steps.traj.reward == 2.5
    with pytest.raises(ValueError, match=r"Result.turn_rewards\[0\]"):
        Episode(Trajectory("r", "g")).add(Result(turn_rewards=["much"]), "agent")


async def test_capture_records_each_turns_model_call_and_tokens_across_roles(tokenizer):
    import openai

    from molt.testing.scripted import ScriptedEngine, live_capture_server

    engine = ScriptedEngine(tokenizer, ["plan it", "work", "more work", "done"])
    async with live_capture_server(engine, tokenizer, roles="planner,coder") as server:
        session = await server.open_session()
        api = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        plan = [{"role": "user", "content": "go"}]
        work = [{"role": "system", "content": "You work."}, {"role": "user", "content": "go"}]
        replies = []
        for model, messages in (("planner", plan), ("coder", work), ("coder", work), ("planner", plan)):
            reply = await api.chat.completions.create(model=model, messages=messages)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            messages.append({"role": "user", "content": "again"})
        segments = await session.close()
    # each role's conversation goes on in its own segment: the planner's holds the first and the last call
    assert [s.role for s in segments] == ["planner", "coder"]
    tokens = [r.usage.completion_tokens for r in replies]
    assert segments[0].turns == [(0, tokens[0]), (3, tokens[3])]
    assert segments[1].turns == [(1, tokens[1]), (2, tokens[2])]
    assert all(s.num_actions == sum(n for _, n in s.turns) for s in segments)
    # each call asks the engine for its role's adapter (multiagent.adapters), a conversation's later turns too
    assert [c["params"].adapter for c in engine.calls] == ["planner", "coder", "coder", "planner"]


def test_an_adapter_per_role_end_to_end_samples_trains_and_exports_each(tiny_llama_dir, tmp_path, ray_local):
    import asyncio
    from pathlib import Path

    import numpy as np

    from molt.cli import load_config
    from molt.runtime.loop import run_training
    from molt.testing.runs import jsonl

    out = tmp_path / "run"
    cfg = load_config(
        [
            *("--actor.model_name_or_path", str(tiny_llama_dir), "--ckpt.output_dir", str(out)),
            *("--train.agent_path", str(Path(__file__).parent / "agents" / "two_roles.py")),
            *(
                "--data.prompt_dataset",
                str(Path(__file__).parents[2] / "recipes/math/data/single_train.jsonl"),
            ),
            *("--multiagent.roles", "planner,coder", "--multiagent.adapters", "--actor.lora_rank", "4"),
            *("--actor.adam.lr", "3e-2", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2"),
            *("--train.max_steps", "2", "--train.max_staleness", "0", "--train.dump_trajectories_steps", "1"),
        ]
    )
    asyncio.run(run_training(cfg))
    for step in (1, 2):  # the engine (its own process) sampled each role with its adapter: the trainer agrees
        for d in jsonl(out / "dumps" / f"step_{step}.jsonl"):
            mask = np.asarray(d["action_mask"], bool)
            gap = np.abs(np.asarray(d["trainer_logprobs"]) - np.asarray(d["behavior_logprobs"]))[mask]
            assert gap.max() < 1e-4, (step, d["role"])
    for role in ("planner", "coder"):
        assert (out / "policy" / role / "adapter" / "adapter_model.safetensors").is_file()
        assert (out / "policy" / role / "config.json").is_file()
