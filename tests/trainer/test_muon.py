"""`optim="muon"` (`--actor.optim muon`): the documented parameter groups, a Muon-shaped update, and a DCP
checkpoint that resumes both optimizers exactly."""

import re

import pytest
import torch
from trainer_helpers import BASE, full_params, make_window

MUON = {
    **BASE,
    "actor.optim": "muon",
    "actor.muon": {"lr": 0.02, "momentum": 0.95, "ns_steps": 5, "nesterov": True},
}
HIDDEN = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")  # the blocks' 2-D weights


def _groups(actor) -> dict[str, set[str]]:
    names = {id(p): n for n, p in actor.lm.named_parameters()}
    return {
        type(o).__name__: {names[id(p)] for g in o.param_groups for p in g["params"]}
        for o in actor.optimizers
    }


def test_parameter_groups(tiny_llama_dir):
    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir, **MUON)
    groups = _groups(actor)
    every = {n for n, _ in actor.lm.named_parameters()}
    assert set(groups) == {"AdamW", "Muon"}
    assert groups["Muon"] == {n for n in every if HIDDEN.fullmatch(n)} and len(groups["Muon"]) == 14
    assert groups["AdamW"] == every - groups["Muon"]  # embeddings (tied LM head), norms
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= groups["AdamW"]
    assert groups["AdamW"].isdisjoint(groups["Muon"])
    assert _groups(Actor.from_pretrained(tiny_llama_dir, **BASE)) == {
        "AdamW": every
    }  # the default: AdamW only


def test_groups_under_fsdp2(tiny_llama_dir):
    """bf16 parameters put even one CPU process on an FSDP2 mesh (which renames the block classes): the groups are
    the same, over DTensors, and a step runs."""
    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir, **{"actor.dtype": "bfloat16"}, **MUON)
    assert actor.mesh is not None and len(_groups(actor)["Muon"]) == 14
    assert actor.train_step(make_window(tiny_llama_dir, seed=1))["actor_grad_norm"] > 0


def test_muon_update_is_orthogonalized(tiny_llama_dir):
    """One step moves each hidden matrix by lr * sqrt(max(1, rows/cols)) * NS(momentum), whose singular values
    Newton-Schulz (Keller's coefficients) brings into about [0.7, 1.2]: the top one sits there, whatever the
    gradient's scale; AdamW's first step moves every entry by about its lr instead."""
    from molt.trainer import Actor

    actor = Actor.from_pretrained(tiny_llama_dir, **MUON)
    before = full_params(actor)
    actor.train_step(make_window(tiny_llama_dir, seed=1))
    after = full_params(actor)
    for name in _groups(actor)["Muon"]:
        rows, cols = before[name].shape
        top = torch.linalg.svdvals(after[name] - before[name]).max() / (0.02 * max(1.0, rows / cols) ** 0.5)
        assert 0.6 < top < 1.3, name
    embed = (after["model.embed_tokens.weight"] - before["model.embed_tokens.weight"]).abs()
    assert embed.max() == pytest.approx(1e-3, rel=0.05)  # AdamW: lr * g / (|g| + eps) on the rows it saw


def test_muon_run_resumes_exactly(tiny_llama_dir, tmp_path):
    from molt.trainer import Actor

    w1, w2, w3, w4 = (make_window(tiny_llama_dir, seed=s) for s in (1, 2, 3, 4))
    actor = Actor.from_pretrained(tiny_llama_dir, **MUON)
    for w in (w1, w2):
        actor.train_step(w)
    actor.save(str(tmp_path / "ckpt"))
    losses = [actor.train_step(w)["policy_loss"] for w in (w3, w4)]
    uninterrupted = full_params(actor)

    resumed = Actor.from_pretrained(tiny_llama_dir, **MUON)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 2
    muon = resumed.optimizers[1]
    assert all("momentum_buffer" in muon.state[p] for g in muon.param_groups for p in g["params"])
    assert [resumed.train_step(w)["policy_loss"] for w in (w3, w4)] == losses
    params = full_params(resumed)
    assert max(float((params[k] - uninterrupted[k]).abs().max()) for k in params) == 0.0

    fresh = Actor.from_pretrained(tiny_llama_dir, **MUON)  # the checkpoint's weights without Muon's state
    fresh.load(str(tmp_path / "ckpt"))
    fresh.optimizers[1].state.clear()  # Muon's momentum lost: steps 3 and 4 go elsewhere
    for w in (w3, w4):
        fresh.train_step(w)
    assert max(float((full_params(fresh)[k] - uninterrupted[k]).abs().max()) for k in params) > 1e-4


def test_bad_optimizer_names_the_field(tiny_llama_dir):
    from molt.cli import load_config
    from molt.trainer import Actor

    with pytest.raises(ValueError, match="actor.optim"):
        Actor.from_pretrained(tiny_llama_dir, **{"actor.optim": "sgd"})
    cfg = load_config(
        [
            "--actor.optim",
            "muon",
            "--actor.muon.lr",
            "0.01",
            "--actor.muon.no_nesterov",
            "--critic.muon.ns_steps",
            "3",
        ],
        check_files=False,
    )
    assert (cfg.actor.optim, cfg.actor.muon.lr, cfg.actor.muon.nesterov, cfg.critic.muon.ns_steps) == (
        "muon",
        0.01,
        False,
        3,
    )
