from ngramrl.bench.machine import cpu_model, machine_facts, machine_line


def test_the_cpu_model_is_read_from_cpuinfo_and_falls_back_where_there_is_none(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Example CPU @ 2.00GHz\n\n"
                       "processor\t: 1\nmodel name\t: Example CPU @ 2.00GHz\n")
    assert cpu_model(str(cpuinfo)) == "Example CPU @ 2.00GHz"
    fallback = cpu_model(str(tmp_path / "missing"))
    assert isinstance(fallback, str) and fallback != "Example CPU @ 2.00GHz"


def test_the_machine_facts_say_whether_the_native_core_or_the_python_reference_ran(monkeypatch):
    monkeypatch.setenv("NGRAMRL_NATIVE", "0")
    facts = machine_facts()
    assert facts["native_core"] is False
    assert 1 <= facts["usable_cpus"] <= facts["logical_cpus"]
    assert "Python reference core" in machine_line(facts)
    assert f"{facts['usable_cpus']} of {facts['logical_cpus']} logical CPUs usable" in machine_line(facts)


def test_the_machine_line_names_the_cpu_and_the_cores_the_process_may_use():
    facts = {"cpu": "Example CPU", "logical_cpus": 8, "usable_cpus": 3, "native_core": True, "python": "3.11.9",
             "platform": "Linux"}
    assert machine_line(facts) == "machine: Example CPU, 3 of 8 logical CPUs usable, native core, Python 3.11.9"
