"""The documentation's code stays true: every Python snippet of the README and of docs/ compiles and every name it
imports from this package exists; the snippets marked ``<!-- docs-test: run -->`` run, on a tiny model; the planner
command the pages show runs with its flags."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A fenced block, also one indented inside a list item.
BLOCK = re.compile(r"(<!-- docs-test: run -->\n)?[ ]*```python\n(.*?)\n[ ]*```", re.S)


def snippets() -> list[tuple[str, bool, str]]:
    found = []
    for page in PAGES:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{i}", bool(m.group(1)), textwrap.dedent(m.group(2))))
    return found


SNIPPETS = snippets()


def test_every_way_of_use_shows_a_snippet_and_the_optimizer_pages_run_theirs():
    """Each page the site lists under "Ways of use" shows Python, and the optimizers' pages run what they show."""
    nav = (ROOT / "mkdocs.yml").read_text()
    ways = re.search(r"  - Ways of use:\n((?:      - .*\n)+)", nav).group(1)
    pages = re.findall(r": (\S+\.md)", ways)
    assert len(pages) >= 8, ways
    for page in pages:
        assert any(where.startswith(f"docs/{page}#") for where, _, _ in SNIPPETS), f"docs/{page} shows no Python"
    for page in ("optimizer.md", "optimizers.md"):
        assert any(where.startswith(f"docs/{page}#") and run for where, run, _ in SNIPPETS), page


@pytest.mark.parametrize(("where", "run", "code"), SNIPPETS, ids=[w for w, _, _ in SNIPPETS])
def test_snippet_compiles_and_its_imports_exist(where, run, code):
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_pure_bf16"):
            module = __import__(node.module, fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_pure_bf16"):
                    __import__(alias.name)
    if run:  # on a tiny model, with torch and nn at hand, as the page's reader has them
        model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
        exec(compile(tree, where, "exec"), {"torch": torch, "nn": nn, "model": model})


def test_the_planner_command_the_pages_show_runs():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    command = re.search(r"python -m lightning_pure_bf16\.plan (.*?)\n```", text, re.S).group(1)
    # The optional flags are shown in brackets: all of them given, as a user copying the line would.
    args = shlex.split(command.replace("\\\n", " ").replace("[", "").replace("]", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_pure_bf16.plan", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert '"fits"' in proc.stdout  # --json among the flags


def test_ci_runs_the_readmes_test_command_and_stops_at_any_failed_link_of_a_chain():
    # `set -e` stops a script at a failed command, but not inside an && chain unless the command is the chain's last:
    # a failed install or lint in the middle silently skipped the rest of its chain, and CI went on to pass.
    readme = (ROOT / "README.md").read_text()
    test_command = re.search(r"```bash\n(python3 -m venv .*pytest -q)\n```", readme).group(1)
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    chains = [line for line in script if "&&" in line and not line.lstrip().startswith("#")]
    assert any(line.startswith(test_command) for line in chains)
    assert chains and all(line.rstrip().endswith("|| exit $?") for line in chains)
    stops = subprocess.run(["bash", "-c", "set -euo pipefail; true && false && true || exit $?; echo went on"])
    assert stops.returncode == 1
