"""Choose the upstream wheel for a target, fetch it with pip into a cache, check its hash."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.tags import Tag, sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from .errors import BuildError
from .release import Pin

PARTIAL = ".partial-"


def default_cache() -> Path:
    env = os.environ.get("SGLANG_SPECPROF_CACHE")
    if env:
        return Path(env).expanduser()  # '~/x' as a shell would read it, not a folder named ~
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-specprof"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def wheel_tags(name: str) -> frozenset[Tag]:
    try:
        return parse_wheel_filename(name)[3]
    except InvalidWheelFilename:
        return frozenset()


def choose(pin: Pin, python_tag: str | None = None, platform: str | None = None) -> str:
    """The pinned wheel for the running interpreter, or for the given tags."""
    wheels = {name: wheel_tags(name) for name in pin.artifacts if name.endswith(".whl")}
    if python_tag is None and platform is None:
        for tag in sys_tags():
            for name, tags in sorted(wheels.items()):
                if tag in tags:
                    return name
        raise BuildError(
            f"sglang {pin.version} publishes no wheel for this interpreter "
            f"({sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}); "
            f"pick one with --python-tag and --platform: {', '.join(sorted(wheels))}."
        )
    here = {t.platform for t in sys_tags()}
    hits = []
    for name, tags in sorted(wheels.items()):
        for t in tags:
            if python_tag is not None and t.interpreter != python_tag:
                continue
            if platform is not None and t.platform != platform:
                continue
            if platform is None and t.platform not in here and t.platform != "any":
                continue
            hits.append(name)
            break
    if not hits:
        pairs = sorted({f"{t.interpreter} {t.platform}" for tags in wheels.values() for t in tags})
        raise BuildError(
            f"sglang {pin.version} publishes no wheel for "
            f"{python_tag or 'this interpreter'} on {platform or 'this platform'}; it has: {', '.join(pairs)}."
        )
    return hits[0]


def _pip_args(name: str, version: str) -> list[str]:
    """pip download arguments that select exactly the artifact `name`."""
    _, _, _, tags = parse_wheel_filename(name)
    tag = sorted(tags, key=str)[0]
    if tag.abi == "none" and tag.platform == "any":  # a pure-Python wheel fits every target
        return ["--only-binary=:all:", f"sglang=={version}"]
    args = ["--only-binary=:all:", "--implementation", tag.interpreter[:2]]
    if tag.interpreter[2:]:
        ver = tag.interpreter[2:]
        args += ["--python-version", f"{ver[0]}.{ver[1:]}" if len(ver) > 1 else ver]
    args += ["--abi", tag.abi, "--platform", tag.platform]
    return args + [f"sglang=={version}"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid: leave it
    return True


def sweep(folder: Path, prefix: str) -> None:
    """Remove `prefix<pid>-...` entries whose process is gone (a killed build's leftovers), and
    those named without a pid (left by a release of build.py that did not name them so);
    those of a build still running are its own business."""
    if not folder.is_dir():
        return
    for p in folder.glob(prefix + "*"):
        pid = p.name[len(prefix):].split("-", 1)[0].split(".", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def clean_partials(cache: Path) -> None:
    sweep(cache, PARTIAL)


def fetch(pin: Pin, name: str, cache: Path, offline: bool = False, log=print) -> Path:
    """The cached, hash-checked artifact `name`; downloaded first if needed."""
    want = pin.artifacts[name]
    final = cache / name
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"Cannot create the download cache {cache}: {e.strerror}.") from None
    clean_partials(cache)
    if final.exists() and not final.is_file():
        raise BuildError(f"{final} is in the download cache's way (not a file); remove it.")
    if final.is_file():
        got = sha256_file(final)
        if got == want:
            log(f"upstream  {name} (cached, sha256 ok)")
            return final
        log(f"upstream  {name} in the cache has sha256 {got[:12]}..., not the pinned {want[:12]}...; removing it")
        final.unlink()
    if offline:
        raise BuildError(
            f"{name} is not in the cache {cache} and --offline forbids downloading it; "
            f"run once with network, or pass the file with --from-wheel."
        )
    log(f"download  {name} with pip")
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", str(tmp), *_pip_args(name, pin.version)]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = [l for l in proc.stderr.splitlines() if l.strip() and "WARNING" not in l]
            raise BuildError(
                f"pip could not download {name}: {last[-1].strip() if last else 'no reason given'} "
                f"(check the network, or pass the file with --from-wheel)."
            )
        got_path = tmp / name
        if not got_path.is_file():
            files = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
            raise BuildError(f"pip downloaded {files}, not {name}.")
        got = sha256_file(got_path)
        if got != want:
            raise BuildError(
                f"The downloaded {name} has sha256 {got}, but the pin says {want}; refusing to build from it."
            )
        os.replace(got_path, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"upstream  {name} (sha256 ok)")
    return final


def check_wheel_file(path: Path, flag: str = "--from-wheel") -> None:
    """`path` is a file that can be a wheel: there, a regular file (not a folder, a device
    that reads forever, or a pipe), and a zip archive named *.whl."""
    try:
        st = path.stat()
    except OSError as e:
        raise BuildError(f"{flag} {path}: {'no such file' if e.errno == errno.ENOENT else e.strerror}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise BuildError(f"{flag} {path} is a folder; give the wheel file (sglang-X.Y.Z-....whl).")
    if not stat.S_ISREG(st.st_mode):
        raise BuildError(f"{flag} {path} is not a regular file (a device or a pipe); give the wheel file.")
    if path.suffix != ".whl" and not zipfile.is_zipfile(path):
        raise BuildError(f"{flag} {path} is not a wheel (no .whl name, not a zip archive).")


def from_wheel(pin: Pin, path: Path) -> str:
    """The pinned artifact name that the user's file is, by its hash."""
    check_wheel_file(path)
    got = sha256_file(path)
    for name, digest in pin.artifacts.items():
        if digest == got:
            return name
    raise BuildError(
        f"--from-wheel {path} (sha256 {got[:16]}...) is none of the {len(pin.artifacts)} "
        f"files pinned for sglang {pin.version}; it is corrupted, truncated, or another release."
    )
