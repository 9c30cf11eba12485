"""Running a test module's ``test_interp_*`` tests under Triton's CPU interpreter.

Triton picks the interpreter when ``triton`` is first imported (``TRITON_INTERPRET=1``), so
those tests run once in a child pytest with the variable set, and each test of the parent
process takes its outcome from the child's report (:func:`delegated`). A module uses it so::

    IN_CHILD = in_child(FLAG)

    @pytest.fixture(scope="module")
    def child_report(tmp_path_factory):
        return run_child(__file__, FLAG, tmp_path_factory, timeout_s=900, what="kernel tests")

and starts each interpreted test with ``if delegated(request, IN_CHILD): return``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

__all__ = ["delegated", "in_child", "run_child"]


def in_child(flag: str) -> bool:
    """Whether this process is the interpreted child of the module that uses ``flag``."""
    return os.environ.get(flag) == "1"


def run_child(test_file: str, flag: str, tmp_path_factory, *, timeout_s: float, what: str) -> dict:
    """Run ``test_file``'s ``interp`` tests once in a child pytest under the interpreter;
    test name -> (outcome, message)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    xml_path = tmp_path_factory.mktemp("interp") / "report.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", **{flag: "1"})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interp",
           f"--junitxml={xml_path}", os.path.abspath(test_file)]
    try:
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the interpreted {what} took over {timeout_s} s", pytrace=False)
    if not xml_path.exists():
        pytest.fail(f"the interpreted child run produced no report:\n{proc.stdout}\n{proc.stderr}",
                    pytrace=False)
    report = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                message = (node.get("message") or "") + "\n" + (node.text or "")
                break
        report[case.get("name")] = (outcome, message)
    return report


def delegated(request, child: bool) -> bool:
    """In the parent process: take this test's outcome from the child run (True: done)."""
    if child:
        return False
    report = request.getfixturevalue("child_report")
    name = request.node.name
    if name not in report:
        pytest.fail(f"{name} did not run in the interpreted child", pytrace=False)
    outcome, message = report[name]
    if outcome == "failed":
        pytest.fail(f"under the interpreter:\n{message}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(message.strip())
    return True
