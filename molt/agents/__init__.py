"""The public Molt agent contract. Agent files import from here and run unchanged.

Two ways to write an agent (see `reference-contract.md`):
- `ChatAgent.run(ctx) -> Result`: the agent drives its own loop through a stock OpenAI/Anthropic SDK pointed at
  `ctx.base_url` / `ctx.session_url`; the capture server records what the policy generated.
- `Env.step(state) -> Result`: the framework generates; `StepEnvRunner` calls `reset`/`step`.
An agent file defines `AgentRunner` (a `Runner` subclass built with no arguments); `load_agent(path)` loads it.

How the runtime runs one rollout:

    runner = load_agent(path)                       # once per worker
    traj = await runner.run(row, sessions=provider, rollout_id=..., group_id=..., sampling_params=params)

`row` is {"messages": [...] or "prompt": str, "label": ..., "tools": [...] | None, "images": ...};
`provider` satisfies `SessionProvider` (the capture server does): `open_session(rollout_id, params)` returns a
`CaptureSession` with the URLs and key the agent needs, an in-process `chat`/`extend` for Envs, and `close()`,
which returns the captured segments. `run` never raises for agent mistakes: failures come back as the
trajectory's `status` and `error`.

This package imports only `molt.types` of molt (and no torch, fastapi or ray).
"""

from molt.agents.contract import (
    CaptureSession,
    ChatAgent,
    ChatContext,
    Env,
    Result,
    Runner,
    SessionProvider,
    Turn,
)
from molt.agents.loader import load_agent
from molt.agents.runners import ChatAgentRunner, InvalidReward, StepEnvRunner, to_float
from molt.types import Trajectory
