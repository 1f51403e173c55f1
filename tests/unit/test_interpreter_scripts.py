"""The suite's runner of Triton-interpreter scripts gives what a process of each script would:
its output, its exit code, a traceback for an exception, and a crash or a hang named for that
script alone (the scripts after it still run)."""

from __future__ import annotations

import sys

from tests.interpreter_scripts import InterpreterScripts


def test_scripts_share_one_runner_and_report_as_separate_processes():
    scripts = InterpreterScripts(timeout_s=20)
    ok = (sys.executable, "-c", "import os, sys; print('out', os.environ['TRITON_INTERPRET'], sys.argv[1:])", "a")
    exits = (sys.executable, "-c", "import sys; print('before'); sys.exit(3)")
    says = (sys.executable, "-c", "raise SystemExit('a message')")
    raises = (sys.executable, "-c", "def f():\n    raise ValueError('planted')\nf()")
    crashes = (sys.executable, "-c", "import os; os._exit(7)")
    hangs = (sys.executable, "-c", "import time; time.sleep(60)")
    after = (sys.executable, "-c", "print('still runs')")
    try:
        scripts.start([ok, exits, says, raises, crashes])
        r = scripts.result(*ok)
        assert (r.returncode, r.stdout) == (0, "out 1 ['a']\n")
        r = scripts.result(*exits)
        assert (r.returncode, r.stdout) == (3, "before\n")
        r = scripts.result(*says)
        assert (r.returncode, r.stderr) == (1, "a message\n")
        r = scripts.result(*raises)
        assert r.returncode == 1 and "ValueError: planted" in r.stderr and "line 2, in f" in r.stderr
        for argv, why in ((crashes, "exit code 7"), (hangs, "killed after")):
            try:
                scripts.timeout_s = 1 if argv is hangs else 20
                scripts.result(*argv)
            except RuntimeError as exc:
                assert why in str(exc), exc
            else:
                raise AssertionError(f"{argv[2]!r} gave a result")
            scripts.timeout_s = 20
            assert scripts.result(*after).stdout == "still runs\n"
            del scripts._results[after]  # ask again after the next failure
    finally:
        scripts.close()
