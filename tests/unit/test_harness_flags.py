"""Every tool in tools/ takes the shared flags of tools/harness.py, with one type each.

Each tool's `main` is run only up to its `parse_args`: the parser it built is caught
there, so no tool trains, and no TensorFlow starts for it.
"""

import argparse
import glob
import importlib
import os
import sys

import pytest

from helpers import ROOT

TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, TOOLS)

import harness  # noqa: E402 (tools/ goes on sys.path first)

SCRIPTS = sorted(
    os.path.basename(p)[: -len(".py")]
    for p in glob.glob(os.path.join(TOOLS, "*.py"))
    if os.path.basename(p) != "harness.py"
)
BENCHMARKS = ["bench", "scaleout", "compression", "time_to_accuracy", "straggler", "evaluation"]


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def _parser(name, monkeypatch):
    """The argparse parser `tools/NAME.py`'s `main` builds, caught at its `parse_args`."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parsed) as parsed:
        importlib.import_module(name).main([])
    return parsed.value.parser


def _options(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def test_the_benchmarks_are_scripts_on_the_harness():
    assert set(BENCHMARKS) <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_tool_takes_the_shared_flags_with_one_type(name, monkeypatch):
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
