"""A verifiers environment module (the classic `load_environment` API) for the tests: single-digit sums, a
rubric of two weighted functions."""

import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 8, **_):
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(n)]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, **_):
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def short(completion, **_):
        return 1.0 if len(completion[-1]["content"]) < 40 else 0.0

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows[:2]),
        system_prompt="Answer inside <answer></answer>.",
        parser=parser,
        rubric=vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5], parser=parser),
    )
