"""One process that runs Triton-interpreter scripts one after another (see InterpreterScripts).

Started with ``TRITON_INTERPRET=1`` (it must be set before triton is imported). Each request is a
JSON line on stdin, a script's argv (``[python, "-c", code, *args]`` or ``[python, path, *args]``);
each answer is one line on stdout, :data:`MARK` then a JSON object with ``returncode``, ``stdout``
and ``stderr``, as a separate process would have given them. One process for all scripts pays
Python's, torch's and triton's imports once instead of once per script (~2 s each on the CI
machine). Output that bypasses ``sys.stdout`` (C extensions) may appear between answers: the
reader skips lines without the mark.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback

MARK = "@@interpreter-script-result@@ "


def run_script(argv: list[str]) -> dict:
    """Run ``argv`` as ``python`` would, in this process; its exit code and captured output."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    saved_argv, saved_path = sys.argv, list(sys.path)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[1] == "-c":
                sys.argv = ["-c", *argv[3:]]
                exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv = argv[1:]
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))
                runpy.run_path(argv[1], run_name="__main__")
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:  # SystemExit("message"): printed to stderr, exit code 1
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported as the script's failure, as python would
            traceback.print_exc()
            code = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    for line in sys.stdin:
        if line.strip():
            answer = run_script(json.loads(line))
            sys.stdout.write(MARK + json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
