"""``make gpu-check``'s environment: a virtual environment over a Python whose torch is a CUDA
build, with nothing downloaded. Standard library only: it runs before any environment exists.

    python3 benchmarks/gpu_env.py .venv-gpu [--python PATH] [--wheels DIR]

Why not ``make test``'s ``.venv``: it pins ``torch==2.13.0``, which pip resolves to a CPU build
from this project's wheel sources, and a GPU machine for a check may reach no network and no
wheel source at all (a CUDA build of torch is gigabytes, too large to carry). So:

1. The interpreter: ``--python`` if given, else the first of ``.venv/bin/python`` and
   ``python3`` (then this one) whose ``torch.cuda.is_available()`` is true; where none sees a
   GPU, the first that has torch at all, so that on a machine without one the check runs and
   skips every CUDA check by name. Its torch is used as it is, whatever its release: the
   report says which, and warns where ``pyproject.toml`` admits another.
2. The environment: ``python -m venv --system-site-packages``, plus a ``.pth`` file naming
   the interpreter's own site-packages: where the interpreter is itself a virtual
   environment (as on the project's GPU machines, ``/opt/torch/.venv``), ``venv`` would
   otherwise see its base's packages, not its torch. shardwrap is not installed (its
   ``torch>=2.13,<2.16`` would make pip replace another release): the check puts this checkout on
   ``PYTHONPATH``.
3. What the check needs besides torch, only where missing: ``pytest``, ``einops`` and
   ``safetensors`` (required), ``transformers`` and ``pytest-timeout`` (without them the Llama
   checks skip, and tests have no time limit of their own), installed from ``--wheels DIR``
   with pip's ``--no-index`` when given. A required one still missing stops here, naming it.

It prints what it chose, and rebuilds the environment only when the interpreter changes.
Where ``venv`` fails, ``.venv-gpu/bin/python`` runs the interpreter itself and nothing is
installed: the check still runs with what is there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import json, site, sys\n"
    "info = {'python': sys.version.split()[0], 'site': site.getsitepackages()}\n"
    "try:\n"
    "    import torch\n"
    "    info.update(torch=torch.__version__, cuda=torch.cuda.is_available())\n"
    "except Exception as e:\n"
    "    info['error'] = f'{type(e).__name__}: {e}'\n"
    "print(json.dumps(info))\n"
)
REQUIRED = {"pytest": "pytest", "einops": "einops", "safetensors": "safetensors"}
OPTIONAL = {"transformers": "transformers", "pytest_timeout": "pytest-timeout"}


def probe(python: str) -> dict | None:
    """What ``python`` has (its torch, whether it sees a GPU, its site-packages), or ``None``
    where it does not run."""
    try:
        out = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def choose(given: str | None) -> tuple[str, dict]:
    """The interpreter whose torch the check uses (see the module docstring)."""
    if given:
        candidates = [given]
    else:
        found = [str(ROOT / ".venv" / "bin" / "python"), shutil.which("python3"), sys.executable]
        candidates = list(dict.fromkeys(c for c in found if c and Path(c).exists()))
    probed = [(c, probe(c)) for c in candidates]
    with_torch = [(c, info) for c, info in probed if info and "torch" in info]
    for c, info in with_torch:
        if info["cuda"]:
            return c, info
    if with_torch:
        return with_torch[0]
    said = "; ".join(f"{c}: {info.get('error') if info else 'does not run'}" for c, info in probed)
    sys.exit(
        f"gpu-check: no Python here has torch ({said}). On a GPU machine name one whose torch "
        "is a CUDA build: make gpu-check GPU_PYTHON=/path/to/python; elsewhere make test "
        "builds .venv (torch 2.13.0, CPU), where every CUDA check is skipped by name."
    )


def build(venv: Path, python: str, info: dict) -> tuple[Path, bool]:
    """The environment over ``python`` (made again where it was made over another one): its
    interpreter, and whether it is a virtual environment. Where ``venv`` cannot make one, its
    ``bin/python`` runs ``python`` itself, into which nothing is installed."""
    marker = venv / "gpu-env.json"
    if marker.exists() and json.loads(marker.read_text()).get("interpreter") == python:
        return venv / "bin" / "python", json.loads(marker.read_text())["venv"]
    make = [python, "-m", "venv", "--system-site-packages", "--without-pip", "--clear"]
    made = subprocess.run([*make, str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        print(f"gpu-check: no virtual environment ({made.stderr.strip()}): {python} itself")
        shutil.rmtree(venv, ignore_errors=True)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (venv / "bin" / "python").chmod(0o755)
    else:
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        purelib = subprocess.run(
            [str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True, check=True
        ).stdout.strip()
        # the interpreter's own packages, its torch among them, after the environment's own
        Path(purelib, "gpu_check_base.pth").write_text("\n".join(info["site"]) + "\n")
    marker.write_text(json.dumps({**info, "interpreter": python, "venv": made.returncode == 0}))
    return venv / "bin" / "python", made.returncode == 0


def missing(python: Path, modules: dict[str, str]) -> list[str]:
    """The pip names of ``modules`` that ``python`` cannot import."""
    return [
        package
        for module, package in modules.items()
        if subprocess.run([str(python), "-c", f"import {module}"], capture_output=True).returncode
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("venv", type=Path)
    p.add_argument("--python", help="the interpreter whose torch to use")
    p.add_argument("--wheels", type=Path, help="a folder of wheels for what is missing")
    args = p.parse_args(argv)
    python, info = choose(args.python)
    env_python, isolated = build(args.venv, python, info)
    lacking = missing(env_python, {**REQUIRED, **OPTIONAL})
    if lacking and isolated and args.wheels is not None and args.wheels.is_dir():
        pip = [str(env_python), "-m", "pip", "install", "--no-index", "--find-links"]
        subprocess.run([*pip, str(args.wheels), *lacking], check=False)
        lacking = missing(env_python, {**REQUIRED, **OPTIONAL})
    gpu = "sees a GPU" if info["cuda"] else "sees no GPU: every CUDA check will be skipped"
    print(
        f"gpu-check: {args.venv} over {python} (Python {info['python']}, torch "
        f"{info['torch']}, {gpu})"
    )
    required = [p for p in lacking if p in REQUIRED.values()]
    if required:
        sys.exit(
            f"gpu-check: {', '.join(required)} missing and not installable here: bring wheels "
            "(pip download --no-deps NAME==VERSION -d DIR where pip works) and name them: "
            "make gpu-check GPU_WHEELS=DIR"
        )
    if lacking:
        print(f"gpu-check: not installed, their checks skip: {', '.join(lacking)}")


if __name__ == "__main__":
    main()
