"""The synthetic-data teacher's wire format: requests and answers round-trip, and hostile input is
refused with a message naming what is wrong."""

from __future__ import annotations

import json

import pytest

from forge_experiments import teacher_protocol as tp


def test_requests_and_answers_round_trip() -> None:
    problem = tp.TeacherProblem("add_sub-0-3", "add_sub", "What is 2 + 3?", "5")
    assert tp.parse_request(tp.problems_request("add_sub", 4, 9)) == (
        "problems",
        {"topic": "add_sub", "count": 4, "seed": 9},
    )
    assert tp.parse_request(tp.solutions_request(problem, 2)) == (
        "solutions",
        {"problem": tp.TeacherProblem("add_sub-0-3", "add_sub", "What is 2 + 3?"), "seed": 2},
    )
    assert tp.parse_problems(tp.problems_answer([problem, problem]), 2) == [problem]  # one per id
    solution = tp.TeacherSolution("2 + 3 = <<2+3=5>>5.\n#### 5", "print(2 + 3)\n")
    assert tp.parse_solution(tp.solution_answer(solution)) == solution
    # What a chat model tends to write: a code fence, a number as the reference, no program.
    fenced = '```json\n{"problems": [{"id": "1", "topic": "t", "question": "q?", "reference": 7}]}\n```'
    assert tp.parse_problems(fenced, 1) == [tp.TeacherProblem("1", "t", "q?", "7")]
    assert tp.parse_solution('{"text": "#### 7"}') == tp.TeacherSolution("#### 7", None)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"problems": {}}', "problems must be a list"),
        ('{"problems": [1]}', "problems[0] must be an object"),
        ('{"problems": [{"id": "1", "topic": "t", "question": ""}]}', "problems[0].question must not be empty"),
        ('{"problems": [{"id": "1", "topic": "t", "question": "' + "x" * 5000 + '"}]}', "longer than 4000"),
        (json.dumps({"problems": [{"id": str(i), "topic": "t", "question": "q"} for i in range(3)]}), "3 problems for a request of 2"),
        ("[" * 150_000 + "]" * 150_000, "is longer than"),
        ("[" * 50_000, "not JSON"),
    ],
)  # fmt: skip
def test_malformed_problem_answers_are_refused(content: str, says: str) -> None:
    with pytest.raises(tp.MalformedAnswer, match=None) as caught:
        tp.parse_problems(content, 2)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"task": "problems", "topic": "t", "count": 0}', "count must be an integer in [1, 256]"),
        ('{"task": "problems", "topic": "t", "count": 1000}', "count must be an integer"),
        ('{"task": "problems", "topic": "t", "count": true}', "count must be an integer"),
        ('{"task": "problems", "topic": "t", "count": 1, "seed": -1}', "seed must be an integer"),
        ('{"task": "problems", "topic": "", "count": 1}', "topic must not be empty"),
        ('{"task": "solutions", "problem": "p"}', "problem must be an object"),
        ('{"task": "delete"}', "task must be 'problems' or 'solutions'"),
    ],
)
def test_bad_requests_are_refused(content: str, says: str) -> None:
    with pytest.raises(tp.BadRequest) as caught:
        tp.parse_request(content)
    assert says in str(caught.value)
