"""End to end on a tiny real model: Ray workers (engine + capture server + agent), the pool, FSDP trainer ranks,
weight refit through the object store (or the collective group). Each run trains a few steps and we read what
it wrote."""
import asyncio
import json
from pathlib import Path

import pytest

from molt.config import MoltConfig, validate
from molt.runtime.loop import run_training

AGENTS = Path(__file__).parent / "agents"
DATA = Path(__file__).parents[2] / "recipes" / "math" / "data"


def _cfg(model_dir, out, agent="letters_env.py", **over):
    cfg = MoltConfig()
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
    return {int(p.stem.split("_")[1]): [r["versions"] for r in _read(out, f"dumps/{p.name}")]
            for p in (Path(out) / "dumps").glob("step_*.jsonl")}


def test_env_sync_trains_on_policy(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    summary = asyncio.run(run_training(_cfg(tiny_llama_dir, out, train__max_staleness=0)))
    assert summary["steps"] == 3
    metrics = _read(out, "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("rollout/reward_mean", "group_reward_std", "policy_loss", "actor_grad_norm", "timing/generation",
                "timing/policy_train", "timing/broadcast", "timing/step_total", "rollout/staleness_max"):
        assert key in metrics[0], key
    assert all(m["rollout/staleness_max"] == 0 for m in metrics)  # synchronous: on-policy
    assert all(m["rollout/segments_per_rollout"] == 1 for m in metrics)
    for step, segments in _dumped_versions(out).items():  # step s trains tokens of version s - 1 only
        assert {v for seg in segments for v in seg if v >= 0} == {step - 1}
    dump = _read(out, "dumps/step_1.jsonl")
    for rollouts in _by_group(dump).values():  # grpo: advantages are centred within each group
        assert abs(sum(r["advantage"] for r in rollouts)) < 1e-5
    ledger = _read(out, "ledger.jsonl")
    assert len(ledger) == 6 and len({tuple(r["key"]) for r in ledger}) == 6
    assert (out / "config.yaml").is_file() and (out / "summary.json").is_file()
    from molt.runtime.plot import plot_run

    png = plot_run(out)
    assert png.read_bytes()[:4] == b"\x89PNG"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "policy").config.vocab_size > 0  # the final policy


def test_env_async_partial_rollout_mixes_versions_within_bound(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    asyncio.run(run_training(_cfg(tiny_llama_dir, out, train__max_staleness=2, train__partial_rollout_enable=True,
                                  train__max_steps=5, algo__dynamic_filtering_enable=True)))
    metrics = _read(out, "metrics.jsonl")
    assert max(m["rollout/staleness_max"] for m in metrics) <= 2
    dumped = _dumped_versions(out)
    for step, segments in dumped.items():
        versions = [v for seg in segments for v in seg if v >= 0]
        assert min(versions) >= step - 1 - 2  # none beyond the bound
    mixed = [seg for segs in dumped.values() for seg in segs if len({v for v in seg if v >= 0}) > 1]
    assert mixed, "two-turn rollouts running across refits must carry more than one version"


@pytest.mark.parametrize("agent", ["sdk_agent.py", "anthropic_agent.py"])
@pytest.mark.parametrize("staleness", [0, 2])
def test_chat_agent_sdk_paths_train(tiny_llama_dir, tmp_path, ray_local, agent, staleness):
    out = tmp_path / "run"
    summary = asyncio.run(run_training(_cfg(tiny_llama_dir, out, agent, train__max_staleness=staleness,
                                            train__partial_rollout_enable=staleness > 0, train__max_steps=2)))
    assert summary["steps"] == 2
    assert max(m["rollout/staleness_max"] for m in _read(out, "metrics.jsonl")) <= staleness
    rows = _read(out, "dumps/step_2.jsonl")
    assert rows and all(sum(r["action_mask"]) > 0 for r in rows)
    assert all("<|im_start|>assistant" in r["text"] for r in rows)  # rendered through the chat template


def test_faults_are_counted_and_the_run_completes(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    asyncio.run(run_training(_cfg(tiny_llama_dir, out, "faulty_env.py", train__max_staleness=1, train__max_steps=3,
                                  rollout__timeout_s=1.5, rollout__max_failed_retries=3)))
    metrics = _read(out, "metrics.jsonl")
    last = metrics[-1]
    assert len(metrics) == 3
    assert last.get("rollout/failed/agent_error", 0) > 0 and last.get("rollout/failed/timeout", 0) > 0


def test_eval_only_mode(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    cfg = _cfg(tiny_llama_dir, out, eval__only=True, eval__n_samples_per_prompt=2,
               eval__dataset=str(DATA / "single_test.jsonl"))
    summary = asyncio.run(run_training(cfg))
    assert summary["steps"] == 0 and summary["base_eval_accuracy"] is not None
    (row,) = _read(out, "metrics.jsonl")
    assert row["step"] == 0 and "eval_single_test_pass2" in row and "eval_single_test_avg2" in row


def test_collective_refit_leaves_the_engine_with_the_trained_weights(tiny_llama_dir, tmp_path, ray_local):
    """Refit over the dedicated gloo group (the NCCL path's CPU twin): after the last step's refit the engine
    holds exactly the weights the trainer exports."""
    import torch
    from transformers import AutoModelForCausalLM

    from molt.runtime.loop import Run

    out = tmp_path / "run"
    cfg = _cfg(tiny_llama_dir, out, train__weight_sync="collective", train__max_staleness=1, train__max_steps=2,
               rollout__num_workers=2)

    async def main():
        run = Run(cfg)
        try:
            await run.setup()
            summary = await run.train()
            return summary, [await w.weight_sums.remote() for w in run.workers], await run.workers[0].version.remote()
        finally:
            await run.close()
    summary, sums, version = asyncio.run(main())
    assert summary["steps"] == 2 and version == 2
    trained = AutoModelForCausalLM.from_pretrained(out / "policy").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[name], base[name])  # training moved the weights ...
    for worker in sums:  # ... and both engines hold the trained ones
        for n, t in trained.items():
            assert worker[n] == float(t.double().sum()), n


def test_gae_trains_the_critic_next_to_the_actor(tiny_llama_dir, tmp_path, ray_local):
    out = tmp_path / "run"  # packed micro-batches, for the actor and the critic, over two FSDP2 ranks
    summary = asyncio.run(run_training(_cfg(tiny_llama_dir, out, algo__advantage=_gae(), train__max_steps=2,
                                            train__num_ranks=2, fsdp__packing_samples=True)))
    assert summary["steps"] == 2
    metrics = _read(out, "metrics.jsonl")
    for m in metrics:
        assert m["critic_loss"] == m["critic_loss"] and m["critic_grad_norm"] > 0  # finite, and it learns
        assert "timing/critic_train" in m


def _gae():
    from molt.config import AdvantageConfig

    return AdvantageConfig(estimator="gae", gamma=1.0, lam=0.95)
