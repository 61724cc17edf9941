"""`molt inspect RUN_DIR`: a local web page over a run directory, live while the run writes it.

Reads files under the run directory only (`metrics.jsonl`, `ledger.jsonl`, `dumps/step_N.jsonl` of
`molt.runtime.dump`, files a link names such as `config.yaml`); imports nothing of the runtime. The page is one
static file (`static/index.html`, vanilla JS, no build step) over these JSON routes:
    /api/run                      {"name", "steps": [one merged metrics line per step], "dumped": [N, ...]}
                                  (NaN and inf values as the strings "nan", "inf", "-inf")
    /api/steps/{N}                {"step", "groups": [{"group_id", "prompt", "rollouts": [summary, ...]}]}
    /api/steps/{N}/rollouts/{ID}  the rollout's light fields and "segments": [its dump lines in order]
    /api/prompts/{P}              [{"step", "group_id", "rollout_id", "reward"}] of every dumped rollout of prompt P
    /api/search?q=TEXT            [{"step", "group_id", "rollout_id", "segment", "snippet"}], newest steps first
    /api/file?path=REL            a file of the run directory
Decisions: a prompt is the ledger's prompt index (one dataset row in every epoch); a file is re-read when its
size or mtime changes, an unfinished last line (being written) skipped; older dumps open without the fields
they lack. Unknown step or rollout: 404; a path out of the run directory (`..`, absolute, a link): 403. No
authentication: loopback by default.
"""

from __future__ import annotations

import json
import math
from contextlib import suppress
from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles


@lru_cache(maxsize=64)
def _parse(path: str, mtime_ns: int, size: int) -> list[dict]:
    rows = []
    for line in Path(path).read_text(errors="replace").splitlines():
        with suppress(ValueError):  # the line the run is writing now
            rows.append(json.loads(line))
    return rows


def _jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file (cached until it changes; callers must not modify them); [] when absent."""
    if not path.is_file():
        return []
    st = path.stat()
    return _parse(str(path), st.st_mtime_ns, st.st_size)


def create_app(run_dir: str | Path) -> FastAPI:
    root = Path(run_dir).resolve()
    if not root.is_dir():
        raise ValueError(f"RUN_DIR {run_dir} is not a directory")
    app = FastAPI(title=f"molt inspect {root.name}")

    def dumped() -> list[int]:
        return sorted(int(p.stem[5:]) for p in (root / "dumps").glob("step_*.jsonl") if p.stem[5:].isdigit())

    def segments(step: int) -> list[dict]:
        path = root / "dumps" / f"step_{step}.jsonl"
        if not path.is_file():
            raise HTTPException(404, f"step {step} has no dump (dumped steps: {dumped()})")
        return _jsonl(path)

    def prompts() -> dict[str, int]:
        return {r["group_id"]: r["key"][1] for r in _jsonl(root / "ledger.jsonl")}

    @app.get("/api/run")
    def run() -> dict:
        steps: dict[int, dict] = {}
        for m in _jsonl(
            root / "metrics.jsonl"
        ):  # evaluation lines share their step's number; JSON has no NaN
            steps.setdefault(m["step"], {}).update(
                {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}
            )
        return {"name": root.name, "steps": list(steps.values()), "dumped": dumped()}

    @app.get("/api/steps/{step}")
    def step(step: int) -> dict:
        groups: dict[str, dict] = {}
        index = prompts()
        for s in segments(step):
            g = groups.setdefault(
                s["group_id"], {"group_id": s["group_id"], "prompt": index.get(s["group_id"]), "rollouts": {}}
            )
            r = g["rollouts"].setdefault(
                s["rollout_id"],
                {
                    "rollout_id": s["rollout_id"],
                    "reward": s["reward"],
                    "advantage": s.get("advantage"),
                    "segments": 0,
                    "action_tokens": 0,
                    "rejected": None,
                    "response": "",
                },
            )
            r["segments"] += 1
            r["action_tokens"] += sum(s["action_mask"])
            r["response"] += s["action_text"]
            if "is_weights" in s:  # action tokens the importance gate gave weight 0
                r["rejected"] = (r["rejected"] or 0) + sum(
                    m and w == 0 for m, w in zip(s["action_mask"], s["is_weights"])
                )
        return {
            "step": step,
            "groups": [{**g, "rollouts": list(g["rollouts"].values())} for g in groups.values()],
        }

    @app.get("/api/steps/{step}/rollouts/{rollout_id}")
    def rollout(step: int, rollout_id: str) -> dict:
        segs = sorted(
            (s for s in segments(step) if s["rollout_id"] == rollout_id), key=lambda s: s["segment"]
        )
        if not segs:
            raise HTTPException(404, f"no rollout {rollout_id!r} in step {step}")
        s = segs[0]
        return {
            "step": step,
            "rollout_id": rollout_id,
            "group_id": s["group_id"],
            "reward": s["reward"],
            "prompt": prompts().get(s["group_id"]),
            "advantage": s.get("advantage"),
            "segments": segs,
        }

    @app.get("/api/prompts/{prompt}")
    def prompt(prompt: int) -> list[dict]:
        groups = {g for g, p in prompts().items() if p == prompt}
        return [
            {"step": n, "group_id": s["group_id"], "rollout_id": s["rollout_id"], "reward": s["reward"]}
            for n in dumped()
            for s in segments(n)
            if s["group_id"] in groups and s["segment"] == 0
        ]

    @app.get("/api/search")
    def search(q: str = Query(min_length=1), limit: int = Query(100, ge=1, le=1000)) -> list[dict]:
        hits = []
        for n in reversed(dumped()):
            for s in segments(n):
                i = s["text"].lower().find(q.lower())
                if i >= 0:
                    hits.append(
                        {
                            "step": n,
                            "group_id": s["group_id"],
                            "rollout_id": s["rollout_id"],
                            "segment": s["segment"],
                            "snippet": s["text"][max(0, i - 60) : i + len(q) + 60],
                        }
                    )
                    if len(hits) == limit:
                        return hits
        return hits

    @app.get("/api/file")
    def file(path: str) -> FileResponse:
        try:
            target = (root / path).resolve()
        except (ValueError, OSError) as e:  # a NUL byte, a link loop
            raise HTTPException(400, f"bad path {path!r}: {e}") from None
        if not target.is_relative_to(root):
            raise HTTPException(403, f"{path!r} is outside the run directory")
        if not target.is_file():
            raise HTTPException(404, f"no file {path!r} in the run directory")
        return FileResponse(target)

    app.mount("/", StaticFiles(directory=Path(__file__).parent / "static", html=True))  # the page at /
    return app


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    import uvicorn

    app = create_app(run_dir)
    print(f"molt inspect: http://{host}:{port}/ (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
