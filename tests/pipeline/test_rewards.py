"""Rewards on real task data, including malformed model outputs."""

import json

import pytest

from ngramrl.data.workloads import bfcl_tasks, gsm_tasks, spider_tasks
from ngramrl.pipeline.rewards import bfcl_reward, extract_sql, gsm_reward, reward, spider_reward


def test_gsm_reward_reads_the_final_answer():
    task = gsm_tasks(3, seed=1)[0]
    gold = task.reference["answer"]
    assert gsm_reward(f"First 3 + 4 = 7.\nAnswer: {gold}", task.reference) == 1.0
    assert gsm_reward(f"so the total is {gold}", task.reference) == 1.0  # no 'Answer:' line: the last number
    assert gsm_reward(f"Answer: {gold}1", task.reference) == 0.0
    assert gsm_reward(f"Answer: {gold} ... wait, Answer: {float(gold) + 1}", task.reference) == 0.0
    for junk in ("", "I cannot solve this.", "Answer: ", "\x00\ufffd{"):
        assert gsm_reward(junk, task.reference) == 0.0
    assert gsm_reward("Answer: 1,250", {"answer": "1250"}) == 1.0


def test_bfcl_reward_checks_json_function_and_arguments():
    task = next(t for t in bfcl_tasks(20, seed=0) if t.reference["ground_truth"])
    (name, params), = task.reference["ground_truth"][0].items()
    arguments = {p: values[0] for p, values in params.items() if values and values[0] != ""}
    good = json.dumps({"name": name, "arguments": arguments})
    assert bfcl_reward(good, task.reference) == 1.0
    assert bfcl_reward(f"```json\n{good}\n```", task.reference) == 1.0
    wrong_args = {p: "definitely-not-allowed" for p in arguments} or {"unexpected": 1}
    assert bfcl_reward(json.dumps({"name": name, "arguments": wrong_args}), task.reference) == 0.4
    assert bfcl_reward(json.dumps({"name": "no_such_function", "arguments": arguments}), task.reference) == 0.1
    required = [p for p, values in params.items() if "" not in values]
    missing = {p: v for p, v in arguments.items() if p != required[0]}
    assert bfcl_reward(json.dumps({"name": name, "arguments": missing}), task.reference) == 0.4
    for junk in ("not json at all", "{\"name\": ", "[1, 2, 3]", json.dumps({"name": 5}), ""):
        assert bfcl_reward(junk, task.reference) == 0.0


def _rows(task):
    import sqlite3

    with sqlite3.connect(task.reference["db_path"]) as db:
        return db.execute(task.reference["gold_sql"]).fetchall()


def test_spider_reward_executes_both_queries(spider_dir):
    task = next(t for t in spider_tasks(spider_dir, 20, seed=0) if _rows(t))
    gold = task.reference["gold_sql"]
    assert spider_reward(gold, task.reference) == 1.0
    assert spider_reward(f"```sql\n{gold};\n```", task.reference) == 1.0
    assert spider_reward("SELECT 1 WHERE 0", task.reference) == 0.0  # runs, returns nothing: wrong
    assert spider_reward("SELECT 'not the answer'", task.reference) == 0.0
    for broken in ("SELEC name FROM nowhere", "SELECT * FROM no_such_table", "DROP TABLE x", "", "hello"):
        assert spider_reward(broken, task.reference) == 0.0
    assert extract_sql("Here you go: SELECT a FROM b; -- done") == "SELECT a FROM b"


def test_spider_reward_reads_whole_statements_and_a_broken_gold_query_scores_zero(tmp_path):
    import sqlite3

    db = str(tmp_path / "shop.sqlite")
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE item (name TEXT)")
        connection.executemany("INSERT INTO item VALUES (?)", [("a;b",), ("c",)])
    gold = {"db_path": db, "gold_sql": "SELECT name FROM item WHERE name = 'a;b'", "db_id": "shop"}
    # a ';' inside a string literal does not end the statement
    assert extract_sql("SELECT name FROM item WHERE name = 'a;b'; -- done") == gold["gold_sql"]
    assert spider_reward("```sql\nSELECT name FROM item WHERE name = 'a;b';\n```", gold) == 1.0
    # a gold query that does not run scores the sample 0 (the run goes on), whatever it says
    broken = {**gold, "gold_sql": "SELECT name FROM no_such_table"}
    assert spider_reward("SELECT name FROM item", broken) == 0.0


def test_spider_reward_never_writes(spider_dir):
    task = next(t for t in spider_tasks(spider_dir, 20, seed=3) if _rows(t))
    before = _rows(task)
    for statement in ("DELETE FROM sqlite_master", "UPDATE sqlite_master SET name = 'x'"):
        assert spider_reward(statement, task.reference) == 0.0
    assert _rows(task) == before and spider_reward(task.reference["gold_sql"], task.reference) == 1.0


def test_unknown_workload_is_an_error():
    with pytest.raises(ValueError, match="no reward for workload"):
        reward("poetry", "text", {})


def test_reasoning_gym_reward_uses_the_tasks_own_checker():
    pytest.importorskip("reasoning_gym")
    from ngramrl.data.workloads import reasoning_gym_tasks
    from ngramrl.pipeline.rewards import final_answer, reasoning_gym_reward

    settings = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    task = reasoning_gym_tasks("products", 4, seed=1, settings=settings)[0]
    gold = str(task.reference["entry"]["answer"])
    assert reasoning_gym_reward(f"Let me think.\nAnswer: {gold}", task.reference) == 1.0
    assert reasoning_gym_reward(f"3 * 3 = 9, so here it is {gold}.", task.reference) == 1.0  # the last number
    assert reasoning_gym_reward(f"Answer: {int(gold) + 1}", task.reference) < 1.0
    assert reasoning_gym_reward("", task.reference) == 0.0
    assert final_answer("Answer: 12\nAnswer: 13.") == "13"
    assert final_answer("a line\nthe last line") == "the last line"
