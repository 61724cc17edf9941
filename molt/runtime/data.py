"""Prompt datasets: files, directories or hub names through Hugging Face `datasets`, mixed and cut like the
reference's `--data.prompt_dataset A,B --data.prompt_probs 0.7,0.3 --data.max_samples N`.

Design notes and decisions: docs/internals.md, section `molt/runtime/data.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BUILDERS = {".parquet": "parquet", ".json": "json", ".arrow": "arrow", ".csv": "csv"}


def _jsonl(path: Path, what: str) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{what}: {path}:{n}: not JSON ({e})") from None
    return rows


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    return [_drop_nulls(v) for v in value] if isinstance(value, list) else value


def load_source(entry: str, split: str, what: str, clean: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Raw rows of one dataset entry (see the module docstring). Arrow gives every row of a column the union of
    the keys its rows have, filled with None: those are dropped again in the `clean` columns (messages, tools),
    and only there (a label keeps what its dataset says)."""
    path = Path(entry)
    if path.suffix == ".jsonl" or (path.suffix in BUILDERS and not path.is_file()):
        if not path.is_file():
            raise ValueError(f"{what}: no such file: {entry}")
        return _jsonl(path, what)
    import datasets

    try:
        if path.is_file():
            builder = BUILDERS.get(path.suffix)
            if builder is None:
                raise ValueError(f"unknown file type {path.suffix!r} (known: .jsonl, {', '.join(BUILDERS)})")
            data = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
        elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            data = datasets.load_from_disk(str(path))
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        else:
            data = datasets.load_dataset(entry, split=split)
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:
        raise ValueError(f"{what}: cannot load {entry!r} (split {split!r}): {e}") from None
    return [{k: _drop_nulls(v) if k in clean else v for k, v in row.items()} for row in data]


def weights(probs: str, n: int, name: str, what: str) -> list[float] | None:
    """The mixing probabilities `probs` (comma-separated) of n entries, normalised (None: equal)."""
    if not probs:
        return None
    given = [float(p) for p in probs.split(",")]
    if len(given) != n or min(given) < 0 or sum(given) <= 0:
        raise ValueError(
            f"{name}: {n} non-negative probabilities needed for the entries of {what} (got {probs!r})"
        )
    return [w / sum(given) for w in given]


def mix(sources: list[list[dict[str, Any]]], probs: list[float] | None, seed: int) -> list[dict[str, Any]]:
    """Interleave row lists with `datasets.interleave_datasets` (on row indices, so rows stay plain dicts)."""
    if len(sources) == 1:
        return sources[0]
    import datasets

    index = [
        datasets.Dataset.from_dict({"s": [k] * len(rows), "i": list(range(len(rows)))})
        for k, rows in enumerate(sources)
    ]
    mixed = datasets.interleave_datasets(
        index, probabilities=probs, seed=seed, stopping_strategy="all_exhausted"
    )
    return [sources[s][i] for s, i in zip(mixed["s"], mixed["i"])]


def load_prompts(
    spec: str,
    *,
    input_key: str,
    label_key: str | None,
    tools_key: str | None,
    split: str = "train",
    probs: str = "",
    max_samples: int | None = None,
    seed: int = 42,
    what: str = "data.prompt_dataset",
    image_key: str | None = None,
    max_images: int = 0,
) -> list[dict[str, Any]]:
    """Runner rows {"messages" | "prompt", "label", "tools", "images"?} of `spec` (comma-separated entries)."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    sources = [load_source(e, split, what, clean=(input_key, tools_key)) for e in entries]
    for entry, rows in zip(entries, sources):
        if not rows:
            raise ValueError(f"{what}: {entry} has no rows")
        if input_key not in rows[0]:
            raise ValueError(
                f"{what}: {entry} has no {input_key!r} key (data.input_key); keys: {sorted(rows[0])}"
            )
    raw_rows = mix(sources, weights(probs, len(entries), "data.prompt_probs", what), seed)[:max_samples]
    out = []
    for n, raw in enumerate(raw_rows):
        prompt = raw.get(input_key)
        if prompt is None:
            raise ValueError(
                f"{what}: row {n} has no {input_key!r} value (data.input_key); keys: {sorted(raw)}"
            )
        row = {"messages": prompt} if isinstance(prompt, list) else {"prompt": str(prompt)}
        row.update(
            label=raw.get(label_key) if label_key else None, tools=raw.get(tools_key) if tools_key else None
        )
        images = raw.get(image_key) if image_key else None
        if images is not None:
            row["images"] = images if isinstance(images, list) else [images]
            if 0 < max_images < len(row["images"]):
                raise ValueError(
                    f"{what}: row {n} has {len(row['images'])} images, more than "
                    f"data.max_images_per_prompt={max_images}"
                )
        out.append(row)
    return out


def run_prompts(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's rows: `data.prompt_dataset`'s and `eval.dataset`'s (none without one), read with the `data` keys;
    with `env.id`, the tasks of its environments (molt.envs), mixed by `env.probs`."""
    d, e = cfg.data, cfg.env
    keys = {
        "input_key": d.input_key,
        "label_key": d.label_key,
        "tools_key": d.tools_key,
        "seed": cfg.train.seed,
        "image_key": d.image_key,
        "max_images": d.max_images_per_prompt,
    }
    rows = evals = []
    if d.prompt_dataset:
        rows = load_prompts(d.prompt_dataset, split=d.prompt_split, probs=d.prompt_probs, **keys)
    if cfg.eval.dataset:
        evals = load_prompts(cfg.eval.dataset, split=cfg.eval.split, what="eval.dataset", **keys)
    if e.id:
        from molt.envs import env_rows, env_specs, load_hub

        hubs, seed = [load_hub(*spec) for spec in env_specs(e.id, e.args)], cfg.train.seed  # each loaded once
        sources = env_rows(hubs, e.train_size, seed, False, rows)
        rows = mix(sources, weights(e.probs, len(hubs), "env.probs", "env.id"), seed)
        evals = [row for source in env_rows(hubs, e.eval_size, seed, True, evals) for row in source]
    return rows[: d.max_samples], evals
