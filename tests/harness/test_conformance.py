"""Conformance with harnesses written by others, unchanged: each real package (CLIs from npm, libraries from
PyPI; `make harness` installs them, pinned) drives a multi-turn tool loop against a live capture server.

The model is a scripted policy (`policy`): it answers with the next scripted tool call while the conversation has
tools and fewer tool results than calls, then with a final text. A tiny random model emits no tool calls; the
subject here is the wire and the capture, with the real harness as the client. Each test checks that the harness
finished, that every request got a 2xx, and that every engine call of the session lies verbatim in a recorded
segment (its prompt as a prefix, its completion as action tokens), the tool loop in one segment. A harness whose
package is not installed is skipped with the reason. The rows go to the matrix printed at the end (conftest.py).
"""

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from matrix import ROWS

from molt.capture.render import ChatRenderer
from molt.capture.server import CaptureServer
from molt.testing.scripted import RecordingEngine, ScriptedEngine
from molt.types import token_lists

ROOT = Path(__file__).resolve().parents[2]
HARNESS_DIR = Path(os.environ.get("MOLT_HARNESS_DIR", ROOT / ".cache" / "harness"))
NPM_BIN = HARNESS_DIR / "npm" / "node_modules" / ".bin"
FINAL = "Done."
# CLI harnesses: no telemetry, updates or error reports (nothing but the capture server is reachable)
QUIET = {
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "NO_COLOR": "1",
}


def policy(tokenizer, calls):
    """The scripted model: the k-th tool call (a dict, or the text inside its block) while k tool results are in a
    prompt that offers tools."""

    def reply(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        k = text.count("<|im_start|>tool\n") + text.count(
            "Observation:\n"
        )  # smolagents: results in user turns
        if "# Tools" in text and k < len(calls):
            return (
                "<tool_call>\n"
                + (calls[k] if isinstance(calls[k], str) else json.dumps(calls[k]))
                + "\n</tool_call>"
            )
        return FINAL

    return reply


class Harness:
    def __init__(self, tokenizer, calls, roles=""):
        reply = (
            calls if callable(calls) else policy(tokenizer, calls)
        )  # a harness without tools brings its own
        self.engine = RecordingEngine(ScriptedEngine(tokenizer, reply, max_model_len=1 << 20))
        self.server = CaptureServer(self.engine, ChatRenderer(tokenizer), roles=roles)
        self.statuses: list[int] = []

        @self.server.app.middleware("http")
        async def record(request, call_next):
            response = await call_next(request)
            self.statuses.append(response.status_code)
            return response

    def check(self, name, version, segments, session, tool_results):
        """The assertions every harness shares; adds its row to the matrix."""
        records = self.engine.of_session(session.session_id)
        assert records and all(200 <= s < 300 for s in self.statuses), self.statuses
        lists = [token_lists(s.token_ids, s.action_mask, s.behavior_logprobs, s.versions) for s in segments]
        for prompt, completion in records:  # every engine call verbatim in a segment
            n, k = len(prompt), len(completion.token_ids)
            assert any(
                t["token_ids"][:n] == prompt
                and t["token_ids"][n : n + k] == completion.token_ids
                and t["action_mask"][n : n + k] == [1] * k
                and t["behavior_logprobs"][n : n + k] == np.float32(completion.logprobs).tolist()
                for t in lists
            ), "an engine call is missing from the segments"
        assert all(len(s.action_mask) == len(s.token_ids) for s in segments)
        assert sum(s.num_actions for s in segments) == sum(len(c.token_ids) for _, c in records)
        loop = max(segments, key=lambda s: len(s.token_ids))  # the tool loop: every result in one segment
        assert all(r in session.renderer.decode(loop.token_ids) for r in tool_results)
        ROWS.append(
            {
                "harness": name,
                "version": version,
                "turns": len(records),
                "status codes": " ".join(map(str, self.statuses)),
                "segments": ", ".join(f"{s.break_reason} ({len(s.token_ids)} tok)" for s in segments),
            }
        )


@contextlib.asynccontextmanager
async def serving(tokenizer, calls):
    harness = Harness(tokenizer, calls)
    await harness.server.start()
    try:
        yield harness, await harness.server.open_session()
    finally:
        await harness.server.stop()


def installed_bin(folder, name, how="npm"):
    path = folder / name
    if not path.exists():
        pytest.skip(
            f"{name} is not installed under {folder} (`make harness` installs it; {how} or the registry was "
            "not available)"
        )
    return str(path)


def npm_bin(name):
    return installed_bin(NPM_BIN, name)


def version_of(package, module=None):
    pytest.importorskip(
        module or package, reason=f"{package} is not installed (`pip install -e '.[harness]'`)"
    )
    return f"{package} {importlib.metadata.version(package)}"


async def run_cli(argv, env, cwd, ok=True):
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env={**os.environ, **QUIET, **env},
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    assert (proc.returncode == 0) == ok, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


async def test_claude_code_cli(tokenizer, tmp_path):
    """`claude -p` with its default model: system-role messages, thinking, cache_control, streaming."""
    claude = npm_bin("claude")
    calls = [
        {"name": "Bash", "arguments": {"command": "echo molt-ok > out.txt", "description": "write"}},
        {"name": "Bash", "arguments": {"command": "cat out.txt", "description": "read"}},
    ]
    async with serving(tokenizer, calls) as (h, session):
        version = (await run_cli([claude, "--version"], {}, tmp_path)).split()[0]
        out = await run_cli(
            [
                claude,
                "-p",
                "Write molt-ok to out.txt, then read it.",
                "--output-format",
                "json",
                "--allowedTools",
                "Bash",
            ],
            {
                "HOME": str(tmp_path),
                "ANTHROPIC_BASE_URL": session.session_url,
                "ANTHROPIC_API_KEY": session.api_key,
            },
            tmp_path,
        )
        segments = await session.close()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["result"] == FINAL and not result["is_error"] and result["num_turns"] == 3
    assert (tmp_path / "out.txt").read_text() == "molt-ok\n"
    h.check("Claude Code CLI", f"@anthropic-ai/claude-code {version}", segments, session, ["molt-ok"])


async def test_claude_code_subagent_is_its_own_role(tokenizer, tmp_path):
    """Claude Code's Task tool runs a subagent (another system prompt and tools) in the same session while the
    main conversation waits and then goes on: its calls are a segment of their own, role "subagent"."""
    claude = npm_bin("claude")

    def reply(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        if "cc_is_subagent=true" in text:
            return "sub-done"
        if "<|im_start|>tool\n" not in text:
            task = {"description": "helper", "prompt": "Say sub-done", "subagent_type": "general-purpose"}
            return "<tool_call>\n" + json.dumps({"name": "Task", "arguments": task}) + "\n</tool_call>"
        return FINAL

    harness = Harness(tokenizer, reply, roles="subagent")
    await harness.server.start()
    try:
        session = await harness.server.open_session()
        env = {
            "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": session.session_url,
            "ANTHROPIC_API_KEY": session.api_key,
        }
        argv = [claude, "-p", "Delegate to a helper.", "--output-format", "json", "--allowedTools", "Task"]
        out = await run_cli(argv, env, tmp_path)
        segments = await session.close()
    finally:
        await harness.server.stop()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["result"] == FINAL and result["subagent_stats"]["completed"] == 1
    roles = [(s.role, s.break_reason) for s in segments]
    assert roles.count(("subagent", "subagent")) == 1 and roles[0] == ("", "start"), roles
    (sub,) = [s for s in segments if s.role == "subagent"]
    assert "cc_is_subagent=true" in tokenizer.decode(sub.token_ids) and sub.num_actions > 0


def codex_env(session, tmp_path):
    """Codex's home with a `[model_providers.x]` entry for the session: it ignores OPENAI_BASE_URL."""
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model_provider = "molt"\n[model_providers.molt]\nname = "molt"\n'
        f'base_url = "{session.base_url}"\nenv_key = "MOLT_API_KEY"\n'
        'wire_api = "responses"\n'
    )
    return {"CODEX_HOME": str(home), "MOLT_API_KEY": session.api_key}


async def test_codex_cli(tokenizer, tmp_path):
    """`codex exec` on the Responses wire with a model of its catalog that takes function tools (its default model
    is refused, see the next test)."""
    codex = npm_bin("codex")
    calls = [
        {"name": "exec_command", "arguments": {"cmd": "echo molt-ok > out.txt"}},
        {"name": "exec_command", "arguments": {"cmd": "cat out.txt"}},
    ]
    async with serving(tokenizer, calls) as (h, session):
        env = codex_env(session, tmp_path)
        version = (await run_cli([codex, "--version"], env, tmp_path)).split()[-1]
        work = tmp_path / "work"
        work.mkdir()
        out = await run_cli(
            [
                codex,
                "exec",
                "-m",
                "gpt-5-codex",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "Write molt-ok to out.txt, then read it.",
            ],
            env,
            work,
        )
        segments = await session.close()
    assert out.rstrip().endswith(FINAL) and (work / "out.txt").read_text() == "molt-ok\n"
    h.check("Codex CLI", f"@openai/codex {version}", segments, session, ["molt-ok"])


async def test_codex_cli_default_model(tokenizer, tmp_path):
    """`codex exec` with its default model: its tools come in an `additional_tools` input item, among them `exec`,
    a custom tool whose input is JavaScript under a Lark grammar. Each reply is constrained by the reply grammar
    (text, or calls whose raw input matches the tool's grammar): the scripted `exec` calls are checked against the
    grammar each request carried, and their raw input renders back token-exact when Codex resends them."""
    from llguidance import LLMatcher
    from llguidance.hf import from_tokenizer

    codex = npm_bin("codex")
    calls = [
        f'{{"name": "exec", "arguments": const r = await tools.exec_command({{cmd: {cmd!r}}});\ntext(r);}}'
        for cmd in ("echo molt-ok > out.txt", "cat out.txt")
    ]
    scripted = policy(tokenizer, calls)
    replies = []

    def reply(prompt_ids, params):
        replies.append((scripted(prompt_ids, params), params.grammar))
        return replies[-1][0]

    async with serving(tokenizer, reply) as (h, session):
        env = codex_env(session, tmp_path)
        version = (await run_cli([codex, "--version"], env, tmp_path)).split()[-1]
        work = tmp_path / "work"
        work.mkdir()
        out = await run_cli(
            [
                codex,
                "exec",
                "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox",
                "Write molt-ok to out.txt, then read it.",
            ],
            env,
            work,
        )
        segments = await session.close()
    assert out.rstrip().endswith(FINAL) and (work / "out.txt").read_text() == "molt-ok\n"
    lltok = from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id)
    assert all(g is not None and "T0_SOURCE" in g for _, g in replies)  # exec's grammar, in every request's
    for text, grammar in replies:  # each scripted reply is one the grammar allows
        matcher = LLMatcher(lltok, grammar)
        assert (
            all(
                matcher.consume_token(t)
                for t in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            )
            and matcher.is_stopped()
        ), (text, matcher.get_error())
    assert sum("<tool_call>" in text for text, _ in replies) == 2
    h.check("Codex CLI (default model)", f"@openai/codex {version}", segments, session, ["molt-ok"])
    assert len(segments) == 1  # the raw inputs rendered back token-exact


CALC = [{"name": "add", "arguments": {"a": 12, "b": 30}}, {"name": "add", "arguments": {"a": 42, "b": 8}}]


@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
@pytest.mark.parametrize("streamed", [False, True])
async def test_openai_agents_sdk(tokenizer, model_class, streamed):
    version = version_of("openai-agents", "agents")
    import agents
    from openai import AsyncOpenAI

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agents.set_tracing_disabled(True)
    async with serving(tokenizer, CALC) as (h, session):
        api = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        model = getattr(agents, model_class)(model="gpt-4.1", openai_client=api)
        agent = agents.Agent(name="calc", instructions="Use the add tool.", tools=[add], model=model)
        if streamed:
            result = agents.Runner.run_streamed(agent, "What is 12 + 30 + 8?")
            async for _ in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "What is 12 + 30 + 8?")
        segments = await session.close()
    assert result.final_output == FINAL
    h.check(
        f"Agents SDK {model_class}{' streamed' if streamed else ''}", version, segments, session, ["42", "50"]
    )


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_langgraph_react_agent(tokenizer, wire):
    version = version_of("langgraph")
    pytest.importorskip("langchain_openai" if wire == "openai" else "langchain_anthropic")
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async with serving(tokenizer, CALC) as (h, session):
        if wire == "openai":
            from langchain_openai import ChatOpenAI

            llm = ChatOpenAI(
                model="gpt-4.1", base_url=session.base_url, api_key=session.api_key, max_retries=0
            )
        else:
            from langchain_anthropic import ChatAnthropic

            llm = ChatAnthropic(
                model="claude-sonnet-4-5",
                base_url=session.session_url,
                api_key=session.api_key,
                max_retries=0,
                max_tokens=64,
            )
        agent = create_react_agent(llm, [add])
        state = await agent.ainvoke({"messages": [("user", "What is 12 + 30 + 8?")]})
        segments = await session.close()
    assert state["messages"][-1].content == FINAL
    h.check(
        f"LangGraph create_react_agent + Chat{wire.title().replace('ai', 'AI')}",
        version,
        segments,
        session,
        ["42", "50"],
    )


async def test_smolagents_tool_calling_agent(tokenizer):
    version = version_of("smolagents")
    import smolagents

    @smolagents.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    final = [{"name": "final_answer", "arguments": {"answer": "50"}}]
    async with serving(tokenizer, CALC + final) as (h, session):
        model = smolagents.OpenAIServerModel("gpt-4.1", api_base=session.base_url, api_key=session.api_key)
        agent = smolagents.ToolCallingAgent(tools=[add], model=model, max_steps=4, verbosity_level=0)
        answer = await asyncio.to_thread(agent.run, "What is 12 + 30 + 8?")
        segments = await session.close()
    assert str(answer) == "50"
    h.check("smolagents ToolCallingAgent", version, segments, session, ["42", "50"])


async def test_mini_swe_agent(tokenizer, tmp_path, monkeypatch):
    """mini-swe-agent's `DefaultAgent` with the configuration its `mini` command uses (`mini.yaml`: the `bash` tool
    through litellm's chat completions), on a local environment; it ends when a command prints the submit line."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would fetch its price list at import
    for key, value in {
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "config"),
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
    }.items():  # a 4xx fails at once
        monkeypatch.setenv(key, value)
    version = version_of("mini-swe-agent", "minisweagent")
    import yaml
    from minisweagent import package_dir
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = yaml.safe_load((Path(package_dir) / "config" / "mini.yaml").read_text())
    calls = [
        {"name": "bash", "arguments": {"command": "echo molt-ok > out.txt"}},
        {"name": "bash", "arguments": {"command": "cat out.txt"}},
        {"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}},
    ]
    async with serving(tokenizer, calls) as (h, session):
        model = LitellmModel(
            model_name="openai/gpt-4.1",
            cost_tracking="ignore_errors",
            model_kwargs={
                **config["model"]["model_kwargs"],
                "api_base": session.base_url,
                "api_key": session.api_key,
                "num_retries": 0,
            },
        )
        agent = DefaultAgent(
            model, LocalEnvironment(**config["environment"], cwd=str(tmp_path)), **config["agent"]
        )
        result = await asyncio.to_thread(agent.run, "Write molt-ok to out.txt, then read it.")
        segments = await session.close()
    assert result["exit_status"] == "Submitted", result
    assert (tmp_path / "out.txt").read_text() == "molt-ok\n"
    h.check("mini-swe-agent DefaultAgent + LitellmModel", version, segments, session, ["molt-ok"])


def edit_block(search):
    """An aider SEARCH/REPLACE block (its `diff` edit format) that turns `search` into molt-ok in hello.txt."""
    return f"hello.txt\n```\n<<<<<<< SEARCH\n{search}\n=======\nmolt-ok\n>>>>>>> REPLACE\n```"


async def test_aider(tokenizer, tmp_path):
    """`aider --message` (its own virtual environment: it pins old versions of many packages) with the `diff` edit
    format, streamed chat completions and no `max_tokens`. The first edit's SEARCH text is not in the file, so
    aider sends the failure back and the second edit applies: two turns in one segment."""
    aider = installed_bin(HARNESS_DIR / "aider" / "bin", "aider", how="pip")
    (tmp_path / "hello.txt").write_text("hello\n")

    def reply(prompt_ids, params):
        failed = "failed to match" in tokenizer.decode(prompt_ids)
        return edit_block("hello" if failed else "goodbye")

    async with serving(tokenizer, reply) as (h, session):
        version = (await run_cli([aider, "--version"], {}, tmp_path)).split()[-1]
        out = await run_cli(
            [
                aider,
                "--model",
                "openai/gpt-4.1",
                "--openai-api-base",
                session.base_url,
                "--openai-api-key",
                session.api_key,
                "--edit-format",
                "diff",
                "--no-git",
                "--yes-always",
                "--no-check-update",
                "--analytics-disable",
                "--no-show-release-notes",
                "--no-pretty",
                "--no-auto-lint",
                "--no-show-model-warnings",
                "--message",
                "Change hello to molt-ok in hello.txt.",
                "hello.txt",
            ],
            {"HOME": str(tmp_path), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            tmp_path,
        )
        segments = await session.close()
    assert (tmp_path / "hello.txt").read_text() == "molt-ok\n", out[-2000:]
    assert len(h.engine.of_session(session.session_id)) == 2, out[-2000:]
    # aider sends no max_tokens: the reply may use the rest of the window (not a 256-token default)
    assert [c["params"].max_tokens for c in h.engine.inner.calls] == [None, None]
    h.check(
        "aider --message, diff edit format", f"aider-chat {version}", segments, session, ["failed to match"]
    )


async def test_openai_sdk_helpers(tokenizer):
    """`responses.stream` (function calls assembled from events) and `chat.completions.parse` (strict pydantic
    tools, parsed arguments)."""
    version = version_of("openai")
    import openai
    from pydantic import BaseModel

    class Add(BaseModel):
        a: int
        b: int

    async with serving(tokenizer, CALC) as (h, session):
        api = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        tools = [{"type": "function", "name": "add", "parameters": Add.model_json_schema()}]
        items = [{"role": "user", "content": "What is 12 + 30 + 8?"}]
        for result in ("42", "50", None):
            async with api.responses.stream(model="gpt-4.1", input=items, tools=tools) as events:
                final = await events.get_final_response()
            if result is None:
                break
            (call,) = [o for o in final.output if o.type == "function_call"]
            items += [
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": result},
            ]
        assert final.output_text == FINAL
        chat = await api.chat.completions.parse(
            model="gpt-4.1",
            tools=[openai.pydantic_function_tool(Add, name="add")],
            messages=[{"role": "user", "content": "What is 12 + 30?"}],
        )
        assert chat.choices[0].message.tool_calls[0].function.parsed_arguments == Add(a=12, b=30)
        segments = await session.close()
    h.check("openai SDK responses.stream, chat.completions.parse", version, segments, session, ["42", "50"])


async def test_anthropic_sdk_helpers(tokenizer):
    """`messages.stream` and the beta tool runner, whose later turns continue a `thread`."""
    version = version_of("anthropic")
    import anthropic

    @anthropic.beta_async_tool
    async def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    async with serving(tokenizer, CALC) as (h, session):
        api = anthropic.AsyncAnthropic(base_url=session.session_url, api_key=session.api_key, max_retries=0)
        async with api.messages.stream(
            model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "Say done."}]
        ) as events:
            assert (await events.get_final_text()) == FINAL
        runner = api.beta.messages.tool_runner(
            model="claude-sonnet-4-5",
            max_tokens=64,
            tools=[add],
            messages=[{"role": "user", "content": "What is 12 + 30 + 8?"}],
        )
        final = await runner.until_done()
        segments = await session.close()
    assert final.content[0].text == FINAL
    h.check(
        "anthropic SDK messages.stream, beta tool_runner (threads)", version, segments, session, ["42", "50"]
    )


def test_docs_table_names_the_pinned_versions():
    """docs/harnesses.md lists each harness tested here with the version `make harness` pins."""
    doc = (ROOT / "docs" / "harnesses.md").read_text()
    pins = (ROOT / "pyproject.toml").read_text() + (ROOT / "Makefile").read_text()
    rows = re.findall(r"^\| `([^`]+)` \| ([^ |]+) \|", doc, re.MULTILINE)
    assert rows, "no harness rows in docs/harnesses.md"
    for package, version in rows:
        assert f"{package}=={version}" in pins or f"{package}@{version}" in pins, (package, version)
    tests = set(re.findall(r"^(?:async )?def (test_\w+)", Path(__file__).read_text(), re.MULTILINE))
    for name in re.findall(r"`(test_\w+)`", doc):
        assert name in tests, f"docs/harnesses.md names {name}, which is not a test here"
