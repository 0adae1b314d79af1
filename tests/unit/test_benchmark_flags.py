"""Every benchmark suite takes the shared flags of benchmarks/harness.py, with one type each.

Each suite's `main` is run only up to its `parse_args`: the parser it built is caught
there, so no suite trains, and no TensorFlow starts for it.
"""

import argparse

import pytest

from benchmarks import harness
from benchmarks import run as runner

SUITES = sorted(runner.SUITES)
BENCHMARKS = [
    "throughput",
    "scaleout",
    "compression",
    "time_to_accuracy",
    "evaluation",
]


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _parser(name, monkeypatch):
    """The argparse parser suite `name`'s `main` builds, caught at its `parse_args`."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parsed) as parsed:
        runner.suite_module(name).main([])
    return parsed.value.parser


def _options(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def test_every_suite_is_a_module_of_the_runner():
    assert set(BENCHMARKS) <= set(SUITES)
    for name in SUITES:
        assert callable(runner.suite_module(name).main), name


@pytest.mark.parametrize("name", SUITES)
def test_every_suite_takes_the_shared_flags_with_one_type(name, monkeypatch):
    options = _options(_parser(name, monkeypatch))
    assert options["--out"].type is None  # a folder, as given
    for flag, (kind, metavar, _) in harness.SWEEP_FLAGS.items():
        action = options.get("--" + flag.replace("_", "-"))
        if action is not None:
            assert (action.type, action.metavar) == (kind, metavar), (name, flag)
    # One name each: no singular or older spellings beside the shared ones.
    for other in ("--seed", "--step-ms", "--n_sync", "--nsyncs", "--device_ms"):
        assert other not in options, (name, other)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_sweeps_workers_and_names_its_output(name, monkeypatch):
    options = _options(_parser(name, monkeypatch))
    assert options["--workers"].type is harness.int_list
    assert options["--out"].default == runner.suite_module(name).OUT
    assert options["--out"].default.startswith("results/")


def test_shared_flag_types():
    assert harness.int_list("1,2,4") == [1, 2, 4]
    assert harness.float_list("0,20") == [0.0, 20.0]
    p = harness.parser("doc", out="o", workers=[2], seeds=[0, 1], device_ms=None)
    args = p.parse_args(["--workers", "4", "--seeds", "3,5", "--device-ms", "2.5"])
    assert (args.out, args.workers, args.seeds, args.device_ms) == ("o", [4], [3, 5], [2.5])
    assert harness.single(p, args, "workers") == 4
    with pytest.raises(SystemExit):
        harness.single(p, args, "seeds")  # two seeds where one is taken: a usage error


def test_the_runner_lists_the_suites_and_refuses_an_unknown_one(capsys):
    assert runner.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in runner.SUITES)
    assert runner.main(["no_such_suite"]) == 2
    assert "unknown suite 'no_such_suite'" in capsys.readouterr().err


def test_the_runner_finds_a_suites_output_folder():
    module = runner.suite_module("throughput")
    assert runner.out_folder(module, []) == "results/throughput"
    assert runner.out_folder(module, ["--workers", "4", "--out", "/tmp/x"]) == "/tmp/x"
    assert runner.out_folder(module, ["--out=/tmp/y"]) == "/tmp/y"
