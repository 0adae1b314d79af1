"""Which TensorFlow and Keras versions tf_asgd works with, measured.

For each TensorFlow version in `--tf`, one throwaway venv, into which each Keras version
of `--keras` is installed in turn with this checkout's requirements; each pair runs
`import tf_asgd`, the fast test tier and, unless `--no-smoke`, one cluster test
(`--smoke`). `--unsupported-keras` records that an out-of-range Keras is refused. Venvs go
under `--venv-dir` and are deleted after their TF version unless `--keep-venvs`. Method:
docs/benchmarks.md (How each suite measures).

Writes `compat.csv` and `compat.md` to `--out` after every pair, and, with `--docs`,
rewrites the table in that file between its `<!-- compat-table -->` markers. Run it niced:

    nice -n 19 python tools/dev/compat.py
    nice -n 19 python tools/dev/compat.py --tf 2.21 --keras 3.15 --no-smoke
"""

import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # benchmarks/harness.py

from benchmarks import harness  # noqa: E402

SMOKE = "tests/cluster/test_strategy.py::test_digits_convnet_fit_evaluate_predict_save"
FAST = ["tests", "-q", "-m", "not cluster", "-p", "no:cacheprovider"]
BEGIN, END = "<!-- compat-table -->", "<!-- /compat-table -->"
COLUMNS = [
    "tf",
    "keras",
    "tf_installed",
    "keras_installed",
    "pip",
    "import",
    "fast_tier",
    "smoke",
    "result",
    "seconds",
    "note",
]


def run(cmd, timeout, env=None, cwd=ROOT):
    """`(returncode, combined output)`; returncode None on timeout."""
    try:
        p = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            timeout=timeout,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, out + f"\n[timed out after {timeout} s]"


def last_line(text, pattern=None):
    """The last non-empty line of `text` (matching `pattern`, if given)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if pattern:
        lines = [ln for ln in lines if re.search(pattern, ln)] or lines
    return lines[-1][:300] if lines else ""


def pip_reason(text):
    """pip's own words for a refused install (the ERROR lines, shortened)."""
    errors = [
        ln.strip()
        for ln in text.splitlines()
        if ln.startswith(
            (
                "ERROR",
                "    The conflict is caused by",
                "    tf-asgd",
                "    tensorflow",
                "    keras",
                "    The user requested",
            )
        )
    ]
    return " / ".join(errors)[:400] or last_line(text)


def pytest_summary(code, text):
    """`"57 passed in 40.1s"`-like, or why there is none."""
    line = last_line(text, r"(passed|failed|error|no tests ran)")
    if code is None:
        return "timed out: " + line
    return re.sub(r"^=+ | =+$", "", line)


class Venv:
    def __init__(self, path, python):
        self.path = path
        subprocess.run([python, "-m", "venv", path], check=True)
        self.python = os.path.join(path, "bin", "python")

    def pip(self, *args, timeout=1800):
        return run(
            [
                self.python,
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--progress-bar",
                "off",
                *args,
            ],
            timeout,
        )

    def version(self, module):
        code, out = run(
            [self.python, "-c", f"import {module}; print({module}.__version__)"],
            600,
            env=self.env(),
        )
        return out.strip().splitlines()[-1] if code == 0 and out.strip() else "?"

    def env(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(
            PYTHONPATH=ROOT,
            VIRTUAL_ENV=self.path,
            TF_CPP_MIN_LOG_LEVEL="2",
            PATH=os.path.join(self.path, "bin") + os.pathsep + env.get("PATH", ""),
        )
        return env


def spec(version, name):
    """`"keras==3.13.*"` for `3.13`; an exact version (`3.13.2`) stays exact."""
    return f"{name}=={version}" if version.count(".") >= 2 else f"{name}=={version}.*"


def test_pair(venv, tf_version, keras_version, args, expect_refusal=False):
    """Installs `keras_version` (with the checkout's requirements) into
    `venv` and tests it; returns the table row."""
    row = {
        "tf": tf_version,
        "keras": keras_version,
        "pip": "ok",
        "import": "",
        "fast_tier": "",
        "smoke": "",
        "result": "",
        "note": "",
    }
    t0 = time.time()
    reqs = [spec(tf_version, "tensorflow"), spec(keras_version, "keras")]
    if expect_refusal:  # out of pyproject.toml's range: install Keras alone
        code, out = venv.pip(*reqs)
    else:
        code, out = venv.pip(*reqs, f"{ROOT}[test]")
    row["tf_installed"], row["keras_installed"] = venv.version("tensorflow"), venv.version("keras")
    if code != 0:
        row.update(
            pip="refused",
            result="pip refused",
            note=pip_reason(out),
            seconds=round(time.time() - t0),
        )
        return row
    env = venv.env()
    code, out = run([venv.python, "-c", "import tf_asgd"], 600, env=env)
    row["import"] = "ok" if code == 0 else last_line(out, r"Error")
    if expect_refusal:
        refused = code != 0 and "RuntimeError" in out and "supports" in out
        row.update(
            result="refused at import, as it should be" if refused else "NOT refused at import",
            seconds=round(time.time() - t0),
        )
        return row
    if code != 0:
        row.update(result="import fails", seconds=round(time.time() - t0))
        return row
    code, out = run([venv.python, "-m", "pytest", *FAST], args.timeout, env=env)
    row["fast_tier"] = pytest_summary(code, out)
    ok = code == 0
    if not ok:
        with open(
            os.path.join(args.out, f"fast_tf{tf_version}_keras{keras_version}.log"), "w"
        ) as f:
            f.write(out)
    if args.smoke:
        code, out = run(
            [venv.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shlex.split(args.smoke)],
            args.timeout,
            env=env,
        )
        row["smoke"] = pytest_summary(code, out)
        ok = ok and code == 0
        if code != 0:
            with open(
                os.path.join(args.out, f"smoke_tf{tf_version}_keras{keras_version}.log"), "w"
            ) as f:
                f.write(out)
    row.update(result="pass" if ok else "FAIL", seconds=round(time.time() - t0))
    return row


def write_results(rows, args):
    # csv here, not harness.write_csv: this process never imports TF.
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compat.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = table(rows)
    harness.write_lines(
        os.path.join(args.out, "compat.md"),
        [
            "# tf_asgd: TensorFlow x Keras compatibility (tools/dev/compat.py)",
            "",
            f"Python {sys.version.split()[0]}; "
            'fast tier: `python -m pytest tests -q -m "not cluster"`; '
            f"smoke: `{args.smoke or 'none'}`.",
            "",
        ]
        + lines,
    )
    if args.docs and os.path.exists(args.docs):
        with open(args.docs) as f:
            text = f.read()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            tail = rest.split(END, 1)[1]
            with open(args.docs, "w") as f:
                f.write(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def table(rows):
    header = [
        "TF",
        "Keras",
        "installed (TF / Keras)",
        "pip",
        "fast tier",
        "cluster smoke",
        "result",
        "s",
    ]
    return harness.markdown_table(
        header,
        [
            [
                r["tf"],
                r["keras"],
                f"{r.get('tf_installed', '')} / {r.get('keras_installed', '')}",
                r["pip"] if r["pip"] == "ok" else f"refused: {r['note']}",
                r["fast_tier"] or r["import"],
                r["smoke"],
                r["result"],
                r.get("seconds", ""),
            ]
            for r in rows
        ],
    )


def main(argv=None):
    p = harness.parser(__doc__, out=os.path.join(ROOT, "results", "compat"))
    p.add_argument(
        "--tf",
        type=harness.str_list,
        default=["2.19", "2.20", "2.21"],
        help="TensorFlow versions, comma-separated (2.19: newest 2.19.x; 2.19.0: exact)",
    )
    p.add_argument(
        "--keras",
        type=harness.str_list,
        default=["3.13", "3.14", "3.15"],
        help="Keras versions, comma-separated",
    )
    p.add_argument(
        "--unsupported-keras",
        default="3.12",
        help="a Keras out of range, checked to be refused at import ('' to skip)",
    )
    p.add_argument(
        "--smoke",
        default=SMOKE,
        help="cluster tests to run per pair (pytest node ids, space-separated; 'tests': all)",
    )
    p.add_argument("--no-smoke", dest="smoke", action="store_const", const="")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
    p.add_argument(
        "--docs",
        default=os.path.join(ROOT, "docs", "compat.md"),
        help="a Markdown file whose table to rewrite ('' for none)",
    )
    p.add_argument(
        "--venv-dir", default="", help="where to make the venvs (default: a temporary dir)"
    )
    p.add_argument("--keep-venvs", action="store_true")
    p.add_argument(
        "--python", default=sys.executable, help="the interpreter the venvs are made from"
    )
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    base = args.venv_dir or tempfile.mkdtemp(prefix="tf_asgd_compat_")
    rows = []
    try:
        for i, tf_version in enumerate(args.tf):
            path = os.path.join(base, f"tf{tf_version}")
            print(f"== TF {tf_version}: venv {path}", flush=True)
            venv = Venv(path, args.python)
            try:
                code, out = venv.pip(
                    spec(tf_version, "tensorflow"), spec(tf_version, "tensorboard")
                )
                if code != 0:
                    reason = pip_reason(out)
                    rows += [
                        {
                            "tf": tf_version,
                            "keras": k,
                            "pip": "refused",
                            "result": "pip refused",
                            "note": reason,
                            "fast_tier": "",
                            "smoke": "",
                            "import": "",
                        }
                        for k in args.keras
                    ]
                    write_results(rows, args)
                    continue
                pairs = [(k, False) for k in args.keras]
                if args.unsupported_keras and i == len(args.tf) - 1:
                    pairs.append((args.unsupported_keras, True))
                for keras_version, refusal in pairs:
                    print(f"   Keras {keras_version} ...", flush=True)
                    row = test_pair(venv, tf_version, keras_version, args, expect_refusal=refusal)
                    print(
                        f"   {row['result']}: {row['fast_tier'] or row['note'] or row['import']}"
                        f" | {row['smoke']}",
                        flush=True,
                    )
                    rows.append(row)
                    write_results(rows, args)
            finally:
                if not args.keep_venvs:
                    shutil.rmtree(path, ignore_errors=True)
    finally:
        if not args.keep_venvs and not args.venv_dir:
            shutil.rmtree(base, ignore_errors=True)
    write_results(rows, args)
    print("\n".join(table(rows)))
    return (
        0 if all(r["result"] in ("pass", "refused at import, as it should be") for r in rows) else 1
    )


if __name__ == "__main__":
    sys.exit(main())
