"""Serve one of NeMo Gym's shipped resources servers on 127.0.0.1 (run by the Python 3.12 venv that has
nemo-gym, `make nemo-gym`): `python nemo_gym_server.py NAME PORT`, e.g. mcqa. No model server: the agent
side is Molt's."""

import importlib
import sys
from unittest.mock import MagicMock

import uvicorn
from nemo_gym.server_utils import ServerClient

name, port = sys.argv[1], int(sys.argv[2])
app = importlib.import_module(f"resources_servers.{name}.app")
own = {k: v for k, v in vars(app).items() if getattr(v, "__module__", "") == app.__name__}
server_cls = next(v for k, v in own.items() if k.endswith("ResourcesServer"))
config_cls = next(v for k, v in own.items() if k.endswith("ResourcesServerConfig"))
config = config_cls(host="127.0.0.1", port=port, entrypoint="", name=name)
server = server_cls(config=config, server_client=MagicMock(spec=ServerClient))
uvicorn.run(server.setup_webserver(), host="127.0.0.1", port=port, log_level="warning")
