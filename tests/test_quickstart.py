"""The README's quick start, run as written from a fresh clone alone in an empty directory.

`git clone` of this checkout (its committed state) into a temporary directory with nothing
beside it, so any path outside the repo fails. The install step of `make` needs the network, so
the test stands in for it: .venv is a real venv of this interpreter that sees this environment's
packages (a .pth file) and the clone's own code, with the console script pip would write. Every
other step is the README's text: `make serve ARGS=...`, then its query block as one bash script
(activation, curl, the openai client, `pagedserve bench serve`, `pagedserve --help`), and
`make test ARGS=...` on the loader tests that once read a sibling folder.
"""
from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not (REPO / ".git").exists() or not all(shutil.which(t) for t in ("git", "make", "curl", "bash")),
    reason="needs a git checkout, make, curl and bash")


def quickstart_blocks(readme: str) -> list[str]:
    """The bash blocks of the README's Quick start section."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def _fake_install(clone: Path) -> dict[str, str]:
    """A .venv as `make` would leave it, without the network; returns the user's environment."""
    venv = clone / ".venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    purelib = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})
    Path(purelib, "_quickstart.pth").write_text(
        "\n".join([str(clone), *site.getsitepackages()]) + "\n")
    script = venv / "bin" / "pagedserve"
    script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom pagedserve.entrypoints.cli import main\n"
                      "sys.exit(main())\n")
    script.chmod(0o755)
    for stamp in (".installed-serve", ".installed-test"):  # oldest first, as make wrote them
        (venv / stamp).touch()
        time.sleep(0.01)
    here = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != here)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # PIP_NO_INDEX: `pip install openai` must find it installed, never reach for the network.
    env.update(PATH=path, PIP_NO_INDEX="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def test_readme_quickstart_from_a_fresh_clone(tmp_path):
    clone = tmp_path / "pagedserve"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    assert os.listdir(tmp_path) == ["pagedserve"]
    serve_block, query_block = quickstart_blocks((clone / "README.md").read_text())
    env = _fake_install(clone)
    where = subprocess.run([str(clone / ".venv/bin/python"), "-c",
                            "import pagedserve; print(pagedserve.__file__)"],
                           capture_output=True, text=True, env=env, cwd=clone, check=True)
    assert where.stdout.strip().startswith(str(clone))

    port = free_port()
    serve = serve_block.split("#")[0].strip()
    assert serve == "make serve"
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(["bash", "-c", f'{serve} ARGS="--port {port}"'], cwd=clone, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_ready(server, f"http://127.0.0.1:{port}/health", 180, interval=0.5,
                         log_path=tmp_path / "serve.log", log_chars=3000)
        script = "set -euo pipefail\n" + query_block.replace("8000", str(port))
        p = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert '"text_completion"' in p.stdout                       # curl
        assert "completed / failed          20 / 0" in p.stdout       # bench serve
        assert "usage: pagedserve" in p.stdout                       # --help
    finally:
        stop_process(server, group=True)
        log.close()

    p = subprocess.run(["make", "test", "ARGS=tests/models/test_loader.py"], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"\d+ passed", p.stdout) and "failed" not in p.stdout


def test_docs_link_only_inside_the_repo():
    """A clone has no sibling folders: every relative link of the README and docs/ resolves in it."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or REPO not in path.parents:
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def _heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped,
    spaces to '-', a repeat suffixed -1, -2, ... (headings inside fenced code are not headings)."""
    anchors, seen = set(), {}
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for title in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_docs_anchors_name_a_heading():
    """A link into a page's section (page.md#anchor, or #anchor on the same page) names a heading
    that page has: moving a section between pages must move its links too."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            linked = page if not path else (page.parent / path).resolve()
            if linked.suffix == ".md" and linked.exists() and anchor not in _heading_anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
