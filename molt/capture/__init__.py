"""The capture room: an OpenAI- and Anthropic-compatible session server that records token-exact segments.

`CaptureServer(engine, ChatRenderer.from_pretrained(path))` is what a rollout worker runs; see `server.py`
(routes, errors), `session.py` (one rollout), `segments.py` (the continuation rule), `render.py` (chat
template), `tools.py` (tool-call parsers), and the two wires.
"""
