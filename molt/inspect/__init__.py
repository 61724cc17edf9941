"""The trajectory inspector (`molt inspect RUN_DIR`): a local web app over a run directory (`molt.inspect.app`)."""
