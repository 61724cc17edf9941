"""The shapes recipe (recipes/shapes) end to end on the tiny LLaVA: Ray workers, capture, the embedded engine
with pixel inputs, experiences with their images through the object store, the trainer with a frozen vision
tower, refit, export. The Env synchronously, and the two-turn ChatAgents (OpenAI and Anthropic SDKs, an image
each turn) asynchronously."""

import asyncio
import io
import json
import sys
from pathlib import Path

import pytest

from molt.config import MoltConfig
from molt.config_validate import validate
from molt.runtime.loop import run_training

RECIPE = Path(__file__).parents[2] / "recipes" / "shapes"
sys.path.insert(0, str(RECIPE))
import shapes_task as st


def test_task_draws_and_grades():
    from PIL import Image

    for shape in st.SHAPES:
        im = Image.open(io.BytesIO(st.draw(shape, "red")))
        assert im.size == (28, 28) and im.getpixel((14, 14)) == st.COLOURS["red"]
    assert st.grade("It is a Circle.", "circle", st.SHAPES) == 1.0
    assert st.grade("circle or square", "circle", st.SHAPES) == 0.0
    assert st.grade("", "circle", st.SHAPES) == 0.0


def _cfg(model_dir, out, agent, **over):
    """The recipe's settings, shrunk to two small steps; `over`: dotted names -> values."""
    settings = {
        "actor.model_name_or_path": str(model_dir),
        "actor.freeze_visual_encoder": True,
        "actor.adam.lr": 1e-3,
        "train.agent_path": str(RECIPE / agent),
        "train.max_steps": 2,
        "train.dump_trajectories_steps": 1,
        "data.prompt_dataset": str(RECIPE / "data" / "train.jsonl"),
        "data.max_images_per_prompt": 1,
        "rollout.batch_size": 2,
        "rollout.n_samples_per_prompt": 2,
        "rollout.max_new_tokens": 6,
        "rollout.timeout_s": 60.0,
        "ckpt.output_dir": str(out),
        **over,
    }
    cfg = MoltConfig()
    for dotted, value in settings.items():
        *parents, name = dotted.split(".")
        target = cfg
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return validate(cfg)


def _image_tokens(out, model_dir):
    from transformers import AutoConfig

    image_id = AutoConfig.from_pretrained(model_dir).image_token_id
    rows = [json.loads(line) for line in (Path(out) / "dumps" / "step_1.jsonl").read_text().splitlines()]
    return [r["token_ids"].count(image_id) for r in rows]


def test_env_recipe_trains_synchronously(tiny_vlm_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    summary = asyncio.run(run_training(_cfg(tiny_vlm_dir, out, "agent.py", **{"train.max_staleness": 0})))
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rollout/segments_per_rollout"] == 1 and "actor_grad_norm" in m for m in metrics)
    assert _image_tokens(out, tiny_vlm_dir) == [4] * 4  # one image per prompt, 4 tokens each
    from transformers import AutoModelForImageTextToText, AutoProcessor

    assert AutoProcessor.from_pretrained(out / "policy").image_processor is not None  # the export reloads
    assert AutoModelForImageTextToText.from_pretrained(out / "policy").config.image_token_id > 0


@pytest.mark.slow
@pytest.mark.parametrize("agent", ["openai_agent.py", "anthropic_agent.py"])
def test_two_turn_chat_agents_train_asynchronously(agent, tiny_vlm_dir, tmp_path, ray_local):
    out = tmp_path / "run"
    asyncio.run(
        run_training(
            _cfg(tiny_vlm_dir, out, agent, **{"train.max_staleness": 1, "rollout.engine_process": False})
        )
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout/segments_per_rollout"] == 1 for m in metrics)  # both turns in one segment
    assert _image_tokens(out, tiny_vlm_dir) == [8] * 4  # and both images in it
