"""LoRA RL (molt.trainer.lora): PEFT adapters on a frozen base, the reference as the same module with the adapters
off, refit of the adapters alone (embedded engine) or of the targeted modules' merged weights (vLLM), DCP resume,
PEFT and merged exports, two FSDP2 ranks, MoE, Muon, the critic and `molt sft`."""

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from trainer_helpers import BASE, end_rank, make_window, rank_share, reference_logprobs

from molt.trainer import Actor, Critic
from molt.types import Experience, SamplingParams

LORA = {"actor.lora_rank": 4, "actor.lora_alpha": 8, "actor.adam.lr": 3e-2}
ADAPTERS = {"multiagent.adapters": True}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(trainer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model.named_parameters()
        if "lora_" in n
    }


def gap(a: list, b: list, exps: list[Experience]) -> float:
    """The largest difference on action tokens: rows of `a` per token, of `b` per action token."""
    return max(np.abs(np.asarray(ra)[e.action_mask] - rb).max() for e, ra, rb in zip(exps, a, b))


async def sample(engine, prompts, temperature=1.0, adapter="") -> list[Experience]:
    exps = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=i, adapter=adapter)
        c = await engine.generate(p, params)
        ids, mask = p + c.token_ids, [0] * len(p) + [1] * len(c.token_ids)
        exps.append(
            Experience(
                str(i),
                "g",
                0,
                0.0,
                len(ids),
                len(c.token_ids),
                0,
                temperature=temperature,
                token_ids=ids,
                action_mask=mask,
                behavior_logprobs=[0.0] * len(p) + c.logprobs,
                versions=[-1] * len(p) + c.versions,
            )
        )
    return exps


@pytest.fixture(scope="module")
def trained(tiny_llama_dir):
    """Two LoRA steps with a KL reference (the adapters-off forward)."""
    actor = Actor.from_pretrained(tiny_llama_dir, **LORA, **{"algo.kl.init_coef": 0.1})
    for seed in (1, 2):
        actor.train_step(make_window(tiny_llama_dir, seed=seed))
    return actor


def test_only_adapters_train_and_the_optimizer_holds_them_only(trained):
    trainable = {n for n, p in trained.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(TARGETS)  # every attention and MLP projection
    held = {id(p) for o in trained.optimizers for g in o.param_groups for p in g["params"]}
    assert held == {id(p) for p in trained.model.parameters() if p.requires_grad}
    assert all(
        float(p.abs().sum()) > 0 for n, p in lora_params(trained).items() if "lora_B" in n
    )  # it learned


def test_reference_is_the_same_module_with_adapters_off(trained, tiny_llama_dir):
    assert trained.ref is trained.model  # no second copy of the model
    window = make_window(tiny_llama_dir, seed=9, noise=0.0)  # behavior log-probs: the base checkpoint's own
    ref = trained.compute_logprobs(window, reference=True)
    base = [e.behavior_logprobs for e in window]
    assert gap(ref, base, window) <= 1e-5
    assert gap(trained.compute_logprobs(window), base, window) > 1e-3  # the adapters are back on afterwards


async def test_engine_and_trainer_logprobs_agree_before_and_after_refit(tiny_llama_dir):
    from molt.engine.hf import HFEngine

    actor = Actor.from_pretrained(tiny_llama_dir, **LORA)
    engine = HFEngine(str(tiny_llama_dir), lora=actor.cfg.actor.lora_options())  # the base + zero adapters
    prompts = [[5, 17, 40, 99, 3], [60, 61, 62], [7, 8]]
    try:
        before = await sample(engine, prompts, temperature=0.7)
        assert gap(actor.compute_logprobs(before), [e.behavior_logprobs for e in before], before) <= 1e-5
        for seed in (1, 2):
            actor.train_step(make_window(tiny_llama_dir, seed=seed))
        await engine.pause()
        for bucket in actor.iter_weights(bucket_bytes=16 << 10):  # the adapters alone
            assert all(".lora_A." in n or ".lora_B." in n for n, _ in bucket)
            await engine.update_weights(bucket, 1)
        await engine.resume()
        after = await sample(engine, prompts)
    finally:
        await engine.close()
    lp = actor.compute_logprobs(after)
    assert gap(lp, [e.behavior_logprobs for e in after], after) <= 1e-5
    base = [np.asarray(reference_logprobs(tiny_llama_dir, e.token_ids, 1.0))[e.action_mask] for e in after]
    assert gap(lp, base, after) > 1e-3  # the engine serves the trained policy, not the base


def test_refit_sends_only_the_adapters_to_the_embedded_engine(trained):
    streamed = {n: t for b in trained.iter_weights(bucket_bytes=16 << 10) for n, t in b}
    params = {n: p for n, p in trained.lm.named_parameters() if p.requires_grad}
    assert streamed.keys() == params.keys() and all(torch.equal(streamed[n], params[n]) for n in params)
    assert [n for b in trained.weight_plan(bucket_bytes=16 << 10) for n, _, _ in b] == list(streamed)
    sent = sum(t.numel() * t.element_size() for t in streamed.values())
    full = sum(
        t.numel() * t.element_size()
        for n, t in trained.lm.state_dict().items()
        if "lora_" not in n and n != "lm_head.weight"
    )  # tied to the embedding
    assert sent < 0.1 * full


def test_refit_sends_only_the_merged_targeted_modules_to_vllm(trained, monkeypatch):
    monkeypatch.setattr(trained.cfg.rollout, "engine", "vllm")
    streamed = {n: t for b in trained.iter_weights(bucket_bytes=16 << 10) for n, t in b}
    assert {n.rsplit(".", 2)[-2] for n in streamed} == set(TARGETS) and all(
        n.endswith(".weight") for n in streamed
    )
    assert [n for b in trained.weight_plan(bucket_bytes=16 << 10) for n, _, _ in b] == list(streamed)
    layer = trained.lm.model.layers[1].mlp.down_proj
    merged = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(streamed["model.layers.1.mlp.down_proj.weight"], merged, atol=1e-7)
    sent = sum(t.numel() * t.element_size() for t in streamed.values())
    full = sum(
        t.numel() * t.element_size()
        for n, t in trained.lm.state_dict().items()
        if "lora_" not in n and n != "lm_head.weight"
    )  # tied to the embedding
    print(f"refit bytes: LoRA {sent}, full {full} ({sent / full:.0%})")
    assert sent < 0.9 * full  # tiny model: the embedding is a large share; SmolLM2: docs/benchmarks.md


def test_exports_merged_checkpoint_and_peft_adapter(trained, tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained.export_hf(str(tmp_path / "hf"), bucket_bytes=100_000)
    ids = torch.tensor([[5, 9, 33, 70, 12, 40]])
    with torch.no_grad():
        live = trained.lm(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        adapter = PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter")(ids).logits
    assert torch.allclose(merged, live, atol=1e-5) and torch.allclose(adapter, live, atol=1e-5)
    assert not torch.allclose(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(ids).logits, live, atol=1e-3
    )


def test_checkpoint_resume_is_exact_and_holds_no_base_weights(tiny_llama_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    w = [make_window(tiny_llama_dir, seed=s) for s in (1, 2, 3)]
    opts = {**LORA, "actor.lr_scheduler": "cosine", "actor.lr_warmup_steps": 1, "actor.total_steps": 4}
    actor = Actor.from_pretrained(tiny_llama_dir, **opts)
    actor.train_step(w[0])
    actor.save(str(tmp_path / "ckpt"))
    keys = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert any("lora_A" in k for k in keys) and not any("base_layer" in k or "embed" in k for k in keys)
    for x in w[1:]:
        actor.train_step(x)
    resumed = Actor.from_pretrained(tiny_llama_dir, **opts)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    for x in w[1:]:
        resumed.train_step(x)
    a, b = lora_params(actor), lora_params(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPLIT = {"fsdp.packing_samples": True, "train.max_tokens_per_gpu": 48, "actor.gradient_checkpoint": True}


def lora_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import os

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    actor = Actor.from_pretrained(model_dir, **{**BASE, **LORA, **SPLIT})
    for seed in (1, 2):
        actor.train_step(rank_share(make_window(model_dir, seed=seed), rank))
    result = {
        "lora": lora_params(actor),
        "streamed": {n: t for b in actor.iter_weights() for n, t in b},
    }  # collective
    actor.cfg.rollout.engine = "vllm"  # the merged modules, gathered from the shards
    result["merged"] = {n: t for b in actor.iter_weights() for n, t in b}
    if rank == 0:
        torch.save(result, out)
    end_rank()


def test_two_fsdp2_ranks_match_one_process(tiny_llama_dir, tmp_path):
    """Frozen base weights and trainable adapters in the same sharded blocks, packed, checkpointed."""
    mp.spawn(
        lora_worker, args=(2, _free_port(), str(tiny_llama_dir), str(tmp_path / "r.pt")), nprocs=2, join=True
    )
    dist = torch.load(tmp_path / "r.pt")
    single = Actor.from_pretrained(tiny_llama_dir, **{**BASE, **LORA})
    for seed in (1, 2):
        single.train_step(make_window(tiny_llama_dir, seed=seed))
    one = lora_params(single)
    assert dist["lora"].keys() == one.keys()
    assert max(float((dist["lora"][k] - one[k]).abs().max()) for k in one) <= 1e-5
    streamed = {n: t for b in single.iter_weights() for n, t in b}
    assert dist["streamed"].keys() == streamed.keys() and all(".lora_" in k for k in streamed)  # the adapters
    single.cfg.rollout.engine = "vllm"
    merged = {n: t for b in single.iter_weights() for n, t in b}
    for got, want in ((dist["streamed"], streamed), (dist["merged"], merged)):
        assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-5


def test_moe_targets_attention_and_shared_expert_and_muon_trains_the_adapters(tiny_moe_dir):
    actor = Actor.from_pretrained(tiny_moe_dir, **LORA, **{"actor.optim": "muon"})
    before = lora_params(actor)
    actor.train_step(make_window(tiny_moe_dir, seed=1))
    after = lora_params(actor)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert [type(o).__name__ for o in actor.optimizers] == ["Muon"]  # every factor is a 2-D block weight
    muon = {id(p) for g in actor.optimizers[0].param_groups for p in g["params"]}
    assert muon == {id(p) for p in actor.model.parameters() if p.requires_grad}
    names = {n for b in actor.iter_weights() for n, _ in b}
    assert names and all(
        ".self_attn." in n or ".shared_expert." in n for n in names
    )  # routed experts: fused 3-D


def test_critic_adapters_and_value_head_train(tiny_llama_dir):
    critic = Critic.from_pretrained(tiny_llama_dir, **{"critic.lora_rank": 4, "critic.adam.lr": 5e-3})
    trainable = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all(n.startswith("value_head.") or "lora_" in n for n in trainable)
    window = make_window(tiny_llama_dir, seed=7)
    returns = [[1.0 if m else 0.0 for m in e.action_mask] for e in window]
    losses = [
        critic.train_step(window, returns, critic.compute_values(window))["critic_loss"] for _ in range(4)
    ]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "field,value,extra",
    [
        ("actor.lora_rank", -1, {}),
        ("actor.lora_dropout", 1.0, {"actor.lora_rank": 4}),
        ("actor.lora_target_modules", [], {"actor.lora_rank": 4}),
        ("fsdp.tp_size", 2, {"actor.lora_rank": 4}),
        ("actor.lora_target_modules", ["q_proj"], {"actor.lora_rank": 4, "rollout.engine": "vllm"}),
        ("multiagent.adapters", True, {"multiagent.roles": "a,b"}),  # no LoRA
        ("multiagent.adapters", True, {"actor.lora_rank": 4}),  # no roles
        ("train.weight_sync", "collective", {"actor.lora_rank": 4, "multiagent.roles": "a"} | ADAPTERS),
    ],
)
def test_config_errors_name_the_field(field, value, extra):
    from molt.config import MoltConfig
    from molt.config_resolve import override
    from molt.config_validate import validate

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate(override(MoltConfig(), {field: value, **extra}), check_files=False)


def test_sft_with_lora_lowers_the_loss(tiny_llama_dir, tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    from molt.cli import load_config
    from molt.runtime.sft import run_sft

    spec = importlib.util.spec_from_file_location(
        "make_data", Path(__file__).parents[2] / "recipes/sft/make_data.py"
    )
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    train, test = make_data.write(tmp_path / "data", n=48)
    out = tmp_path / "run"
    result = run_sft(
        load_config(
            [
                "--actor.model_name_or_path",
                str(tiny_llama_dir),
                "--actor.lora_rank",
                "8",
                "--actor.adam.lr",
                "1e-2",
                "--data.prompt_dataset",
                str(train),
                "--data.input_key",
                "messages",
                "--eval.dataset",
                str(test),
                "--train.batch_size",
                "8",
                "--train.max_steps",
                "4",
                "--ckpt.output_dir",
                str(out),
            ],
            prog="molt sft",
            sft=True,
        )
    )
    assert result["final_eval_loss"] < 0.95 * result["base_eval_loss"]  # 5.93 -> 5.54 (rank 8, 4 steps)
    assert json.loads((out / "policy" / "adapter" / "adapter_config.json").read_text())["r"] == 8
