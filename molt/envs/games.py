"""The driver of the environments where Molt generates: a `Game` is one episode of a hub's environment behind
two calls, `reset() -> Move` and `step(text) -> Move`, and `GameRunner` plays it on the rollout's capture
session.

Decisions:
- A `Move` says what the next player sees: messages that continue its conversation (GEM, SkyRL-gym, OpenEnv
  append feedback), or that replace it (`replace=True`: TextArena's observation is the player's whole history,
  so each turn is a fresh chat and capture records it as its own segment).
- The action is the assistant message's content (special tokens and any reasoning split off), which is what a
  hub's parser expects; the recorded tokens are the exact ones sampled, as for every rollout.
- Rewards add up over the episode (per-step rewards: GEM, SkyRL-gym, OpenEnv; one final reward: the others).
  Numeric `info` entries become `rollout/info/<key>`, so the parts of a hub's reward are logged.
- Every seat of a multi-player game is played by the policy (self-play), each as a role of its own ("seat0",
  "seat1", ...) with its own reward and advantages (molt.runtime.loop); `--multiagent.train_roles seat0`
  trains one seat against the current policy.
- A hub's calls are synchronous (and some are slow: a game engine, a code checker), so they run in a thread,
  off the worker's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from molt.agents.runners import Episode, Result, SessionRunner


@dataclass
class Move:
    """What an environment answers: the next messages of `role`, the reward of the step, whether it ended."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | dict[str, float] = 0.0  # a dict: one per role (`Result.reward`)
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    role: str = ""  # the player who moves next, as a role ("" for a one-player game)
    replace: bool = False
    score: float | None = None  # what eval counts as correct when > 0 (None: the reward)


def user(text: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": str(text)}]


class Game:
    """One episode of an environment (a fresh instance per rollout)."""

    def reset(self) -> Move:
        raise NotImplementedError

    def step(self, text: str) -> Move:
        raise NotImplementedError

    def close(self) -> None:
        """Called once the episode ends, however it ends."""


class SingleTurn(Game):
    """A prompt and a scorer of the one reply (reasoning-gym); a reply is correct when it scores full marks."""

    def __init__(self, messages: list[dict[str, Any]], score: Callable[[str], float]):
        self.messages, self.score = messages, score

    def reset(self) -> Move:
        return Move(self.messages)

    def step(self, text: str) -> Move:
        reward = self.score(text)
        return Move(reward=reward, done=True, score=float(reward >= 1.0))


class GameRunner(SessionRunner):
    """Plays the `Game` that `make_game(row)` builds, one model turn a step, up to `max_turns` steps."""

    def __init__(self, make_game: Callable[[Mapping[str, Any]], Game], *, max_turns: int = 16, timeout=None):
        self.make_game, self.max_turns, self.timeout = make_game, max_turns, timeout

    async def _episode(self, row, session, params, episode: Episode):
        params = params.copy(seed=None)  # the session seeds each turn from the rollout's seed (molt.types)
        game = await asyncio.to_thread(self.make_game, row)
        try:
            move = await asyncio.to_thread(game.reset)
            chats: dict[str, list[dict[str, Any]]] = {}
            for _ in range(self.max_turns):
                role = move.role
                chats[role] = ([] if move.replace else chats.get(role, [])) + move.messages
                turn = await session.chat(chats[role], params.copy(), role=role)
                chats[role] = chats[role] + [turn.message]
                if len(turn.prompt_ids) + len(turn.action_ids) >= session.max_model_len:
                    break  # the context is exhausted
                move = await asyncio.to_thread(game.step, turn.message.get("content") or "")
                episode.add(Result(reward=move.reward, info=move.info, score=move.score), "the environment")
                if move.done:
                    return
            episode.traj.truncated = True
        finally:
            await asyncio.to_thread(game.close)
