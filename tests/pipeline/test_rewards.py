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


@pytest.mark.parametrize("text", ["Answer" + " " * 3000, "So the answer" + " " * 3000 + "is", "```" + " " * 16000,
                                  '{"name": "f", "arguments": {"a": ' + "[" * 3000, "SELECT 1\x00;",
                                  "1" * 6000 + " x"])
def test_degenerate_outputs_score_at_once_and_never_raise(text, tmp_path):
    """Outputs RL produces when it degenerates (runs of spaces, brackets thousands deep, a NUL
    token): each reward scores them in milliseconds (a run of spaces after 'answer' took minutes)
    and none raises (one exception stops the run)."""
    import sqlite3
    import time

    from ngramrl.pipeline.rewards import final_answer

    db = str(tmp_path / "one.sqlite")
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE t (a INTEGER)")
    begin = time.perf_counter()
    assert gsm_reward(text, {"answer": "5"}) == 0.0
    assert bfcl_reward(text, {"ground_truth": [{"f": {"a": [1]}}]}) in (0.0, 0.1, 0.4)
    assert spider_reward(text, {"db_path": db, "gold_sql": "SELECT a FROM t"}) in (0.0, 1.0)
    final_answer(text, numeric=True)
    assert time.perf_counter() - begin < 0.5


def test_answers_are_read_in_the_forms_models_write_them_and_not_from_a_restated_question():
    from ngramrl.pipeline.rewards import final_answer

    assert gsm_reward("**Answer:** 42\nThat is 6 boxes of 7 each.", {"answer": "42"}) == 1.0
    assert gsm_reward("ANSWER: 42\n(6 boxes)", {"answer": "42"}) == 1.0
    assert final_answer("1 * 5 =", numeric=True) == ""   # the question restated: no answer
    assert final_answer("6 * 9 = 54.", numeric=True) == "54"
    assert final_answer("**Answer:** 7\nok", numeric=True) == "7"


def test_bfcl_nested_arguments_are_checked_key_by_key_as_the_benchmark_allows():
    """The benchmark lists each key of a nested dict with its allowed values ("" where optional)."""
    reference = {"ground_truth": [{"area_of": {"shape": [{"width": [20], "height": [12, 12.0], "unit": ["", "m"]}],
                                               "round": ["", True]}}]}
    call = lambda arguments: json.dumps({"name": "area_of", "arguments": arguments})  # noqa: E731
    assert bfcl_reward(call({"shape": {"width": 20, "height": 12}}), reference) == 1.0
    assert bfcl_reward(call({"shape": {"width": 20, "height": 12, "unit": "m"}}), reference) == 1.0
    assert bfcl_reward(call({"shape": {"width": [20], "height": [12]}}), reference) == 0.4
    assert bfcl_reward(call({"shape": {"width": 20}}), reference) == 0.4            # height is required
    assert bfcl_reward(call({"shape": {"width": 20, "height": 12, "depth": 1}}), reference) == 0.4


def test_spider_scores_only_reading_queries_with_bounded_rows_and_values(tmp_path):
    """A scored query may only read: VACUUM INTO and ATTACH write files even on a read-only
    connection; a query's rows past the gold's are not read; a value past 1 MB is refused; a reply
    with no query (a comment) is no answer, even where the gold rows are empty."""
    import sqlite3

    db = str(tmp_path / "shop.sqlite")
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE item (name TEXT)")
        connection.executemany("INSERT INTO item VALUES (?)", [("a",), ("b",)])
    gold = {"db_path": db, "gold_sql": "SELECT name FROM item"}
    assert spider_reward(f"VACUUM INTO '{tmp_path / 'copy.sqlite'}'", gold) == 0.0
    assert spider_reward(f"ATTACH 'file:{tmp_path / 'new.sqlite'}?mode=rwc' AS e; SELECT name FROM item", gold) in \
        (0.0, 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shop.sqlite"]
    assert spider_reward("SELECT name FROM item, item AS again", gold) == 0.0  # 4 rows against 2
    assert spider_reward("SELECT randomblob(200000000) FROM item", gold) == 0.0
    assert spider_reward("SELECT name FROM item", gold) == 1.0
    empty = {"db_path": db, "gold_sql": "SELECT name FROM item WHERE 0"}
    assert spider_reward("-----", empty) == 0.0 and spider_reward("SELECT name FROM item WHERE 0", empty) == 1.0


def test_spider_dir_takes_a_home_relative_path_as_the_config_check_does(spider_dir, tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "spider").symlink_to(os.path.abspath(spider_dir))
    assert len(spider_tasks("~/spider", 2)) == 2
