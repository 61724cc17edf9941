"""One LoRA adapter per role (multiagent.adapters, molt.trainer.lora): each adapter trains on its role's tokens
alone, the embedded engine samples each request with its role's adapter in one mixed batch (PEFT's mixed-batch
forward) with the trainer's log-probs, a role without an adapter samples from the base, and the export writes a
merged checkpoint and a PEFT adapter per role."""

import asyncio

import pytest
import torch
from test_lora import LORA, gap, lora_params, sample
from trainer_helpers import make_window, reference_logprobs

from molt.trainer import Actor
from molt.trainer.lora import use_adapter

ROLES = {"multiagent.roles": "a,b,judge", "multiagent.train_roles": "a,b", "multiagent.adapters": True}


def with_role(exps, role):
    for e in exps:
        e.role = role
    return exps


def two_roles(model_dir, seed):
    a = with_role(make_window(model_dir, n=4, seed=seed), "a")
    return a + with_role(make_window(model_dir, n=4, seed=seed + 1), "b")


@pytest.fixture(scope="module")
def actor(tiny_llama_dir):
    """Both adapters trained a step."""
    actor = Actor.from_pretrained(tiny_llama_dir, **LORA, **ROLES)
    actor.train_step(two_roles(tiny_llama_dir, 1))
    return actor


def test_each_adapter_trains_on_its_roles_tokens_only(tiny_llama_dir):
    actor = Actor.from_pretrained(tiny_llama_dir, **LORA, **ROLES)
    assert {n.split(".")[-2] for n in lora_params(actor)} == {"a", "b"}  # no adapter for the judge
    before = lora_params(actor)
    actor.train_step(with_role(make_window(tiny_llama_dir, seed=1), "a"))
    after = lora_params(actor)
    moved = {n.split(".")[-2] for n in after if not torch.equal(after[n], before[n])}
    assert moved == {"a"}  # b's adapter had gradients of 0 (no weight decay, fresh AdamW state): unchanged
    actor.train_step(two_roles(tiny_llama_dir, 2))
    last = lora_params(actor)
    assert all(not torch.equal(last[n], after[n]) for n in last if ".lora_B." in n)  # both learn now


async def test_the_engine_samples_each_role_with_its_adapter_in_one_batch(actor, tiny_llama_dir):
    from molt.engine.hf import HFEngine

    engine = HFEngine(str(tiny_llama_dir), lora=actor.cfg.actor.lora_options(), adapters=["a", "b"])
    prompts = [[5, 17, 40, 99, 3], [60, 61, 62], [7, 8, 9, 10]]
    try:
        await engine.pause()
        for bucket in actor.iter_weights(bucket_bytes=16 << 10):  # both roles' factors, by name
            assert all(".lora_A." in n or ".lora_B." in n for n, _ in bucket)
            await engine.update_weights(bucket, 1)
        await engine.resume()
        roles = ["a", "b", "judge"]
        runs = await asyncio.gather(*(sample(engine, prompts, 1.0, adapter=r) for r in roles))  # concurrent
        long = [[(7 * i) % 300 + 10 for i in range(40)]]  # whole prefix-cache blocks: keyed by adapter too
        for role, exps in zip(roles, runs):
            exps += await sample(engine, long, 1.0, adapter=role)
    finally:
        await engine.close()
    for role, exps in zip(roles, runs):
        lp = actor.compute_logprobs(with_role(exps, role))
        assert gap(lp, [e.behavior_logprobs for e in exps], exps) <= 1e-5, role
    base = [reference_logprobs(tiny_llama_dir, e.token_ids, 1.0) for e in runs[2]]
    assert gap(base, [e.behavior_logprobs for e in runs[2]], runs[2]) <= 1e-5  # the judge: the base model
    a_as_b = actor.compute_logprobs(with_role(list(runs[0]), "b"))
    assert gap(a_as_b, [e.behavior_logprobs for e in runs[0]], runs[0]) > 1e-3  # the adapters differ


def test_export_writes_a_merged_checkpoint_and_an_adapter_per_role(actor, tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor.export_hf(str(tmp_path / "hf"), bucket_bytes=100_000)
    ids = torch.tensor([[5, 9, 33, 70, 12, 40]])
    logits = {}
    with torch.no_grad():
        for role in ("a", "b"):
            use_adapter(actor.lm, role)
            live = actor.lm(ids).logits
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / role)(ids).logits
            base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
            peft = PeftModel.from_pretrained(base, tmp_path / "hf" / role / "adapter")(ids).logits
            assert torch.allclose(merged, live, atol=1e-5) and torch.allclose(peft, live, atol=1e-5)
            logits[role] = live
    assert not torch.allclose(logits["a"], logits["b"], atol=1e-3)


def test_a_checkpoint_holds_every_adapter_and_resumes_them(actor, tiny_llama_dir, tmp_path):
    actor.save(str(tmp_path / "ckpt"))
    resumed = Actor.from_pretrained(tiny_llama_dir, **LORA, **ROLES)
    resumed.load(str(tmp_path / "ckpt"))
    saved, loaded = lora_params(actor), lora_params(resumed)
    assert saved.keys() == loaded.keys() and {n.split(".")[-2] for n in saved} == {"a", "b"}
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
