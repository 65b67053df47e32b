"""Rewards for the three workloads, computed from the model's text and the task's reference.

- gsm: 1 if the last 'Answer: <number>' (or, failing that, the last number) equals the gold answer.
- bfcl: 0.1 for one valid JSON object of the form {"name", "arguments"}, 0.4 with the right
  function, 1.0 when every argument is one the benchmark allows and no required one is missing.
- spider: 1 if the predicted query's result on the SQLite database equals the gold query's
  (as a multiset of rows; in order when the gold query sorts), 0 if it differs or fails to run.
  Each gold query runs once (with a longer limit); one that does not run scores its prompt's
  samples 0, with a warning, and the run goes on.
- reasoning_gym: the task's own checker (``score_answer``) on the final answer: what follows the
  last 'Answer:', or without one the number the text ends with (numeric answers) or the last line.

Malformed outputs score 0 and never raise.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sqlite3
import time
from collections import Counter
from typing import Any

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
GOLD_SECONDS = 120.0  # a gold query runs once, its rows kept: it may take longer than a sample's
logger = logging.getLogger(__name__)


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


# 'Answer: 42', '**Answer:** 42', 'answer = $42'. One character class per run of filler, so that
# text with no number after 'answer' is given up in linear time (nested optional spaces made a
# long run of spaces take minutes).
_ANSWER = re.compile(r"answer[\s*]*(?:[:=][\s*]*)?(?:\$\s*)?(" + _NUMBER + ")", re.I)


def gsm_reward(text: str, reference: dict[str, Any]) -> float:
    gold = _to_number(str(reference["answer"]))
    answers = _ANSWER.findall(text)
    candidates = answers or re.findall(_NUMBER, text)
    if gold is None or not candidates:
        return 0.0
    predicted = _to_number(candidates[-1])
    return float(predicted is not None and abs(predicted - gold) <= 1e-6 * max(1.0, abs(gold)))


def _strip_fences(text: str) -> str:
    """The first fenced block's body (a language tag only where a line break follows it: in
    ```SELECT a FROM t``` the SELECT is the query's)."""
    fenced = re.search(r"```(?:[a-zA-Z]+\n)?(.*?)```", text, re.S)
    return (fenced.group(1) if fenced else text).strip()


def _parse_call(text: str) -> dict[str, Any] | None:
    body = _strip_fences(text)
    start = body.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(body[start:])
    except (ValueError, RecursionError):  # a degenerate output nests a thousand brackets deep
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": arguments}


def _same_value(given: Any, allowed: Any) -> bool:
    if isinstance(allowed, str) and isinstance(given, str):
        return given.strip().lower() == allowed.strip().lower()
    if isinstance(allowed, (int, float)) and isinstance(given, (int, float)) and not isinstance(given, bool):
        return abs(float(given) - float(allowed)) <= 1e-9
    if isinstance(allowed, list) and isinstance(given, list):
        return len(given) == len(allowed) and all(map(_same_value, given, allowed))
    if isinstance(allowed, dict) and isinstance(given, dict):
        # the benchmark's nested dict: each key's allowed values, "" where the key may be left out
        if set(given) - set(allowed):
            return False
        for key, options in allowed.items():
            options = options if isinstance(options, list) else [options]
            if key not in given:
                if "" not in options:
                    return False
            elif not any(_same_value(given[key], option) for option in options if option != ""):
                return False
        return True
    return given == allowed


def bfcl_reward(text: str, reference: dict[str, Any]) -> float:
    call = _parse_call(text)
    if call is None:
        return 0.0
    best = 0.1
    for option in reference.get("ground_truth", []):
        for name, parameters in option.items():
            if call["name"] != name:
                continue
            best = max(best, 0.4)
            arguments = call["arguments"]
            if set(arguments) - set(parameters):
                continue
            ok = True
            for parameter, allowed in parameters.items():
                if parameter not in arguments:
                    ok = "" in allowed  # "" marks an optional parameter
                elif not any(_same_value(arguments[parameter], value) for value in allowed if value != ""):
                    ok = False
                if not ok:
                    break
            if ok:
                return 1.0
    return best


def extract_sql(text: str) -> str:
    """The query in a reply: from its first SELECT or WITH to the end of that statement; empty
    where there is none (a reply that is no query scores 0, whatever the gold rows)."""
    body = _strip_fences(text)
    match = re.search(r"\b(SELECT|WITH)\b", body, re.I)
    if not match:
        return ""
    body = body[match.start():]
    if "\x00" in body:  # SQLite takes no NUL in a statement (and raises on one)
        return ""
    # The first statement: up to the first ';' at which SQLite sees one end (not one in a string).
    for end in (m.end() for m in re.finditer(";", body)):
        if sqlite3.complete_statement(body[:end]):
            return body[:end - 1].strip()
    return body.strip()


# What a scored query may do: read. VACUUM INTO and ATTACH write files even on a read-only connection.
_READING = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
MAX_VALUE_BYTES = 1 << 20  # a string or blob a query makes (randomblob(2e8) took 6.5 GB)


def _only_reading(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _READING else sqlite3.SQLITE_DENY


def _run_query(db_path: str, sql: str, max_seconds: float, max_rows: int | None = None) -> list[tuple] | None:
    """The query's rows; None where it fails, runs past ``max_seconds``, or returns more than
    ``max_rows`` (a scored query's rows beyond the gold's cannot match: they are not all read)."""
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    deadline = time.monotonic() + max_seconds
    connection.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    connection.set_authorizer(_only_reading)
    connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    try:
        cursor = connection.execute(sql)
        if max_rows is None:
            return cursor.fetchall()
        rows = cursor.fetchmany(max_rows + 1)
        return rows if len(rows) <= max_rows else None
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return None
    finally:
        connection.close()


@functools.lru_cache(maxsize=4096)
def _gold_rows(db_path: str, sql: str) -> list[tuple] | None:
    rows = _run_query(db_path, sql, GOLD_SECONDS)
    if rows is None:
        logger.warning("spider: the gold query on %s does not run within %.0f s, so its samples score 0: %r",
                       db_path, GOLD_SECONDS, sql)
    return rows


def spider_reward(text: str, reference: dict[str, Any], max_seconds: float = 5.0) -> float:
    sql = extract_sql(text)
    if not sql:
        return 0.0
    gold = _gold_rows(reference["db_path"], reference["gold_sql"])
    if gold is None:
        return 0.0
    predicted = _run_query(reference["db_path"], sql, max_seconds, max_rows=len(gold))
    if predicted is None:
        return 0.0
    if re.search(r"\border\s+by\b", reference["gold_sql"], re.I):
        return float(predicted == gold)
    return float(Counter(map(repr, predicted)) == Counter(map(repr, gold)))


def final_answer(text: str, numeric: bool = False) -> str:
    """What follows the last 'Answer:' (to the end of its line); without one, the number the text
    ends with when the answer is a number ('6 * 9 = 54', not the question restated, '1 * 5 ='),
    else the last non-empty line."""
    found = re.findall(r"[Aa]nswer[\s*]*[:=](.*)", text)
    if found:
        return found[-1].strip().strip("*$ ").rstrip(".")
    if numeric:
        stripped = text.rstrip(" \t\r\n.*$")
        numbers = list(re.finditer(_NUMBER, stripped))  # one pass (a search for a number at the end is quadratic)
        ends = numbers and numbers[-1].end() == len(stripped)
        return numbers[-1].group(0).replace(",", "").rstrip(".") if ends else ""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@functools.lru_cache(maxsize=64)
def _reasoning_gym_dataset(task: str, settings: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(settings))


def reasoning_gym_reward(text: str, reference: dict[str, Any]) -> float:
    """The reasoning-gym task's own checker on the final answer (1.0 when right)."""
    answer = final_answer(text, numeric=_to_number(str(reference["entry"]["answer"])) is not None)
    if not answer:
        return 0.0
    dataset = _reasoning_gym_dataset(reference["task"], json.dumps(reference.get("settings", {}), sort_keys=True))
    try:
        return float(dataset.score_answer(answer, reference["entry"]))
    except Exception:  # noqa: BLE001 - a checker that chokes on a malformed answer scores it 0
        return 0.0


REWARDS = {"gsm": gsm_reward, "bfcl": bfcl_reward, "spider": spider_reward, "reasoning_gym": reasoning_gym_reward}


def reward(workload: str, text: str, reference: dict[str, Any]) -> float:
    if workload not in REWARDS:
        raise ValueError(f"no reward for workload {workload!r}; known: {', '.join(REWARDS)}")
    return REWARDS[workload](text, reference)
