"""The `molt` command.

Each subcommand is one function registered with `@command(name, help, *arguments)`; a name with a space
("model fetch") nests under a command group. The top level is plain argparse because `molt --help` must
answer in well under a second: this module imports only the standard library and `molt.models` (itself
stdlib-only at import time); torch, transformers, rich and the engines are imported inside the subcommand
functions. Subcommands with a large typed configuration (`train`, `sft`, `demo`) parse their own arguments with
`load_config`: a YAML recipe, then flags (the reference's rewritten by `molt.flags`), tyro over
`molt.config.MoltConfig`, `algo.plugins` imported, then `molt.config_validate.validate`.

Errors: a user mistake (`ValueError`, which includes `molt.engine.base.RequestError`) prints one line and exits
with status 2, like argparse's own usage errors; an engine failure (`EngineError`, not a ValueError) is no user
mistake: it ends with its traceback (status 1), as any other bug does; a failed download/conversion exits with status 1; a training run
stopped by a signal exits with 128 + its number, after a checkpoint (`molt.runtime.loop`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from molt.models import DEFAULT_MODEL, ModelFetchError, resolve_model
from molt.runtime.pool import RunStopped  # standard library and molt.types only

Handler = Callable[[argparse.Namespace], "int | None"]
# name -> (help, arguments, handler, raw: the command parses its own arguments (tyro), argparse hands it the rest)
_COMMANDS: dict[str, tuple[str, tuple, Handler, bool]] = {}


def arg(*flags: str, **kwargs) -> tuple:
    """One `add_argument` call, written next to the command that uses it."""
    return flags, kwargs


def command(name: str, help: str, *arguments: tuple, raw: bool = False) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        _COMMANDS[name] = (help, arguments, fn, raw)
        return fn

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="molt",
        description="Molt: fully asynchronous agentic RL of language models.",
    )
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (help_text, arguments, fn, raw) in _COMMANDS.items():
        *group, leaf = name.split()
        subs = top
        if group:  # e.g. "model fetch": one `molt model` parser holding the leaf commands
            if group[0] not in groups:
                g = top.add_parser(group[0], help=f"{group[0]} commands")
                groups[group[0]] = g.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
            subs = groups[group[0]]
        p = subs.add_parser(leaf, help=help_text, description=help_text, add_help=not raw)
        for flags, kwargs in arguments:
            p.add_argument(*flags, **kwargs)
        p.set_defaults(handler=fn, raw=raw)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.raw:
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # Quiet transformers' per-load progress bars and warnings: our own output is the point. Environment
    # variables (read when transformers is first imported) keep this free for `--help`; users may override.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return args.handler(args) or 0
    except (
        ValueError,
        ModelFetchError,
    ) as e:  # user mistakes (2), failed fetches (1): one clear line, no traceback
        print(f"molt: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ModelFetchError) else 2
    except (
        RunStopped
    ) as e:  # a signal or a fatal condition of `train`/`sft`, after a checkpoint: its exit code
        print(f"molt: {getattr(e, 'cause', e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------- helpers

_MODEL_ARG = arg(
    "--model",
    default=DEFAULT_MODEL,
    help=f"local checkpoint directory, alias or hub id (default: {DEFAULT_MODEL})",
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {text})")
    return value


def _render_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token IDs of `prompt`: a user turn of the chat template (with the assistant header), or raw text."""
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("the model has no chat template; pass --no-chat to send the prompt as raw text")
        # the template writes any BOS itself: the tokenizer adds no special tokens here
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
    return tokenizer.encode(prompt)


def _load(model_ref: str):
    """(checkpoint path, tokenizer) for a model reference; a bad reference fails before the heavy imports."""
    path = resolve_model(model_ref)
    from transformers import AutoTokenizer

    return path, AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------------- commands


def load_config(
    argv: list[str] | None = None, *, check_files: bool = True, prog: str = "molt train", sft: bool = False
) -> Any:
    """`[--config recipe.yaml] [--group.field value ...]` -> validated MoltConfig (the reference's flags rewritten
    by molt.flags); algo.plugins are imported first, so that their names validate."""
    import tyro
    import yaml

    from molt.algo import import_files
    from molt.config import MoltConfig
    from molt.config_resolve import from_dict, to_dict
    from molt.config_validate import validate
    from molt.flags import after_parse, dotted, translate

    argv = list(sys.argv[1:] if argv is None else argv)
    default = MoltConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ValueError("--config needs a YAML file")
        path = Path(argv[i + 1])
        if not path.is_file():
            raise ValueError(f"--config: no such file: {path}")
        default = from_dict(MoltConfig(), yaml.safe_load(path.read_text()) or {})
        del argv[i : i + 2]
    argv, engine_args, given = translate(argv, dotted(to_dict(default)))
    cfg = tyro.cli(
        MoltConfig,
        args=argv,
        default=default,
        use_underscores=True,
        prog=prog,
        description="Train a model on an agent's experience. Flags override the --config YAML recipe. "
        "Every flag of the reference's train_rl_ray is accepted too (molt.flags).",
    )
    cfg.vllm.engine_args = {**engine_args, **cfg.vllm.engine_args}
    after_parse(cfg.rollout.engine, given)
    import_files(cfg.algo.plugins, "algo.plugins")
    validate(cfg, check_files=check_files, sft=sft)
    if check_files:  # an entry named as a file must be one (a directory or a hub name is checked at load)
        from molt.runtime.data import BUILDERS

        for name, spec in (
            ("data.prompt_dataset", cfg.data.prompt_dataset),
            ("eval.dataset", cfg.eval.dataset),
        ):
            for entry in (e.strip() for e in spec.split(",")):
                if Path(entry).suffix in (".jsonl", *BUILDERS) and not Path(entry).is_file():
                    raise ValueError(f"{name}: no such file: {entry}")
        from molt.envs import env_specs, load_hub

        for spec, env_args in env_specs(cfg.env.id, cfg.env.args):  # a hub's package, id and arguments
            load_hub(spec, env_args)
    return cfg


@command(
    "model fetch",
    "resolve a model reference (an alias is fetched and converted once), print its path",
    arg("name", help="alias (e.g. smollm2-135m-instruct), local directory or hub id"),
)
def model_fetch(args: argparse.Namespace) -> None:
    print(resolve_model(args.name))


@command(
    "generate",
    "sample a completion of each prompt and print it with per-token log-probabilities, then the timing",
    _MODEL_ARG,
    arg(
        "--prompt",
        action="append",
        required=True,
        help="the user message (or raw text with --no-chat); repeated: the prompts are sent concurrently",
    ),
    arg("--max-tokens", type=_positive_int, default=64, help="max new tokens (default: 64)"),
    arg("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy (default: 1.0)"),
    arg("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1.0)"),
    arg("--seed", type=int, default=None, help="sampling seed for a reproducible completion"),
    arg(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="render the prompt as a user turn with the chat template (default: on)",
    ),
)
def generate(args: argparse.Namespace) -> None:
    import asyncio

    from molt.types import SamplingParams

    # Validate before loading anything, so that a typo costs no model load.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    ).validate()
    path, tokenizer = _load(args.model)
    prompts = [_render_prompt(tokenizer, p, args.chat) for p in args.prompt]
    from molt.engine.hf import HFEngine  # after the tokenizer: a bad reference fails before torch loads

    t0 = time.perf_counter()
    engine = HFEngine(str(path))
    t1 = time.perf_counter()

    async def run():  # concurrent, so that the engine batches them
        try:
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        finally:
            await engine.close()

    completions = asyncio.run(run())
    took = time.perf_counter() - t1
    for completion in completions:
        _print_completion(tokenizer, completion)
    n_tokens = sum(len(c.token_ids) for c in completions)
    print(
        f"{path}: engine loaded in {t1 - t0:.1f} s; {len(prompts)} concurrent requests, {n_tokens} "
        f"tokens in {took:.1f} s ({n_tokens / took:.1f} tokens/s)"
    )


def _print_completion(tokenizer, completion) -> None:
    import math

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    print(tokenizer.decode(completion.token_ids, skip_special_tokens=True))  # verbatim: no wrap, no markup
    table = Table(
        title=f"{len(completion.token_ids)} tokens, finish: {completion.finish_reason.value}, "
        f"sum logprob {sum(completion.logprobs):.3f}"
    )
    for col in ("#", "id", "token", "logprob", "prob", "version"):
        table.add_column(col, justify="left" if col == "token" else "right")
    for i, (tid, lp, v) in enumerate(zip(completion.token_ids, completion.logprobs, completion.versions)):
        token = repr(tokenizer.decode([tid]))[1:-1]  # escapes make whitespace and newlines visible
        table.add_row(str(i), str(tid), Text(token), f"{lp:.4f}", f"{math.exp(lp):.3f}", str(v))
    Console().print(table)


@command(
    "train",
    "train a model on an agent's experience: [--config RECIPE.yaml] [--group.field VALUE ...] "
    "(`molt train --help` lists every field)",
    raw=True,
)
def train(args: argparse.Namespace) -> None:
    _train_and_report(load_config(args.rest))


@command(
    "sft",
    "supervised fine-tuning on chats (assistant tokens only) with the RL trainer: [--config RECIPE.yaml] "
    "[--group.field VALUE ...] (molt.runtime.sft)",
    raw=True,
)
def sft(args: argparse.Namespace) -> None:
    from molt.runtime.plot import plot_run
    from molt.runtime.sft import run_sft

    cfg = load_config(args.rest, prog="molt sft", sft=True)
    print(f"{run_sft(cfg)}\ncurves: {plot_run(cfg.ckpt.output_dir)}")


RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@command(
    "demo",
    "the main job on the embedded default: SmolLM2-135M-Instruct learns arithmetic with GRPO on "
    "this machine (recipes/math; `--agent`: a multi-turn tool-using agent learns to call its calculator, "
    "recipes/calculator; extra flags override the recipe, e.g. --train.seed 1)",
    raw=True,
)
def demo(args: argparse.Namespace) -> None:
    agent = "--agent" in args.rest
    args.rest = [a for a in args.rest if a != "--agent"]
    recipe = RECIPES / ("calculator" if agent else "math") / "recipe.yaml"
    if not recipe.is_file():
        raise ValueError(f"the demo recipe {recipe} is missing: run `molt demo` from a source checkout")
    os.chdir(RECIPES.parent)  # the recipe's paths are relative to the checkout
    _train_and_report(load_config(["--config", str(recipe), *args.rest]))


def _train_and_report(cfg) -> dict:
    """Run training, draw the curves, print the summary table; returns the summary."""
    import asyncio

    from rich.console import Console
    from rich.table import Table

    from molt.runtime.loop import run_training
    from molt.runtime.plot import plot_run

    summary = asyncio.run(run_training(cfg))
    png = plot_run(cfg.ckpt.output_dir)
    table = Table(title=f"molt run {cfg.ckpt.output_dir}")
    cols = {
        "base eval accuracy": summary["base_eval_accuracy"],
        "final eval accuracy": summary["final_eval_accuracy"],
    }
    if summary["evals"] and "agent/tool_call_valid" in summary["evals"][0]:  # an agent with tools
        cols.update(
            {
                "base valid calls": summary["evals"][0]["agent/tool_call_valid"],
                "final valid calls": summary["evals"][-1].get("agent/tool_call_valid"),
            }
        )
    cols.update({k.replace("_", " "): summary[k] for k in ("steps", "generated_tokens", "seconds")})
    for col in cols:
        table.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    table.add_row(*map(fmt, cols.values()))
    Console().print(table)
    print(f"summary: {Path(cfg.ckpt.output_dir) / 'summary.json'}; curves: {png}")
    return summary


@command(
    "serve",
    "serve a model through the capture server (OpenAI and Anthropic wires, captured segments)",
    _MODEL_ARG,
    arg(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="embedded transformers engine, or vLLM where installed (default: hf)",
    ),
    arg("--host", default="127.0.0.1", help="address to bind (default: loopback only)"),
    arg("--port", type=int, default=8000, help="port to listen on (0: any free port)"),
    arg(
        "--strict-model",
        action="store_true",
        help="answer a request naming another model than the served one with 400 (default: serve any name)",
    ),
    arg(
        "--prefix-cache-mb",
        type=int,
        default=None,
        help="prefix cache of the engine in MB, shared by every session, 0: off (default: the engine's, 1024)",
    ),
    arg(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default=None,
        help="the engine's dtype (auto: bf16 on a GPU and, embedded, on a CPU that computes bf16 natively; "
        "default: the engine's, float32 embedded, vLLM's own auto)",
    ),
    arg(
        "--allow-remote-images",
        action="store_true",
        help="fetch the http(s) image URLs clients send (default: refuse them with 400)",
    ),
    arg("--max-request-mb", type=float, default=32, help="refuse request bodies over this size with 413"),
    arg(
        "--max-chars-per-token",
        type=float,
        default=16,
        help="refuse, before tokenizing, a conversation of more characters than this many per token of the "
        "context window (400; 0: off)",
    ),
    arg(
        "--tool-parser",
        default="auto",
        help="tool-call format: auto (the model's own parser, else its chat "
        "template's format), hermes, qwen3_coder, llama3_json, mistral, mistral_v11, none",
    ),
)
def serve(args: argparse.Namespace) -> int:
    from molt.capture.serve import serve_main

    return serve_main(args)


@command(
    "doctor", "check whether the model's chat template keeps multi-turn capture in one segment", _MODEL_ARG
)
def doctor(args: argparse.Namespace) -> int:
    from molt.capture.doctor import doctor_main

    return doctor_main(args)


@command(
    "plot",
    "redraw the reward and accuracy curves of a run directory into RUN_DIR/curves.png",
    arg("run_dir", help="a run directory (holds metrics.jsonl)"),
)
def plot(args: argparse.Namespace) -> None:
    from molt.runtime.plot import plot_run

    print(plot_run(args.run_dir))


@command(
    "inspect",
    "browse a run directory's steps, groups and rollouts in a local web page, live while it trains",
    arg("run_dir", help="a run directory (ckpt.output_dir)"),
    arg("--host", default="127.0.0.1", help="address to bind (default: loopback only)"),
    arg("--port", type=int, default=8765, help="port to listen on (default: 8765)"),
)
def inspect_run(args: argparse.Namespace) -> None:
    from molt.inspect.app import serve

    serve(args.run_dir, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
