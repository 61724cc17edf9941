"""`molt serve` as a real process (sessions, trajectory, reward, clean stop on a signal) and `molt doctor`."""

import asyncio
import json
import os
import signal
import sys
from types import SimpleNamespace

import httpx
import pytest
from openai import AsyncOpenAI

from molt.capture.doctor import diagnose, doctor_main
from molt.capture.render import ChatRenderer
from molt.capture.serve import serve
from molt.testing.scripted import ScriptedEngine


async def test_serve_process(tiny_llama_dir, tokenizer):
    """The CLI entry point in its own process with the real engine; SIGTERM stops it with status 0."""
    code = (
        "import sys; from types import SimpleNamespace as N; from molt.capture.serve import serve_main; "
        "sys.exit(serve_main(N(model=sys.argv[1], host='127.0.0.1', port=0, dtype='bfloat16')))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        str(tiny_llama_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        assert "molt serve:" in line, line + (await proc.stderr.read()).decode()
        url = line.split(" on ")[1].split()[0]
        async with httpx.AsyncClient(base_url=url) as http:
            created = await http.post(
                "/sessions", json={"rollout_id": "dbg", "sampling_params": {"max_tokens": 6}}
            )
            session = created.json()
            assert set(session) == {"session_id", "base_url", "session_url", "api_key"}
            api = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
            reply = await api.chat.completions.create(
                model=tiny_llama_dir.name, messages=[{"role": "user", "content": "hi"}]
            )
            auth = {"Authorization": f"Bearer {session['api_key']}"}
            sid = session["session_id"]
            assert (
                await http.post(f"/s/{sid}/reward", json={"reward": 0.5}, headers=auth)
            ).status_code == 200
            assert (
                await http.post(f"/s/{sid}/reward", json={"reward": "x"}, headers=auth)
            ).status_code == 400
            assert (await http.get(f"/s/{sid}/trajectory")).status_code == 401
            got = (await http.get(f"/s/{sid}/trajectory", headers=auth)).json()
        (segment,) = got["segments"]
        assert got["reward"] == 0.5 and got["rollout_id"] == "dbg" and segment["break_reason"] == "start"
        assert sum(segment["action_mask"]) == reply.usage.completion_tokens <= 6
        assert segment["text"] == tokenizer.decode(segment["token_ids"])
        assert json.dumps(segment) and len(segment["versions"]) == len(segment["token_ids"])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()


async def test_serve_in_process_stops_on_sigint(tiny_llama_dir, tokenizer):
    lines = []
    task = asyncio.create_task(
        serve(
            str(tiny_llama_dir),
            port=0,
            engine=ScriptedEngine(tokenizer, ["hi"]),
            ready=lambda text, **_: lines.append(text),
            server_options={"strict_model": True},
        )
    )
    while not lines:
        await asyncio.sleep(0.01)
    url = lines[0].split(" on ")[1].split()[0]
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/sessions", content=b"")).status_code == 200  # an empty body is allowed
        bad = await http.post("/sessions", json={"sampling_params": {"temperature": -1}})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        session = (await http.post("/sessions")).json()  # --strict-model: only the served name
        chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
        r = await http.post(
            f"/s/{session['session_id']}/v1/chat/completions",
            json=chat,
            headers={"Authorization": f"Bearer {session['api_key']}"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.wait_for(task, 10)  # returns normally: no KeyboardInterrupt, the server is down
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient() as http:
            await http.get(f"{url}/health")


async def test_serve_refuses_a_prefix_cache_size_for_vllm(tiny_llama_dir):
    """vLLM sizes its prefix cache from its KV cache: a size given for it would be ignored, so it is refused
    (before vLLM is imported: this runs where vLLM is not installed)."""
    with pytest.raises(ValueError, match="--prefix-cache-mb"):
        await serve(str(tiny_llama_dir), port=0, engine_kind="vllm", engine_options={"prefix_cache_mb": 64})


def test_doctor(tokenizer, think_tokenizer, capsys, tiny_llama_dir):
    eos = [tokenizer.eos_token_id]
    assert all(f.ok for f in diagnose(ChatRenderer(tokenizer), eos))
    think = {f.check: f for f in diagnose(ChatRenderer(think_tokenizer), eos)}
    assert not think["reasoning blocks"].ok and "template_rewrite" in think["reasoning blocks"].detail
    assert think["tool calls"].ok and think["tools=[] vs no tools"].ok
    assert doctor_main(SimpleNamespace(model=str(tiny_llama_dir))) == 0
    assert "[ok] plain multi-turn: one segment" in capsys.readouterr().out


async def test_trajectory_shows_images_routes_versions_and_breaks(tiny_vlm_dir):
    """Everything a segment records comes back: images as the sha256 of their bytes, MoE routes, versions."""
    import base64
    import hashlib
    import io

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    class RoutedEngine(
        ScriptedEngine
    ):  # routes as an MoE engine records them: one row per prompt and action token
        async def generate(self, prompt_ids, params, session_id=None, request_id=None, **kw):
            kw.pop("images", None), kw.pop("sources", None)
            c = await super().generate(prompt_ids, params, session_id, request_id, **kw)
            c.routed_experts = np.full((len(prompt_ids) + len(c.token_ids), 2, 1), 3, np.int16)
            return c

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    lines = []
    engine = RoutedEngine(AutoTokenizer.from_pretrained(tiny_vlm_dir), ["hi"], version=4)
    task = asyncio.create_task(
        serve(str(tiny_vlm_dir), port=0, engine=engine, ready=lambda text, **_: lines.append(text))
    )
    while not lines:
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=lines[0].split(" on ")[1].split()[0]) as http:
        session = (await http.post("/sessions")).json()
        api = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        image = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
        await api.chat.completions.create(model="m", messages=[{"role": "user", "content": image}])
        await api.chat.completions.create(
            model="m", temperature=0.5, messages=[{"role": "user", "content": "Hi"}]
        )
        got = (
            await http.get(
                f"/s/{session['session_id']}/trajectory",
                headers={"Authorization": f"Bearer {session['api_key']}"},
            )
        ).json()
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.wait_for(task, 10)
    first, second = got["segments"]
    assert first["images"] == [hashlib.sha256(buf.getvalue()).hexdigest()] and second["images"] == []
    assert [s["break_reason"] for s in got["segments"]] == ["start", "sampling_changed"]
    assert np.array(first["routed_experts"]).shape == (len(first["token_ids"]), 2, 1)
    assert {v for v, m in zip(first["versions"], first["action_mask"]) if m} == {4}
