"""The one entry point of the benchmarks: `python -m benchmarks.run SUITE [FLAGS]`.

Runs one suite's `main(FLAGS)`, then writes `run.json` (the command, the commit, the
start and end times, the exit status) beside the suite's tables in its `--out`.
`python -m benchmarks.run --list` names the suites; `SUITE --help` lists a suite's flags.

Example:
    python -m benchmarks.run throughput --workers 2 --processes separate
"""

import datetime
import importlib
import json
import os
import shlex
import subprocess
import sys

# Suite name: (module, what it answers). The first six are the benchmarks users run; the
# others are the studies behind a documented default or a paper's figure.
SUITES = {
    "throughput": ("throughput", "samples/s against plain Keras and stock PS"),
    "time_to_accuracy": ("time_to_accuracy", "wall time to plain Keras's held-out accuracy"),
    "scaleout": ("scaleout", "speed-up with 1 to 32 emulated GPU workers; push ceiling"),
    "faults": ("faults", "snapshots' cost, lost PS and workers, the seeded chaos suite"),
    "compression": ("compression", "compressed pushes and pulls on a limited network"),
    "evaluation": ("evaluation", "evaluate on the workers against on the chief"),
    "ceiling": ("ceiling", "the synchronous ceiling, in one process (an emulation)"),
    "gem_stability": ("gem_stability", "GEM against Downpour on a real cluster"),
    "simulator": ("simulator", "GEM's paper at 16 to 100 workers (NumPy)"),
    "experiments": ("experiments", "the GPU A-SGD paper's sweeps"),
    "epoch_barrier": ("epoch_barrier", "what waiting at an epoch's end costs and buys"),
}


def suite_module(name):
    """The module of suite `name` (`benchmarks.<module>`)."""
    return importlib.import_module("benchmarks." + SUITES[name][0])


def _commit():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def out_folder(module, flags):
    """The suite's output folder: `--out` if given, else its parser's default."""
    for i, flag in enumerate(flags):
        if flag == "--out" and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith("--out="):
            return flag.split("=", 1)[1]
    return getattr(module, "OUT", None)


def main(argv=None):
    """Runs `argv` (`SUITE FLAGS...`, default `sys.argv[1:]`); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nSuites:")
        for name, (_, what) in SUITES.items():
            print(f"  {name:18} {what}")
        return 0 if argv else 2
    name, flags = argv[0], argv[1:]
    if name not in SUITES:
        print(f"unknown suite {name!r}; suites: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    module = suite_module(name)
    started = datetime.datetime.now(datetime.timezone.utc)
    program, sys.argv[0] = sys.argv[0], f"python -m benchmarks.run {name}"  # --help's usage
    try:
        status = module.main(flags) or 0
    finally:
        sys.argv[0] = program
    out = out_folder(module, flags)
    if out and "--child" not in flags and "--help" not in flags and os.path.isdir(out):
        record = {
            "command": "python -m benchmarks.run " + shlex.join(argv),
            "commit": _commit(),
            "started": started.isoformat(timespec="seconds"),
            "ended": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "status": status,
        }
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
