"""Prompt datasets through Hugging Face `datasets`: files of each kind, a saved dataset's split, mixing by
probability, max_samples, and errors that name the flag."""

import json

import datasets
import pytest

from molt.runtime.data import load_prompts

KEYS = {"input_key": "prompt", "label_key": "label", "tools_key": "tools"}
TOOL = {
    "type": "function",
    "function": {"name": "calc", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
}


def _rows(tag, n):
    return [{"prompt": [{"role": "user", "content": f"{tag} {i}"}], "label": f"{tag}{i}"} for i in range(n)]


def test_jsonl_rows_stay_exact_and_other_formats_go_through_datasets(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    first = {"prompt": "plain text", "label": 3, "tools": [TOOL]}
    jsonl.write_text(json.dumps(first) + '\n\n{"prompt": "x", "label": "y"}\n')
    rows = load_prompts(str(jsonl), **KEYS)
    assert rows[0] == {"prompt": "plain text", "label": 3, "tools": [TOOL]} and rows[1]["label"] == "y"
    data = datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "hi"}], "label": "1", "tools": [TOOL]},
            {"prompt": [{"role": "user", "content": "yo", "name": "u"}], "label": "2", "tools": None},
        ]
    )
    for path in (tmp_path / "b.parquet", tmp_path / "b.json"):
        getattr(data, "to_parquet" if path.suffix == ".parquet" else "to_json")(path)
        rows = load_prompts(str(path), **KEYS)
        # Arrow's null filling is undone: the first message gets no "name": None, the schema no nulls
        assert rows[0] == {"messages": [{"role": "user", "content": "hi"}], "label": "1", "tools": [TOOL]}
        assert (
            rows[1]["messages"] == [{"role": "user", "content": "yo", "name": "u"}]
            and rows[1]["tools"] is None
        )


def test_saved_dataset_split_max_samples_and_mixing(tmp_path):
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(_rows("a", 6)),
            "test": datasets.Dataset.from_list(_rows("t", 2)),
        }
    ).save_to_disk(tmp_path / "saved")
    assert [r["label"] for r in load_prompts(str(tmp_path / "saved"), split="test", **KEYS)] == ["t0", "t1"]
    assert len(load_prompts(str(tmp_path / "saved"), max_samples=4, **KEYS)) == 4
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows("b", 2)))
    spec = f"{tmp_path / 'saved'},{tmp_path / 'b.jsonl'}"
    mixed = load_prompts(spec, probs="0.5,0.5", **KEYS)
    labels = [r["label"] for r in mixed]
    # interleaved until both are exhausted: every row of each at least once, the short one repeated
    assert {f"a{i}" for i in range(6)} <= set(labels) and {"b0", "b1"} <= set(labels)
    assert mixed == load_prompts(spec, probs="0.5,0.5", **KEYS)  # seeded
    rare = [r["label"] for r in load_prompts(spec, probs="0.9,0.1", **KEYS)]
    share = lambda xs: sum(x.startswith("b") for x in xs) / len(xs)
    assert share(rare) < share(labels)


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("missing.jsonl", {}, "data.prompt_dataset: no such file: missing.jsonl"),
        ("missing.parquet", {}, "no such file"),
        ("no-such-org/no-such-dataset", {}, "data.prompt_dataset: cannot load 'no-such-org/no-such-dataset'"),
        ("{a}", {"input_key": "question"}, "no 'question' key \\(data.input_key\\)"),
        ("{a}", {"probs": "0.5,0.5"}, "data.prompt_probs"),
        ("{a}", {"what": "eval.dataset", "input_key": "q"}, "eval.dataset"),
    ],
)
def test_mistakes_name_the_key(tmp_path, spec, kwargs, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "a.jsonl").write_text('{"prompt": "p"}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_prompts(spec.format(a=tmp_path / "a.jsonl"), **{**KEYS, **kwargs})
