"""Weights out (bucketed stream, HF export), the reference model, the critic and config validation."""

import warnings

import pytest
import torch
from trainer_helpers import make_window

from molt.trainer import Actor, Critic


@pytest.fixture(scope="module")
def trained(tiny_llama_dir):
    actor = Actor.from_pretrained(
        tiny_llama_dir, **{"actor.adam.lr": 1e-2, "train.micro_batch_size": 4, "train.max_tokens_per_gpu": 0}
    )
    actor.train_step(make_window(tiny_llama_dir, seed=5))
    return actor


def test_stream_equals_state_dict_and_reproduces_logits(trained):
    from transformers import AutoModelForCausalLM

    buckets = list(trained.iter_weights(bucket_bytes=40_000))
    assert len(buckets) > 3
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 40_000 or len(b) == 1 for b in buckets)
    streamed = dict(kv for b in buckets for kv in b)
    assert sum(len(b) for b in buckets) == len(streamed)  # no name twice
    full = trained.lm.state_dict()
    # tied embeddings: yielded once, as the input embedding
    assert "lm_head.weight" not in streamed and "model.embed_tokens.weight" in streamed
    assert set(full) - set(streamed) == {"lm_head.weight"}
    for name, t in streamed.items():
        assert torch.equal(t, full[name]), name
    fresh = AutoModelForCausalLM.from_config(trained.lm.config)
    missing, unexpected = fresh.load_state_dict(streamed, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    fresh.tie_weights()
    ids = torch.tensor([[5, 9, 33, 70, 12]])
    with torch.no_grad():
        assert torch.allclose(fresh(ids).logits, trained.lm(ids).logits, atol=1e-6)


def test_plan_describes_the_stream_without_gathering(trained):
    plan = trained.weight_plan(bucket_bytes=40_000)
    buckets = list(trained.iter_weights(bucket_bytes=40_000))
    assert plan == [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b] for b in buckets]
    half = trained.weight_plan(bucket_bytes=40_000, dtype=torch.bfloat16)
    assert {d for b in half for _, _, d in b} == {"bfloat16"}
    assert len(half) < len(plan)  # half the bytes: fewer buckets


def test_export_loads_and_generates_same_greedy_text(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained.export_hf(str(tmp_path / "hf"), bucket_bytes=100_000)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("What is 3 + 4?", return_tensors="pt").input_ids
    kwargs = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.no_grad():
        out_loaded = loaded.generate(ids, **kwargs)
        out_live = trained.lm.generate(ids, **kwargs)
    assert tok.decode(out_loaded[0]) == tok.decode(out_live[0])
    assert out_loaded.shape[1] > ids.shape[1]


def test_reference_only_with_kl_and_refused_as_a_reward_of_group_estimators(tiny_llama_dir):
    assert Actor.from_pretrained(tiny_llama_dir).ref is None
    with pytest.raises(ValueError, match="algo.kl.use_loss false"):
        Actor.from_pretrained(
            tiny_llama_dir,
            **{"algo.kl.init_coef": 0.1, "algo.kl.use_loss": False, "algo.advantage.estimator": "grpo"},
        )
    actor = Actor.from_pretrained(tiny_llama_dir, **{"algo.kl.init_coef": 0.1, "actor.adam.lr": 1e-2})
    window = make_window(tiny_llama_dir, seed=6)
    first = actor.train_step(window)
    assert first["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # the reference starts equal to the policy
    assert actor.train_step(window)["kl/mean"] > 0.0
    ref = actor.compute_logprobs(window, reference=True)
    assert ref[0][-1] == pytest.approx(
        make_window(tiny_llama_dir, seed=6, noise=0.0)[0].behavior_logprobs[-1], abs=1e-5
    )


def test_critic_learns_returns(tiny_llama_dir):
    critic = Critic.from_pretrained(
        tiny_llama_dir, **{"critic.adam.lr": 5e-3, "train.micro_batch_size": 3, "train.max_tokens_per_gpu": 0}
    )
    window = make_window(tiny_llama_dir, seed=7)
    values = critic.compute_values(window)
    assert all(v == 0.0 for row in values for v in row)  # zero-initialized head
    returns = [[1.0 if m else 0.0 for m in e.action_mask] for e in window]
    losses = []
    for _ in range(4):
        old = critic.compute_values(window)
        losses.append(critic.train_step(window, returns, old)["critic_loss"])
    assert losses[0] == pytest.approx(0.5, abs=1e-6) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "field,value",
    [
        ("actor.adam.lr", -1.0),
        ("actor.lr_scheduler", "linear"),
        ("train.micro_batch_size", -1),
        ("train.max_tokens_per_gpu", -1),
        ("actor.eps_clip_low_high", (-0.1, 0.2)),
        ("actor.dtype", "int8"),
        ("fsdp.device", "tpu"),
        ("actor.policy_loss", "nope"),
        ("actor.total_steps", 0),
    ],
)
def test_config_errors_name_the_field(tiny_llama_dir, field, value):
    over = {field: value, **({"actor.lr_scheduler": "cosine"} if field == "actor.total_steps" else {})}
    with pytest.raises(ValueError, match=field.rsplit(".", 1)[-1]):
        Actor.from_pretrained(tiny_llama_dir, **over)


def test_cosine_schedule_with_warmup():
    from molt.config import ActorConfig
    from molt.trainer.optim import lr_multiplier

    f = lr_multiplier(ActorConfig(lr_scheduler="cosine", lr_warmup_steps=2, total_steps=6, min_lr_ratio=0.1))
    assert [round(f(s), 6) for s in range(7)] == [
        0.5,
        1.0,
        1.0,
        round(0.1 + 0.9 * 0.5 * (1 + 0.7071067811865476), 6),
        0.55,
        round(0.1 + 0.9 * 0.5 * (1 - 0.7071067811865476), 6),
        0.1,
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lr_multiplier(ActorConfig())(100) == 1.0
