"""The Dockerfile (not built in CI: no registry): its instructions parse, what it copies exists and
is not left out of the build context by .dockerignore, and the package it installs has the
entrypoint it names."""

import fnmatch
import json
import os
import shlex
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "RUN", "ENTRYPOINT", "CMD", "LABEL", "USER", "EXPOSE"}


def _instructions() -> list:
    """(INSTRUCTION, argument text) of each instruction, continuation lines joined, comments dropped."""
    joined, out = "", []
    for line in open(os.path.join(REPO, "Dockerfile")):
        stripped = line.strip()
        if not joined and (not stripped or stripped.startswith("#")):
            continue
        joined += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            word, _, rest = joined.partition(" ")
            out.append((word, rest.strip()))
            joined = ""
    assert not joined, "the Dockerfile ends in a continuation line"
    return out


def _ignored(path: str) -> bool:
    patterns = [p.strip() for p in open(os.path.join(REPO, ".dockerignore"))
                if p.strip() and not p.startswith("#")]
    parts = path.split("/")
    return any(fnmatch.fnmatch("/".join(parts[:i]), p) for p in patterns for i in range(1, len(parts) + 1))


def test_the_dockerfile_parses_and_copies_files_that_exist_into_the_context():
    steps = _instructions()
    assert {word for word, _ in steps} <= INSTRUCTIONS, steps
    words = [word for word, _ in steps]
    assert words[0] in ("ARG", "FROM") and words.count("FROM") == 1
    args = dict(rest.split("=", 1) for word, rest in steps if word == "ARG")
    base = dict(steps)["FROM"]
    assert base == "${BASE_IMAGE}" and "cuda" in args["BASE_IMAGE"]  # a CUDA build of PyTorch
    copied = []
    for word, rest in steps:
        if word == "COPY":
            *sources, _ = shlex.split(rest)
            copied += sources
    for source in copied:
        assert os.path.exists(os.path.join(REPO, source)), source
        assert not _ignored(source), f"{source} is excluded by .dockerignore"
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert {"pyproject.toml", project["readme"], "src"} <= set(copied)  # what `pip install .` reads
    assert any(word == "RUN" and "pip install ." in rest for word, rest in steps)
    env = " ".join(rest for word, rest in steps if word == "ENV")
    assert "NCCL_NVLS_ENABLE=0" in env and "TORCH_NCCL_ASYNC_ERROR_HANDLING=" in env
    entrypoint, cmd = json.loads(dict(steps)["ENTRYPOINT"]), json.loads(dict(steps)["CMD"])
    assert entrypoint == ["meshlm"] and project["scripts"]["meshlm"] == "meshlm.cli:main"
    out = subprocess.run([sys.executable, "-m", "meshlm", *cmd], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert out.returncode == 0 and out.stdout.startswith("usage: meshlm"), out.stderr


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    for path in (".git", ".venv", "runs", "src/meshlm/__pycache__", "tests"):
        assert _ignored(path), path
    for path in ("src/meshlm/cli.py", "pyproject.toml", "examples/slurm/train.sbatch"):
        assert not _ignored(path), path
