"""`ChatAgentRunner` and `StepEnvRunner`: one rollout of a dataset row -> one `Trajectory`, never a crash.

Design notes and decisions: docs/internals.md, section `molt/agents/runners.py`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import traceback
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path
from typing import Any

from molt.agents.contract import CaptureSession, ChatContext, Result, Runner, SessionProvider, Turn
from molt.types import RolloutStatus, SamplingParams, Trajectory


class InvalidReward(ValueError):
    """The agent returned no usable reward."""


def to_float(value: Any, what: str = "reward") -> float:
    """A float from a number, or from a tensor/array/list whose first element is one (torch is never imported:
    `.item()` and indexing are enough)."""
    x = value
    try:
        while not isinstance(x, (int, float)):
            if x is None or isinstance(x, (str, bytes)):
                raise TypeError
            if hasattr(x, "item"):
                try:
                    x = x.item()
                    continue
                except (ValueError, RuntimeError):  # a tensor/array with several elements: take the first
                    pass
            x = x[0]
        result = float(x)
    except (TypeError, IndexError, KeyError, ValueError):
        raise InvalidReward(
            f"{what} must be a number or a tensor/list whose first element is a number, got {value!r}"
        ) from None
    if not math.isfinite(result):
        raise InvalidReward(f"{what} must be finite, got {result}")
    return result


def image_part(image: Any) -> dict[str, Any]:
    """An `image_url` part of an image: a data or http(s) URL as is; a path, file:// URL, bytes, PIL image or
    `datasets` dict {"bytes", "path"} as a base64 data URL (labelled PNG; capture decodes by content)."""
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    if hasattr(image, "save"):  # a PIL image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        image = buffer.getvalue()
    if isinstance(image, str) and not image.startswith(("data:", "http://", "https://")):
        image = Path(image.removeprefix("file://")).read_bytes()
    url = image if isinstance(image, str) else "data:image/png;base64," + base64.b64encode(image).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def with_images(content: Any, images: list[Any] | None) -> Any:
    """Message content with `images` put before its text (content unchanged without images)."""
    if not images:
        return content
    return [
        *map(image_part, images),
        *([{"type": "text", "text": content}] if isinstance(content, str) else content),
    ]


def row_messages(row: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(messages, prompt) of a dataset row: `messages` (OpenAI chat) or a plain `prompt` string; the row's
    `images` go into its first user message as `image_url` parts."""
    if row.get("messages"):
        messages = [dict(m) for m in row["messages"]]
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError(
            f"a dataset row needs 'messages' (a list of chat messages) or 'prompt' (a string); "
            f"got keys {sorted(row)}"
        )
    first = next((m for m in messages if m.get("role") == "user"), None)
    if first is not None and row.get("images"):
        first["content"] = with_images(first.get("content") or "", row["images"])
    prompt = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    if isinstance(prompt, list):  # OpenAI content parts
        prompt = "".join(p.get("text", "") for p in prompt if isinstance(p, dict))
    return messages, prompt or ""


def _merge_params(
    params: SamplingParams, override: SamplingParams | Mapping[str, Any] | None
) -> SamplingParams:
    """Apply `Result.sampling_params` (a SamplingParams replaces, a dict overrides some fields)."""
    if override is None:
        return params
    if isinstance(override, SamplingParams):
        return override.copy()
    return SamplingParams.from_dict({**asdict(params), **override}).validate()


class Episode:
    """Accumulates what an episode returns into the trajectory."""

    def __init__(self, traj: Trajectory):
        self.traj = traj  # its reward: the sum of the episode's rewards

    def add(self, result: Any, what: str, turn: int = 0) -> Result:
        """`turn`: the model call that `result.turn_rewards` begins at."""
        if not isinstance(result, Result):
            raise InvalidReward(f"{what} must return molt.agents.Result, got {type(result).__name__}")
        for i, value in enumerate(result.turn_rewards or []):
            self.traj.turn_rewards[turn + i] = to_float(value, f"{what}: Result.turn_rewards[{i}]")
        if isinstance(result.reward, Mapping):  # one reward per role; the rollout's is their mean
            parts = {k: to_float(v, f"{what}: Result.reward[{k!r}]") for k, v in result.reward.items()}
            for role, value in parts.items():
                self.traj.rewards[role] = self.traj.rewards.get(role, 0.0) + value
            self.traj.reward += sum(parts.values()) / max(1, len(parts))
        else:
            self.traj.reward += to_float(result.reward, f"{what}: Result.reward")
        for key, value in (result.info or {}).items():
            with suppress(InvalidReward):  # info is for dashboards only: a non-numeric entry is dropped
                self.traj.info[key] = to_float(value, f"info[{key!r}]")
        if result.score is not None:
            self.traj.score = to_float(result.score, f"{what}: Result.score")
        self.traj.truncated = bool(result.truncated)
        return result


class SessionRunner(Runner):
    """Opens the session, runs `_episode` under the timeout, turns failures into statuses, closes the session."""

    timeout: float | None = None

    async def run(
        self,
        row: Mapping[str, Any],
        *,
        sessions: SessionProvider,
        rollout_id: str,
        group_id: str = "",
        sampling_params: SamplingParams | None = None,
    ) -> Trajectory:
        params = (sampling_params or SamplingParams()).copy()
        traj = Trajectory(rollout_id=rollout_id, group_id=group_id)
        session = await sessions.open_session(rollout_id, params)
        try:
            await self._guarded(self._episode(row, session, params, Episode(traj)), traj)
        finally:
            traj.segments = await session.close()
            traj.info.update({f"capture/{k}": float(v) for k, v in session.stats.items()})
        return traj

    async def _guarded(self, episode: Awaitable[None], traj: Trajectory) -> None:
        task = asyncio.ensure_future(episode)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            await asyncio.wait({task}, timeout=5.0)  # an agent that swallows the cancellation is left behind
            traj.status, traj.error = (
                RolloutStatus.TIMEOUT,
                f"the rollout ran past its timeout of {self.timeout}s",
            )
            return
        error = asyncio.CancelledError("the agent was cancelled") if task.cancelled() else task.exception()
        if error is not None:  # the controller prints the first of each kind (molt.runtime.pool)
            traj.traceback = "".join(traceback.format_exception(error))
        if isinstance(error, InvalidReward):
            traj.status, traj.error = RolloutStatus.INVALID_REWARD, str(error)
        elif error is not None:
            traj.status, traj.error = RolloutStatus.AGENT_ERROR, f"{type(error).__name__}: {error}"

    async def _episode(
        self, row: Mapping[str, Any], session: CaptureSession, params: SamplingParams, episode: Episode
    ) -> None:
        raise NotImplementedError


class ChatAgentRunner(SessionRunner):
    """Runs a `ChatAgent` class (a fresh instance per rollout) against its own capture session."""

    def __init__(self, agent_cls: Callable[[], Any], *, timeout: float | None = None):
        self.agent_cls = agent_cls
        self.timeout = timeout

    async def _episode(self, row, session, params, episode):
        messages, prompt = row_messages(row)
        ctx = ChatContext(
            messages=messages,
            tools=row.get("tools") or None,
            prompt=prompt,
            label=row.get("label"),
            images=row.get("images"),
            base_url=session.base_url,
            session_url=session.session_url,
            model_name=session.model_name,
            api_key=session.api_key,
            session_id=session.session_id,
            sampling_params=params.copy(),
            max_length=session.max_model_len,
        )
        episode.add(await self.agent_cls().run(ctx), f"{getattr(self.agent_cls, '__name__', 'agent')}.run")


class StepEnvRunner(SessionRunner):
    """Drives generation for an `Env` class (a fresh instance per episode); see the module docstring."""

    def __init__(
        self,
        env_cls: Callable[[], Any],
        *,
        max_turns: int = 16,
        max_episode_tokens: int | None = None,
        timeout: float | None = None,
        observation_role: str = "user",
    ):
        if observation_role not in ("user", "tool", "raw"):
            raise ValueError(f"observation_role must be 'user', 'tool' or 'raw', got {observation_role!r}")
        self.env_cls, self.max_turns, self.max_episode_tokens = env_cls, max_turns, max_episode_tokens
        self.timeout, self.observation_role = timeout, observation_role

    async def _episode(self, row, session, params, episode):
        env = self.env_cls()
        params = params.copy(seed=None)  # the session seeds each turn from the rollout's seed (molt.types)
        messages, prompt = row_messages(row)
        label, tools = row.get("label"), row.get("tools") or None
        state = await env.reset({"observation": prompt, "label": label, "images": row.get("images")})
        if isinstance(state, Mapping) and state.get("observation") not in (None, prompt):
            if messages[-1].get("role") == "user":
                messages = messages[:-1]
            messages.append({"role": "user", "content": str(state["observation"])})
        name = f"{getattr(self.env_cls, '__name__', 'env')}.step"
        used, turn, observation, images = 0, None, "", None
        for step in range(self.max_turns):
            turn_params = self._turn_params(params, used)
            if turn_params is None:  # token budget spent
                episode.traj.truncated = True
                return
            if turn is None:
                turn = await session.chat(messages, turn_params, tools)
            elif self.observation_role == "raw":
                turn = await session.extend(observation, turn_params)
            else:
                messages += [turn.message, self._observation_message(with_images(observation, images), turn)]
                turn = await session.chat(messages, turn_params, tools)
            used += len(turn.action_ids)
            result = episode.add(
                await env.step(
                    {
                        "observation_text": session.decode(turn.prompt_ids),
                        "action_text": session.decode(turn.action_ids),
                        "label": label,
                        "sampling_params": turn_params.copy(),
                    }
                ),
                name,
                step,
            )
            if result.terminated or result.truncated:
                return
            if len(turn.prompt_ids) + len(turn.action_ids) >= session.max_model_len:
                episode.traj.truncated = True  # the context is exhausted
                return
            params = _merge_params(params, result.sampling_params)
            observation, images = result.observation, result.images
        episode.traj.truncated = True  # turn limit

    def _turn_params(self, params: SamplingParams, used: int) -> SamplingParams | None:
        if self.max_episode_tokens is None:
            return params.copy()
        left = self.max_episode_tokens - used
        if left <= 0:
            return None
        return params.copy(max_tokens=left if params.max_tokens is None else min(params.max_tokens, left))

    def _observation_message(self, text: Any, turn: Turn) -> dict[str, Any]:
        if self.observation_role == "user":
            return {"role": "user", "content": text}
        calls = turn.message.get("tool_calls") or [{}]
        return {"role": "tool", "content": text, "tool_call_id": calls[0].get("id", "")}
