"""End to end on a tiny real model: Ray workers (engine + capture server + agent), the pool, FSDP trainer ranks,
weight refit through the object store (or the collective group). Each run trains a few steps and we read what
it wrote."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from molt.config import MoltConfig
from molt.config_validate import validate
from molt.runtime.loop import run_training

AGENTS = Path(__file__).parent / "agents"
DATA = Path(__file__).parents[2] / "recipes" / "math" / "data"


def _cfg(model_dir, out, agent="letters_env.py", **over):
    """A 3-step run of `agent`. Its engine runs in the worker's own process: a run's start-up is three
    processes importing torch and transformers on this 2-core machine, and the engine's own process (the
    default, `rollout.engine_process`) adds about 5 s a run; the tests about that process pass it back."""
    cfg = MoltConfig()
    cfg.rollout.engine_process = False
    cfg.actor.model_name_or_path = str(model_dir)
    cfg.actor.adam.lr = 1e-3
    cfg.train.agent_path = str(AGENTS / agent)
    cfg.data.prompt_dataset = str(DATA / "single_train.jsonl")
    cfg.train.max_steps = 3
    cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 2, 4, 12
    cfg.rollout.timeout_s = 30.0
    cfg.ckpt.output_dir = str(out)
    cfg.train.dump_trajectories_steps = 1
    for dotted, value in over.items():
        group, name = dotted.split("__")
        setattr(getattr(cfg, group), name, value)
    return validate(cfg)


def _read(out, name):
    return [json.loads(line) for line in (Path(out) / name).read_text().splitlines()]


def _by_group(rows):
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    return groups


def _dumped_versions(out):
    return {
        int(p.stem.split("_")[1]): [r["versions"] for r in _read(out, f"dumps/{p.name}")]
        for p in (Path(out) / "dumps").glob("step_*.jsonl")
    }


def test_env_sync_trains_on_policy(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    summary = asyncio.run(
        run_training(
            _cfg(
                tiny_llama_dir,
                out,
                train__max_staleness=0,
                ckpt__save_steps=1,
                ckpt__save_hf=True,
                rollout__engine_process=True,
            )
        )
    )
    assert summary["steps"] == 3
    assert _assert_logprobs_match_versions(tiny_llama_dir, out) == {0, 1, 2}  # the engines got each refit
    metrics = _read(out, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in (
        "rollout/reward_mean",
        "group_reward_std",
        "policy_loss",
        "actor_grad_norm",
        "timing/generation",
        "timing/policy_train",
        "timing/broadcast",
        "timing/step_total",
        "rollout/staleness_max",
    ):
        assert key in metrics[0], key
    assert all(m["rollout/staleness_max"] == 0 for m in metrics)  # synchronous: on-policy
    assert all(m["rollout/segments_per_rollout"] == 1 for m in metrics)
    for step, segments in _dumped_versions(out).items():  # step s trains tokens of version s - 1 only
        assert {v for seg in segments for v in seg if v >= 0} == {step - 1}
    dump = _read(out, "dumps/step_1.jsonl")
    for rollouts in _by_group(dump).values():  # grpo by hand: (r - mean) / (Bessel std + 1e-6)
        rewards = [r["reward"] for r in rollouts]
        mean = sum(rewards) / 4
        std = (sum((x - mean) ** 2 for x in rewards) / 3) ** 0.5
        assert [r["advantage"] for r in rollouts] == pytest.approx(
            [(x - mean) / (std + 1e-6) for x in rewards]
        )
    assert any(r["advantage"] != 0 for r in dump)  # the rewards were not all equal
    ledger = _read(out, "ledger.jsonl")
    assert len(ledger) == 6 and len({tuple(r["key"]) for r in ledger}) == 6
    assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
    from molt.runtime.plot import plot_run

    png = plot_run(out)
    assert png.read_bytes()[:4] == b"\x89PNG"
    _assert_trained_export(tiny_llama_dir, out, out / "checkpoints" / "step_3" / "hf")


def test_env_async_partial_rollout_mixes_versions_within_bound(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    asyncio.run(
        run_training(
            _cfg(
                tiny_llama_dir,
                out,
                train__max_staleness=2,
                train__partial_rollout_enable=True,
                train__max_steps=5,
                algo__dynamic_filtering_enable=True,
            )
        )
    )
    metrics = _read(out, "metrics.jsonl")
    assert max(m["rollout/staleness_max"] for m in metrics) <= 2
    dumped = _dumped_versions(out)
    for step, segments in dumped.items():
        versions = [v for seg in segments for v in seg if v >= 0]
        assert min(versions) >= step - 1 - 2  # none beyond the bound
    mixed = [seg for segs in dumped.values() for seg in segs if len({v for v in seg if v >= 0}) > 1]
    assert mixed, "two-turn rollouts running across refits must carry more than one version"


# each SDK once and each dispatch mode once (the wire does not depend on the staleness; saves two runs)
@pytest.mark.parametrize(("agent", "staleness"), [("sdk_agent.py", 0), ("anthropic_agent.py", 2)])
def test_chat_agent_sdk_paths_train(tiny_llama_dir, tmp_path, ray_local, agent, staleness):
    out = tmp_path / "run"
    summary = asyncio.run(
        run_training(
            _cfg(
                tiny_llama_dir,
                out,
                agent,
                train__max_staleness=staleness,
                train__partial_rollout_enable=staleness > 0,
                train__max_steps=2,
                rollout__engine_process=staleness > 0,
            )
        )
    )  # pause, resume: its IPC
    assert summary["steps"] == 2
    assert max(m["rollout/staleness_max"] for m in _read(out, "metrics.jsonl")) <= staleness
    rows = _read(out, "dumps/step_2.jsonl")
    assert rows and all(sum(r["action_mask"]) > 0 for r in rows)
    assert all("<|im_start|>assistant" in r["text"] for r in rows)  # rendered through the chat template


def test_faults_are_counted_and_the_run_completes(tiny_llama_dir, tmp_path, ray_local):
    """Prompts whose tool always crashes or hangs (faulty_env.py): each such group fails its first try and its
    3 retries, then is dropped and backfilled. Synchronous dispatch takes prompts in the seeded order and hands
    out a step only when nothing else is in flight, so every count follows from the data."""
    sys.path.insert(0, str(AGENTS))
    from faulty_env import fault

    from molt.runtime.pool import PromptStream

    out = tmp_path / "run"
    # a timeout far above a good rollout's time on a busy machine (one hanging group in the first 3 steps)
    asyncio.run(
        run_training(
            _cfg(
                tiny_llama_dir,
                out,
                "faulty_env.py",
                train__max_staleness=0,
                train__max_steps=3,
                rollout__timeout_s=10.0,
                rollout__max_failed_retries=3,
            )
        )
    )
    rows = [json.loads(line) for line in (DATA / "single_train.jsonl").read_text().splitlines()]
    metrics, ledger = _read(out, "metrics.jsonl"), _read(out, "ledger.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    order, good = [], 0
    for key, row in PromptStream(rows, seed=42):  # the prompts dispatched by the end of each step
        order.append((key, fault(row["label"])))
        if order[-1][1] is not None:
            continue
        good += 1
        if good % 2 == 0:
            step, kinds = good // 2, [k for _, k in order]
            expected = {
                "rollout/failed/agent_error": 4 * kinds.count("agent_error"),
                "rollout/failed/timeout": 4 * kinds.count("timeout"),
                "rollout/dropped/group_failed": len(kinds) - good,
            }
            assert {k: metrics[step - 1].get(k, 0) for k in expected} == expected, step
            trained = sorted(tuple(r["key"]) for r in ledger if r["step"] <= step)
            assert trained == sorted(tuple(key) for key, k in order if k is None), step
            if step == 3:
                break
    assert metrics[-1]["rollout/dropped/group_failed"] > 0  # the data did hold faulty prompts


def test_eval_only_mode(tiny_llama_dir, tmp_path, ray_local):
    """label_env.py scores by the prompt alone (even label: 1) and crashes on labels divisible by 3."""
    out = tmp_path / "run"
    cfg = _cfg(
        tiny_llama_dir,
        out,
        "label_env.py",
        eval__only=True,
        eval__n_samples_per_prompt=2,
        eval__dataset=str(DATA / "single_test.jsonl"),
    )
    summary = asyncio.run(run_training(cfg))
    labels = [
        int(json.loads(line)["label"]) for line in (DATA / "single_test.jsonl").read_text().splitlines()
    ]
    right = sum(x % 2 == 0 and x % 3 != 0 for x in labels) / len(labels)  # a crash counts as wrong
    assert summary["steps"] == 0 and summary["base_eval_accuracy"] == pytest.approx(right)
    (row,) = _read(out, "metrics.jsonl")
    assert row["step"] == 0 and row["eval_single_test_pass2"] == row[
        "eval_single_test_avg2"
    ] == pytest.approx(right)
    assert row["eval/failed"] == 2 * sum(x % 3 == 0 for x in labels)
    assert not (out / "ledger.jsonl").exists() and not (out / "policy").exists()  # nothing trained


@pytest.mark.parametrize("sync", ["object_store", "collective"])
def test_refit_leaves_the_engine_with_the_trained_weights(tiny_llama_dir, tmp_path, ray_local, sync):
    """Refit through the object store (the CPU default) or over the dedicated gloo group (the NCCL path's CPU
    twin), without partial rollout: every engine samples each token with the weights of the version it
    carries (checked against a plain forward of that step's checkpoint), no completion mixes versions, and
    after the last refit both engines hold exactly the weights the trainer exports."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt.runtime.loop import Run

    out = tmp_path / "run"
    cfg = _cfg(
        tiny_llama_dir,
        out,
        train__weight_sync=sync,
        train__max_staleness=1,
        train__max_steps=3,
        rollout__num_workers=2,
        ckpt__save_steps=1,
        ckpt__save_hf=True,
        rollout__engine_process=True,
    )

    async def main():
        run = Run(cfg)
        try:
            await run.setup()
            summary = await run.train()
            return (
                summary,
                [await w.weight_sums.remote() for w in run.workers.actors],
                await run.workers.actors[0].version.remote(),
            )
        finally:
            await run.close()

    summary, sums, version = asyncio.run(main())
    assert summary["steps"] == 3 and version == 3
    versions = _assert_logprobs_match_versions(tiny_llama_dir, out)
    assert versions >= {0, 1}, versions  # refits landed while rollouts were sampled
    trained = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[name], base[name])  # training moved the weights ...
    for worker in sums:  # ... and both engines hold the trained ones
        for n, t in trained.items():
            assert worker[n] == float(t.double().sum()), n


def test_gae_trains_the_critic_next_to_the_actor(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"  # packed micro-batches, for the actor and the critic, over two FSDP2 ranks
    summary = asyncio.run(
        run_training(
            _cfg(
                tiny_llama_dir,
                out,
                algo__advantage=_gae(),
                train__max_steps=2,
                train__num_ranks=2,
                fsdp__packing_samples=True,
            )
        )
    )
    assert summary["steps"] == 2
    metrics = _read(out, "metrics.jsonl")
    # step 1 by hand: the value head starts at zero, so V = 0, delta_t = r_t (the reward on the last action
    # token), the return of the j-th of n action tokens is lam^(n-1-j) R, and the critic's first loss is the
    # token mean of 0.5 * return^2 over the window (both ranks)
    rollouts = {}
    for row in _read(out, "dumps/step_1.jsonl"):
        n, reward = rollouts.get(row["rollout_id"], (0, row["reward"]))
        rollouts[row["rollout_id"]] = (n + sum(row["action_mask"]), reward)
    squares = [0.5 * (0.95 ** (n - 1 - j) * r) ** 2 for n, r in rollouts.values() for j in range(n)]
    assert metrics[0]["critic_loss"] == pytest.approx(sum(squares) / len(squares), rel=1e-4)
    assert all(m["critic_grad_norm"] > 0 and "timing/critic_train" in m for m in metrics)


def _gae():
    from molt.config import AdvantageConfig

    return AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95)


def _one_version_per_completion(row) -> set[int]:
    """The versions of a dumped segment; each completion (a run of action tokens) must carry just one."""
    runs, last = [], 0
    for m, v in zip(row["action_mask"], row["versions"]):
        if m and not last:
            runs.append(set())
        if m:
            runs[-1].add(v)
        last = m
    assert all(len(r) == 1 for r in runs), f"a completion mixes versions: {runs}"
    return set().union(*runs)


def _assert_logprobs_match_versions(base_dir, out) -> set[int]:
    """Every action token's behavior log-prob equals log_softmax(logits) under the weights of its version: the
    base checkpoint for version 0, `checkpoints/step_v/hf` (the trainer's export after step v) otherwise.
    A refit that bumped the version without loading the weights fails here. Returns the versions seen."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import reference_logprobs

    seen: set[int] = set()
    for step in sorted(_dumped_versions(out)):
        for row in _read(out, f"dumps/step_{step}.jsonl"):
            versions = _one_version_per_completion(row)
            seen |= versions
            for v in versions:
                weights = base_dir if v == 0 else Path(out) / "checkpoints" / f"step_{v}" / "hf"
                ref = reference_logprobs(weights, row["token_ids"], 1.0)
                got = [
                    (b, r)
                    for b, r, m, w in zip(row["behavior_logprobs"], ref, row["action_mask"], row["versions"])
                    if m and w == v
                ]
                assert [b for b, _ in got] == pytest.approx([r for _, r in got], abs=2e-3), (step, v)
    return seen


def _assert_trained_export(base_dir, out, last) -> None:
    """The exported policy (`policy/`) is the last checkpoint's weights (which the engines sampled with), and
    training moved them off the base."""
    import torch
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(Path(out) / "policy").state_dict()
    base = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(last).state_dict()
    assert final.keys() == base.keys() == saved.keys()
    assert all(torch.equal(final[k], saved[k]) for k in final)
    assert sum(not torch.equal(final[k], base[k]) for k in final) > len(final) // 2


def test_a_group_estimator_registered_by_the_user_trains(tiny_llama_dir, tmp_path, ray_local):
    """docs/algo.md's grpo_median, named by `algo.plugins`: validated, then computed by the controller (a group
    estimator, as its registration declares) on each step's groups."""
    plugin = Path(__file__).parents[1] / "data" / "grpo_median.py"
    out = tmp_path / "run"
    cfg = _cfg(tiny_llama_dir, out, train__max_steps=1, train__max_staleness=0, algo__plugins=[str(plugin)])
    cfg.algo.advantage.estimator = "grpo_median"  # the run imports the plugin before it looks the name up
    asyncio.run(run_training(cfg))
    rows = {r["rollout_id"]: r for r in _read(out, "dumps/step_1.jsonl")}
    for group in _by_group(rows.values()).values():
        median = sorted(r["reward"] for r in group)[(len(group) - 1) // 2]  # torch's: the lower middle value
        assert len(group) == 4 and all(r["advantage"] == pytest.approx(r["reward"] - median) for r in group)
