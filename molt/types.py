"""Records that cross rooms: sampling parameters, engine completions, captured segments, trajectories, experiences.

Seeds: a run's seed gives each rollout its own (`sub_seed(train.seed, rollout_id)`, `molt.runtime.pool`), and a
rollout's seed gives each model call of the rollout its own: call k (0, 1, ... in the order the session serves
them, side requests included) samples with `sub_seed(rollout seed, k)`, so no call replays another's draws and
a seeded run is reproducible. A request that carries its own seed keeps it (OpenAI semantics: same seed, same
sample).

Design notes and decisions: docs/internals.md, section `molt/types.py`.
"""

from __future__ import annotations

import enum
import functools
import json
import sys
import zlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token (EOS or `stop_token_ids`) was sampled; it is included in the output
    LENGTH = "length"  # max_tokens or the context window was reached
    ABORT = "abort"  # the request was aborted


class RolloutStatus(str, enum.Enum):
    OK = "ok"
    AGENT_ERROR = "agent_error"  # the agent (or env) raised
    TIMEOUT = "timeout"  # the rollout ran past its time limit
    INVALID_REWARD = "invalid_reward"  # the agent returned no usable reward
    ABORTED = "aborted"
    ENGINE_RESTART = "engine_restart"  # its engine process died mid-rollout and was restarted
    WORKER_RESTART = "worker_restart"  # its rollout worker actor died mid-rollout and was replaced


@dataclass(slots=True)
class SamplingParams:
    """How to sample one completion. Also the `ctx.sampling_params` agents see (public contract fields:
    temperature, top_p, top_k, max_tokens, min_tokens)."""

    max_tokens: int | None = 256  # max new tokens; None = up to the context window
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = -1  # <= 0 disables
    # stop tokens are suppressed until this many were generated (unless a grammar allows only them)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides the model's EOS
    # per-request seed for reproducible sampling (a rollout's calls: module docstring)
    seed: int | None = None
    top_logprobs: int = 0  # also return this many most likely alternatives per position
    grammar: str | None = None  # the reply follows it (constrained decoding): llguidance's Lark, json_grammar
    adapter: str = ""  # the LoRA adapter to sample with: the role's (multiagent.adapters; capture sets it)

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the field on a bad value; return self."""
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (got {self.max_tokens})")
        # logits / T must stay finite
        if self.temperature is None or not (self.temperature == 0 or self.temperature >= 1e-30):
            raise ValueError(f"temperature must be 0 (greedy) or at least 1e-30 (got {self.temperature})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0 (got {self.min_tokens})")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20] (got {self.top_logprobs})")
        if self.grammar is not None:
            check_grammar(self.grammar)
        return self

    def copy(self, **changes: Any) -> SamplingParams:
        return replace(
            self, **{**changes, "stop_token_ids": list(changes.get("stop_token_ids", self.stop_token_ids))}
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_lark(schema: Any, style: dict[str, Any] | None = None) -> str:
    """The Lark expression (llguidance's `%json`) of JSON text valid against `schema`, without free whitespace
    (a sampled model could otherwise spend its tokens on spaces); `style`: llguidance's JSON options, compact by
    default (as vLLM's `disable_any_whitespace`), `JSON_STYLE` as a chat template's `tojson` writes it."""
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON schema object, not {type(schema).__name__}")  # noqa: TRY004
    return "%json" + json.dumps({**schema, "x-guidance": style or {"whitespace_flexible": False}})


def json_grammar(schema: Any) -> str:
    """The grammar (`SamplingParams.grammar`) of a reply that is JSON valid against `schema`; ValueError naming
    json_schema where llguidance cannot compile it."""
    return check_grammar(f"start: {json_lark(schema)}", "json_schema")


def check_grammar(grammar: str, name: str = "grammar") -> str:
    """`grammar`, once llguidance compiles it (ValueError naming `name` otherwise)."""
    error = _grammar_error(grammar)
    if error:
        raise ValueError(f"{name}: {error}")
    return grammar


@functools.lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str:
    """llguidance's verdict on `grammar`, kept: a request's grammar is checked where it is built (each tool's
    piece, then the whole) and again by the engine (`SamplingParams.validate`), and an agent sends the same tools
    every turn; a compile of a few dozen tools' schemas takes milliseconds, on the event loop."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def sub_seed(seed: int, key: Any) -> int:
    """A 31-bit seed derived from `seed` and `key` (a rollout id, a call index): deterministic across processes
    (unlike `hash`), so a seeded run is reproducible; see the module docstring."""
    return zlib.crc32(f"{seed}/{key}".encode()) & 0x7FFFFFFF


def import_file(path: Path, prefix: str, *, once: bool = False) -> Any:
    """Import the `.py` file at `path` (resolved) as module `{prefix}_{stem}_{hash of the path}` (two files may
    share a basename), kept in `sys.modules`, where dataclasses and pickling look a module up by name; `once`:
    a file this process imported before is not run again."""
    import importlib.util

    name = f"{prefix}_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if once and name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(slots=True)
class Completion:
    """What an engine returns for one request: one behavior log-probability and one policy version per
    generated token (see `molt.engine.base` for which distribution the log-probability is taken from)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    # top_logprobs[i] = [(token_id, logprob), ...] most likely first; None unless asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_tokens: int = 0
    # MoE: experts each router chose for prompt + generated tokens but the last (never run), [n, layers, k] ints
    routed_experts: Any = None


def per_token(record: Any) -> None:
    """`__post_init__` of Segment and Experience: their per-token fields as arrays, in place: int32 ids, a
    bool mask, float32 log-probs and int32 versions of the action tokens. Log-probs or versions given one per
    token (aligned with the ids) keep the action tokens' entries. None stays None (an offloaded experience)."""
    import numpy as np  # not at the top: `molt --help` and `import molt.agents` stay light

    if record.token_ids is not None:
        record.token_ids = np.asarray(record.token_ids, np.int32)
    mask = None if record.action_mask is None else np.asarray(record.action_mask, bool)
    record.action_mask = mask
    for name, dtype in (("behavior_logprobs", np.float32), ("versions", np.int32)):
        values = getattr(record, name)
        if values is None:
            continue
        values = np.asarray(values, dtype)
        if mask is not None and len(values) != mask.sum():
            if len(values) != len(mask):
                raise ValueError(
                    f"{name} has {len(values)} entries for {len(mask)} tokens, {mask.sum()} of them actions: "
                    "give one per action token (or one per token)"
                )
            values = values[mask]
        setattr(record, name, values)


@dataclass(slots=True)
class Segment:
    """One token-exact context of a rollout. Per-token data are numpy arrays (lists are converted on entry,
    `per_token`): `behavior_logprobs` and `versions` hold one entry per action token, in order."""

    token_ids: Any  # numpy [n] int32
    action_mask: Any  # numpy [n] bool, True on tokens the policy sampled
    behavior_logprobs: Any  # numpy [num_actions] float32 log-prob of each sampled token when it was sampled
    versions: Any  # numpy [num_actions] int32 policy version that sampled each action token
    # why this segment began: start, compaction, template_rewrite, tools_changed, ...
    break_reason: str = "start"
    temperature: float = 1.0  # temperature of its action tokens; capture seals the segment when it changes
    # MoE: numpy [len(token_ids), layers, k] expert ids (0 on the last token: never run)
    routed_experts: Any = None
    # processor inputs of its images in order ({"pixel_values": [n_images, ...], ...}) or None
    images: Any = None
    role: str = ""  # the agent that generated it (multiagent.roles; "" for a single agent)
    # (the rollout's model call 0, 1, ..., its action tokens here) for each turn recorded, in token order
    turns: list[tuple[int, int]] = field(default_factory=list)

    __post_init__ = per_token

    @property
    def num_actions(self) -> int:
        return int(self.action_mask.sum())


def expand_actions(values: Any, mask: Any, fill: float) -> Any:
    """Values of the action tokens laid out one per token, `fill` on context tokens: [num_actions] -> [n]."""
    import numpy as np

    values, mask = np.asarray(values), np.asarray(mask, bool)
    out = np.full(len(mask), fill, values.dtype)
    out[mask] = values
    return out


def token_lists(ids: Any, mask: Any, logprobs: Any, versions: Any) -> dict[str, list]:
    """The per-token arrays as JSON lists, one entry per token (the layout of `molt serve`'s trajectory and of
    the dumps): a 0/1 mask, log-prob 0.0 and version -1 on context tokens."""
    return {
        "token_ids": ids.tolist(),
        "action_mask": mask.astype("uint8").tolist(),
        "behavior_logprobs": expand_actions(logprobs, mask, 0.0).tolist(),
        "versions": expand_actions(versions, mask, -1).tolist(),
    }


@dataclass(slots=True)
class Trajectory:
    """One rollout: one or more segments sharing `rollout_id` and the terminal reward."""

    rollout_id: str
    group_id: str
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0  # with rewards per role: their mean (what rollout-level metrics count)
    rewards: dict[str, float] = field(default_factory=dict)  # per role; a role not here gets `reward`
    turn_rewards: dict[int, float] = field(default_factory=dict)  # per model call (`Result.turn_rewards`)
    score: float | None = None  # for filtering and dashboards; falls back to reward
    info: dict[str, float] = field(default_factory=dict)
    status: RolloutStatus = RolloutStatus.OK
    error: str = ""  # human-readable reason when status is not OK
    traceback: str = ""  # the agent's exception as Python prints it, when it raised
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status is RolloutStatus.OK

    @property
    def effective_score(self) -> float:
        return self.reward if self.score is None else self.score

    def reward_of(self, role: str) -> float:
        """The reward of `role`'s segments: its own, else the rollout's (broadcast)."""
        return self.rewards.get(role, self.reward)


def join_inputs(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    """Processor inputs of several chunks of images as one (tensors with one entry per image along dim 0)."""
    parts = [p for p in parts if p]
    if len(parts) < 2:
        return parts[0] if parts else None
    import torch

    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# Heavy per-token fields of an Experience; they travel through the object store, never through queues.
PAYLOAD_FIELDS = (
    "token_ids",
    "action_mask",
    "behavior_logprobs",
    "versions",
    "advantages",
    "routed_experts",
    "images",
)


@dataclass(slots=True)
class Experience:
    """One segment ready for training. Light fields stay on the record; the payload (the fields in
    PAYLOAD_FIELDS) travels through the Ray object store (`split`, then `payload_ref`) until `reload()`."""

    rollout_id: str
    group_id: str
    segment_index: int
    reward: float
    num_tokens: int
    num_actions: int
    min_version: int  # oldest policy version among its action tokens
    temperature: float = 1.0
    # per-token data as in `Segment` (lists are converted on entry); None when offloaded
    token_ids: Any = None
    action_mask: Any = None
    behavior_logprobs: Any = None
    versions: Any = None
    # the rollout's advantage on every action token (a group estimator), or one per token (0 on context; a
    # float32 array); filled on the trainer rank, laid out per token in collation
    advantages: Any = None
    routed_experts: Any = None
    images: Any = None
    payload_ref: Any = None  # ray.ObjectRef of the payload dict while offloaded
    role: str = ""
    turns: list[tuple[int, int]] = field(default_factory=list)  # as in `Segment`

    __post_init__ = per_token

    @property
    def credit(self) -> tuple[str, str]:
        """What its advantage belongs to: its rollout and role (groups are per prompt and role)."""
        return self.rollout_id, self.role

    @property
    def turn_credits(self) -> list[tuple[str, str, int]]:
        """What the advantages of its turns belong to, in token order, where turns have their own."""
        return [(*self.credit, turn) for turn, _ in self.turns]

    def credited(self, advantages: dict[Any, float]) -> Any:
        """Its advantage from a group estimator's {credit: advantage}: its rollout's and role's, or, where the
        rollout's turns have their own (`credit_rows` with turn rewards), one per token, each action token its
        turn's and 0 on context tokens (the payload is needed)."""
        import numpy as np

        if self.credit in advantages:
            return advantages[self.credit]
        per_turn = [advantages[key] for key in self.turn_credits]
        actions = np.repeat(np.asarray(per_turn, np.float32), [n for _, n in self.turns])
        return expand_actions(actions, self.action_mask, 0.0)

    @classmethod
    def from_segment(cls, traj: Trajectory, index: int) -> Experience:
        seg = traj.segments[index]
        return cls(
            rollout_id=traj.rollout_id,
            group_id=traj.group_id,
            segment_index=index,
            reward=traj.reward_of(seg.role),
            num_tokens=len(seg.token_ids),
            num_actions=seg.num_actions,
            min_version=int(seg.versions.min()) if seg.num_actions else -1,
            temperature=seg.temperature,
            token_ids=seg.token_ids,
            action_mask=seg.action_mask,
            behavior_logprobs=seg.behavior_logprobs,
            versions=seg.versions,
            routed_experts=seg.routed_experts,
            images=seg.images,
            role=seg.role,
            turns=seg.turns,
        )

    @property
    def offloaded(self) -> bool:
        return self.payload_ref is not None

    def split(self) -> dict[str, Any]:
        """Take the payload out of the record (its fields become None)."""
        payload = {k: getattr(self, k) for k in PAYLOAD_FIELDS}
        for k in PAYLOAD_FIELDS:
            setattr(self, k, None)
        return payload

    def reload(self) -> Experience:
        """Fetch the payload back (from whichever node holds it)."""
        import ray

        assert self.offloaded, "experience is not offloaded"
        for k, v in ray.get(self.payload_ref).items():
            setattr(self, k, v)
        self.payload_ref = None
        return self
