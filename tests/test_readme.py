"""Every ```python and ```bash block of README.md runs as a user would paste it, unless the line
right before its fence is `<!-- not run: REASON -->` (the test then shows as skipped, with REASON).

- python blocks: each in a fresh `python -c` process, from the repository root;
- bash blocks: `bash -euo pipefail` from the repository root, with .venv/bin first on PATH;
- each with a timeout. A block that talks to "a server on port 8000" (http://127.0.0.1:8000 or
  localhost:8000, as the README writes it) talks to the test session's server, on whatever port
  that has: the README stays as a user types it.

Run: .venv/bin/python -m pytest tests/test_readme.py
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(python|bash)\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (.*) -->")
PORT_8000 = re.compile(r"(?:127\.0\.0\.1|localhost):8000")


def readme_blocks():
    """A pytest.param (language, code) per block, named README.md:LINE, skipped if marked."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    for block in FENCE.finditer(text):
        line = text.count("\n", 0, block.start()) + 1
        before = text[: block.start()].rstrip("\n").rpartition("\n")[2]
        reason = NOT_RUN.fullmatch(before.strip())
        marks = pytest.mark.skip(reason=reason[1]) if reason else ()
        yield pytest.param(*block.groups(), id=f"README.md:{line}", marks=marks)


@pytest.mark.parametrize("language,code", readme_blocks())
def test_readme_block_runs(language, code, server):
    host_port = server.base_url.removeprefix("http://")
    code = PORT_8000.sub(host_port, code)
    env = {
        **os.environ,
        "PATH": os.path.join(ROOT, ".venv", "bin") + os.pathsep + os.environ["PATH"],
    }
    command = (
        [sys.executable, "-c", code]
        if language == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
