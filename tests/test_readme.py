"""The README's Python example runs as written and does what it says."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def readme_example(section: str) -> str:
    text = open(README, encoding="utf-8").read()
    body = text[text.index(f"## {section}"):]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_python_example_drafts_for_a_new_prompt_and_learns_from_its_rollouts():
    eos = 2
    first = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, eos]   # repeats itself: its own output drafts
    steps = []

    def run(output):
        position = [0]

        def verify(draft):
            truth = output[position[0]:]
            accepted = 0
            while accepted < len(draft) and accepted < len(truth) - 1 and draft[accepted] == truth[accepted]:
                accepted += 1
            position[0] += accepted + 1
            steps[-1] += 1
            return accepted, truth[accepted]

        steps.append(0)
        namespace.update(verify=verify)
        exec(code, namespace)  # noqa: S102 - the README's own code
        return position[0]

    code = readme_example("Use it from Python")
    namespace = {"eos_id": eos, "prompt_ids": [1, 3, 5], "output_ids": [7, 8, eos]}
    assert run(first) == len(first)
    assert steps[0] < len(first)                         # a prompt never seen drafts from its own output
    history = namespace["history"]
    assert history.rollout_count("q17") == 2             # its rollout and the one added after
    sample = code[code.index("request ="):code.index("history.add_rollout")]  # the same history, a new sample
    code = sample.replace('"q17/sample0"', '"q17/sample1"')
    second = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, eos]
    assert run(second) == len(second) and steps[1] <= 3  # the first rollout drafts the second
