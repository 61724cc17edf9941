"""One adapter per hub: it checks the id and the arguments where they are given (the driver, at start-up), makes
the rows of the tasks the environment generates, and builds a rollout's `Game` (or, for verifiers, its runner).

Decisions:
- A row is one task: a generated entry (reasoning-gym), a seed (GEM, TextArena), a dataset row (SkyRL-gym,
  OpenEnv) or a row of the environment's own dataset (verifiers). Its label carries what a worker needs to
  replay the task, so a group is n rollouts of the same entry or seed.
- reasoning-gym replies are scored by the dataset's own `score_answer` on the answer, which is the caller's to
  extract: `answer` in env.args is "tag" (the last `<answer>` block, `reasoning_gym.utils.extract_answer`, the
  default), "reply" (the whole reply) or a regular expression whose last match is the answer (a small model
  never writes the tags). A reply is correct (eval) at full marks. The system prompt is one of
  `SYSTEM_PROMPTS` ("default" unless `system_prompt` in env.args names another, or is a prompt of its own).
- TextArena games start with the first player count (1 to 6) the game accepts unless `num_players` is given.
- SkyRL-gym's ground truth is the row's label: a dict with `reward_spec`/`reward_model` is its `extras`, any
  other value is the ground truth of both.
- OpenEnv by URL (`openenv:http://host:port`, a server's WebSocket session) or, without a server or docker, an
  installed environment class (`openenv:package.module:Class`) stepped in-process. The reply is the action: a
  JSON object as is, else the text of the action's one field (pydantic coerces it); an action the environment
  refuses ends the episode with reward 0 and `info.invalid_action` 1.
- verifiers' classic API (0.3.x, `load_environment`): the environment calls the model through an OpenAI client
  on the rollout's capture session; its rubric's weighted sum is the reward and each function's score a metric.
- NeMo Gym (Python 3.12) runs apart: a resources server by URL scores, with `/verify`, the reply Molt generates
  on the Responses wire to the row's `responses_create_params`.
"""

from __future__ import annotations

import importlib
import json
import re
import signal
import sys
import types
import typing
from pathlib import Path
from typing import Any
from unittest import mock

from molt.agents.runners import Result, SessionRunner
from molt.envs.games import Game, GameRunner, Move, SingleTurn, user


def known(spec: str, ids: Any) -> None:
    if spec.partition(":")[2] not in ids:
        listed = ", ".join(sorted(ids)[:24])
        raise ValueError(f"env.id {spec}: no such id; {len(ids)} there, among them {listed}")


def checked(spec: str, make: Any, *args: Any) -> Any:
    """`make(*args)`, its argument errors as one ValueError naming the environment."""
    try:
        return make(*args)
    except (TypeError, ValueError, KeyError, AssertionError) as e:
        raise ValueError(f"env.args of {spec}: {type(e).__name__}: {e}") from None


class Hub:
    module = ""  # what it imports
    package = ""  # the distribution that provides it

    def __init__(self, lib: Any, spec: str, args: dict[str, Any]):
        self.lib, self.spec, self.args = lib, spec, dict(args)
        self.name = spec.partition(":")[2]

    def rows(self, size: int, seed: int, eval: bool) -> list[dict[str, Any]] | None:
        """The tasks the environment brings (None: it plays the rows of data.prompt_dataset)."""
        return None

    def game(self, row: dict[str, Any]) -> Game:
        raise NotImplementedError

    def runner(self, max_turns: int, timeout: float | None) -> SessionRunner:
        return GameRunner(self.game, max_turns=max_turns, timeout=timeout)


def first_seed(seed: int, eval: bool) -> int:
    # held-out tasks far from the training ones: reasoning-gym seeds entry i with seed + i
    return seed + 1_000_003 * eval


class ReasoningGym(Hub):
    module, package = "reasoning_gym", "reasoning-gym"

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        prompt = self.args.pop("system_prompt", "default")
        self.system = lib.utils.SYSTEM_PROMPTS.get(prompt, prompt)
        self.answer = self.args.pop("answer", "tag")
        known(spec, lib.factory.DATASETS)
        self.scorer = checked(self.spec, self.make, 1, 0)

    def make(self, size: int, seed: int) -> Any:
        return self.lib.create_dataset(self.name, size=size, seed=seed, **self.args)

    def rows(self, size, seed, eval):
        return [
            {"messages": [{"role": "system", "content": self.system}, *user(e["question"])], "label": dict(e)}
            for e in self.make(size, first_seed(seed, eval))
        ]

    def extract(self, text: str) -> str | None:
        if self.answer == "tag":
            return self.lib.utils.extract_answer(text)
        if self.answer == "reply":
            return text.strip()
        found = re.findall(self.answer, text)
        return found[-1] if found else None

    def game(self, row):
        score = lambda text: self.scorer.score_answer(self.extract(text), row["label"])
        return SingleTurn(row["messages"], score)


class GymGame(Game):
    """A gymnasium-style text environment: reset(seed) -> (obs, info), step(text) -> a 5-tuple."""

    def __init__(self, env: Any, seed: int):
        self.env, self.seed = env, seed

    def reset(self):
        return Move(user(self.env.reset(seed=self.seed)[0]))

    def step(self, text):
        obs, reward, terminated, truncated, info = self.env.step(text)
        suffix = info.get("suffix") if isinstance(info, dict) else None  # GEM's cue for the next turn
        return Move(user(f"{obs}\n{suffix}" if suffix else obs), reward, terminated or truncated, info)


class SeededHub(Hub):
    """A hub whose `make(id)` builds an environment that `reset(seed=)` starts (GEM, TextArena): a task a seed."""

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        known(spec, importlib.import_module(f"{self.module}.envs.registration").ENV_REGISTRY)
        self.env = checked(self.spec, self.make)

    def make(self) -> Any:
        return self.lib.make(self.name, **self.args)

    def rows(self, size, seed, eval):
        first = first_seed(seed, eval)
        return [{"prompt": f"{self.spec} seed {s}", "label": {"seed": s}} for s in range(first, first + size)]


class Gem(SeededHub):
    module, package = "gem", "gem-llm"

    def game(self, row):
        return GymGame(self.make(), row["label"]["seed"])


class ArenaGame(Game):
    def __init__(self, env: Any, players: int, seed: int):
        self.env, self.players, self.seed = env, players, seed

    def reset(self):
        self.env.reset(num_players=self.players, seed=self.seed)
        return self.observe()

    def observe(self, done: bool = False) -> Move:
        seats = (lambda pid: f"seat{pid}") if self.players > 1 else (lambda pid: "")
        if not done:
            pid, text = self.env.get_observation()
            return Move(user(text), role=seats(pid), replace=True)
        rewards, info = self.env.close()
        invalid = {
            f"invalid_move/{seats(p) or 'seat0'}": float(bool(i.get("invalid_move"))) for p, i in info.items()
        }
        score = rewards[0]  # what eval counts: seat 0's win
        if self.players > 1:
            return Move(
                reward={seats(p): r for p, r in rewards.items()}, done=True, info=invalid, score=score
            )
        return Move(reward=score, done=True, info=invalid)

    def step(self, text):
        done, _ = self.env.step(text)
        return self.observe(done)


class TextArena(SeededHub):
    module, package = "textarena", "textarena"

    def __init__(self, lib, spec, args):
        players = args.get("num_players")
        super().__init__(lib, spec, {k: v for k, v in args.items() if k != "num_players"})
        for n in [players] if players else [1, 2, 3, 4, 6]:
            try:
                self.env.reset(num_players=n, seed=0)
                self.players = n
                break
            except (AssertionError, ValueError, TypeError) as e:
                error = e
        else:
            raise ValueError(f"env.args of {self.spec}: the game refuses num_players {n}: {error}")

    def game(self, row):
        return ArenaGame(self.make(), self.players, row["label"]["seed"])


class SkyGame(Game):
    def __init__(self, env: Any, messages: list[dict[str, Any]]):
        self.env, self.messages = env, messages

    def reset(self):
        return Move(list(self.env.init(self.messages)[0]))

    def step(self, text):
        out = self.env.step(text)
        return Move(list(out["observations"]), out["reward"], out["done"], out.get("metadata") or {})


class SkyRL(Hub):
    module, package = "skyrl_gym", "skyrl-gym"

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        known(spec, importlib.import_module("skyrl_gym.envs.registration").registry)

    def game(self, row):
        label = row.get("label")
        extras = label if isinstance(label, dict) and {"reward_spec", "reward_model"} & set(label) else None
        if extras is None:
            truth = label if isinstance(label, dict) and "ground_truth" in label else {"ground_truth": label}
            extras = {"reward_spec": truth, "reward_model": truth}
        env = checked(self.spec, lambda: self.lib.make(self.name, env_config=self.args, extras=extras))
        messages = row.get("messages") or user(row.get("prompt", ""))
        return SkyGame(env, messages)


class OpenEnvGame(Game):
    """An OpenEnv episode over `client` (reset/step of dicts), its observations as text."""

    def __init__(self, client: Any, field: str | None, seed: int | None):
        self.client, self.field, self.seed = client, field, seed

    def reset(self):
        return self.move(self.client.reset(seed=self.seed))

    def close(self):
        getattr(self.client, "close", lambda: None)()

    def step(self, text):
        action = text.strip()
        try:
            parsed = json.loads(action)
        except json.JSONDecodeError:
            parsed = None
        try:
            result = self.client.step(parsed if isinstance(parsed, dict) else {self.field: action})
        except Exception:  # noqa: BLE001 - the environment refuses the action (a validation or server error)
            return Move(done=True, info={"invalid_action": 1.0})
        return self.move(result)

    def move(self, result: Any) -> Move:
        obs = dict(result.observation)
        shown = {k: v for k, v in obs.items() if k not in ("done", "reward", "metadata")}
        (only,) = shown.values() if len(shown) == 1 else [None]
        text = only if isinstance(only, str) else json.dumps(shown, default=str)
        return Move(user(text), float(result.reward or 0.0), bool(result.done))


class Local:
    """An OpenEnv `Environment` class stepped in-process, behind the client's reset/step of dicts."""

    def __init__(self, env_cls: Any, args: dict[str, Any]):
        self.env, self.action = env_cls(**args), typing.get_type_hints(env_cls.step)["action"]

    def reset(self, seed):
        return self.result(self.env.reset(seed=seed))

    def step(self, action):
        return self.result(self.env.step(self.action(**action)))

    def result(self, obs: Any) -> Any:
        return types.SimpleNamespace(observation=obs.model_dump(), reward=obs.reward, done=obs.done)


class OpenEnv(Hub):
    module, package = "openenv", "openenv-core"

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        name = self.name
        if re.match(r"https?://", name):
            import httpx

            schema = checked(self.spec, lambda: httpx.get(f"{name}/schema", timeout=10).json()["action"])
            self.fields = [f for f in schema.get("properties", {}) if f != "metadata"]
            self.connect = lambda: lib.core.GenericEnvClient(base_url=name).sync()
        else:
            module, _, cls = name.partition(":")
            env_cls = getattr(checked(self.spec, importlib.import_module, module), cls, None)
            if not isinstance(env_cls, type):
                raise ValueError(f"env.id {spec}: MODULE:CLASS of an openenv Environment, or a URL")
            self.connect = lambda: Local(env_cls, self.args)
            action = checked(self.spec, self.connect).action
            self.fields = [f for f in action.model_fields if f != "metadata"]

    def game(self, row):
        client = self.connect()
        label = row.get("label")
        seed = label.get("seed") if isinstance(label, dict) else None
        return OpenEnvGame(client, self.fields[0] if len(self.fields) == 1 else None, seed)


class VerifiersRunner(SessionRunner):
    def __init__(self, hub: Verifiers, timeout: float | None):
        self.hub, self.timeout = hub, timeout

    async def _episode(self, row, session, params, episode):
        from openai import AsyncOpenAI

        openai = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        client = self.hub.lib.OpenAIChatCompletionsClient(openai)
        sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens}
        sampling = {k: v for k, v in sampling.items() if v is not None}
        out = await self.hub.env.run_rollout(row["label"], client, session.model_name, sampling)
        if out.get("error"):
            raise RuntimeError(f"the verifiers rollout failed: {out['error']}")
        episode.add(Result(reward=out["reward"], info=out.get("metrics") or {}), f"verifiers:{self.hub.name}")


class Verifiers(Hub):
    module, package = "verifiers", "verifiers==0.3.1"

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        if self.name.endswith(".py"):  # a module file: importable by its name, here and in every worker
            sys.path.insert(0, str(Path(self.name).resolve().parent))
            self.name = Path(self.name).stem
        if not hasattr(lib, "load_environment"):
            raise ValueError(
                "verifiers >= 0.4 dropped load_environment (the classic API): pip install verifiers==0.3.1"
            )
        # an Environment installs a SIGINT handler: it would replace Molt's (a checkpoint on a signal), and in
        # a rollout worker's thread it fails ("signal only works in main thread")
        with mock.patch.object(signal, "signal"):
            self.env = checked(self.spec, lambda: lib.load_environment(self.name, **self.args))

    def rows(self, size, seed, eval):
        data = self.env.get_eval_dataset() if eval else self.env.get_dataset()
        keys = ("prompt", "example_id", "answer", "info", "task")
        return [
            {"messages": r["prompt"], "label": {k: r[k] for k in keys if k in r}}
            for r in data.select(range(min(size, len(data))))
        ]

    def runner(self, max_turns, timeout):
        return VerifiersRunner(self, timeout)


class NemoRunner(SessionRunner):
    def __init__(self, hub: NemoGym, timeout: float | None):
        self.hub, self.timeout = hub, timeout

    async def _episode(self, row, session, params, episode):
        import httpx
        from openai import AsyncOpenAI

        openai = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        limits = {"max_output_tokens": params.max_tokens} if params.max_tokens else {}
        create = {**limits, **row["label"]["responses_create_params"], "model": session.model_name}
        response = await openai.responses.create(**create)
        body = {**row["label"], "response": response.model_dump(mode="json")}
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            reply = await client.post(f"{self.hub.name}/verify", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"NeMo Gym /verify answered {reply.status_code}: {reply.text[:300]}")
        verdict = reply.json()
        numbers = {k: v for k, v in verdict.items() if isinstance(v, (int, float)) and k != "reward"}
        episode.add(Result(reward=verdict["reward"], info=numbers), f"{self.hub.spec} /verify")


class NemoGym(Hub):
    """A NeMo Gym resources server by URL (it needs Python 3.12: it runs in a venv of its own, nothing of
    nemo_gym is imported here); its rows come from a JSONL of NeMo Gym's own (`env.args {"data": PATH}`)."""

    module, package = "httpx", "httpx"

    def __init__(self, lib, spec, args):
        super().__init__(lib, spec, args)
        if not re.match(r"https?://", self.name) or "data" not in self.args:
            raise ValueError(
                f'env.id {spec}: nemo_gym:URL of a resources server, with env.args {{"data": PATH}}'
            )

    def rows(self, size, seed, eval):
        path = self.args.get("eval_data" if eval else "data")
        if not path:
            return None
        data = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        return [{"messages": r["responses_create_params"]["input"], "label": r} for r in data[:size]]

    def runner(self, max_turns, timeout):
        return NemoRunner(self, timeout)


ADAPTERS = {
    "reasoning_gym": ReasoningGym,
    "gem": Gem,
    "textarena": TextArena,
    "skyrl_gym": SkyRL,
    "openenv": OpenEnv,
    "verifiers": Verifiers,
    "nemo_gym": NemoGym,
}
