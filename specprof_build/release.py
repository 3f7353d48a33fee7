"""A release's series: the ordered patches, the pin of upstream artifacts, and their lint."""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .errors import BuildError

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
OVERLAY = ROOT / "overlay"

HEADER_FIELDS = ("Description:", "Forwarded:", "Last-Update:")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.patch$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
RELEASE = re.compile(r"\d{1,6}(\.\d{1,6}){0,5}(\.post\d{1,6})?")  # 0.5.16, 0.5.12.post1: a release number


def is_release(version: str) -> bool:
    return RELEASE.fullmatch(version) is not None


def shown(arg: str, width: int = 40) -> str:
    """A user's argument quoted for a message, cut to `width` characters."""
    return repr(arg if len(arg) <= width else arg[:width] + "...")


def read_text(path: Path, where: str | None = None) -> str:
    """A file of a series folder as text: one that is not UTF-8, or cannot be read, is one sentence."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BuildError(f"{where or path} is not UTF-8 text (byte {e.start} is not); it is damaged or not "
                         f"the file build.py expects there.") from None
    except OSError as e:
        raise BuildError(f"Cannot read {where or path}: {e.strerror}.") from None


@dataclass(frozen=True)
class Pin:
    version: str
    revision: int
    artifacts: dict[str, str]  # file name -> sha256
    note: str = ""


@dataclass
class Release:
    version: str
    directory: Path
    pin: Pin
    patches: list[Path] = field(default_factory=list)

    @property
    def local_version(self) -> str:
        return f"specprof.{self.pin.revision}"

    @property
    def full_version(self) -> str:
        return f"{self.version}+{self.local_version}"

    def series_sha256(self) -> str:
        """One hash over the series file, every patch in order, and the overlay."""
        h = hashlib.sha256()
        h.update((self.directory / "series").read_bytes())
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        for f in overlay_files():
            h.update(str(f.relative_to(OVERLAY)).encode() + b"\0" + f.read_bytes())
        return h.hexdigest()


def overlay_files(overlay: Path | None = None) -> list[Path]:
    overlay = overlay or OVERLAY
    return sorted(
        p
        for p in overlay.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def parse_series(text: str, where: str = "series") -> list[str]:
    """Patch names in order; blank lines and # comments are skipped."""
    names = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _NAME.match(line):
            raise BuildError(f"{where} line {n}: {line!r} is not a patch file name (NAME.patch, no folders).")
        names.append(line)
    return names


def parse_pin(text: str, where: str = "pin.toml") -> Pin:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BuildError(f"{where} is not valid TOML: {e}.") from None
    version = data.get("version")
    revision = data.get("revision")
    artifacts = data.get("artifacts")
    if not isinstance(version, str):
        raise BuildError(f"{where} has no version = \"X.Y.Z\".")
    try:
        Version(version)
    except InvalidVersion:
        raise BuildError(f"{where}: version {version!r} is not a PEP 440 version.") from None
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise BuildError(f"{where} needs revision = N, a whole number of 1 or more.")
    if not isinstance(artifacts, dict) or not artifacts:
        raise BuildError(f"{where} has no [artifacts] table of file name = sha256.")
    for name, digest in artifacts.items():
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise BuildError(f"{where}: the sha256 of {name} is not 64 lowercase hex digits.")
        if not name.startswith(f"sglang-{version}-") and not name.startswith(f"sglang-{version}."):
            raise BuildError(f"{where}: artifact {name} is not of sglang {version}.")
    return Pin(version=version, revision=revision, artifacts=dict(artifacts), note=str(data.get("note", "")))


def format_pin(pin: Pin) -> str:
    lines = [
        "# The upstream release this series is built from, and the sha256 of every",
        "# artifact that release publishes on PyPI. build.py refuses any other bytes.",
        f'version = "{pin.version}"',
        "# N in the built version X.Y.Z+specprof.N; raise it when the series changes.",
        f"revision = {pin.revision}",
    ]
    if pin.note:
        lines.append(f'note = "{pin.note}"')
    lines += ["", "[artifacts]"]
    lines += [f'"{name}" = "{digest}"' for name, digest in sorted(pin.artifacts.items())]
    return "\n".join(lines) + "\n"


def lint(directory: Path) -> list[str]:
    """Every problem with a series folder, one sentence each (empty: clean)."""
    problems = []
    series = directory / "series"
    if not series.is_file():
        return [f"{directory.name} has no series file."]
    try:
        names = parse_series(read_text(series, f"{directory.name}/series"), f"{directory.name}/series")
    except BuildError as e:
        return [str(e)]
    seen = set()
    for name in names:
        if name in seen:
            problems.append(f"{directory.name}/series lists {name} twice.")
        seen.add(name)
        path = directory / name
        if not path.is_file():
            problems.append(f"{directory.name}/series lists {name}, which does not exist.")
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"{directory.name}/{name} is not UTF-8 text.")
            continue
        head = text.split("\n---\n", 1)[0] if "\n---\n" in text else text.split("\ndiff --git", 1)[0]
        missing = [f for f in HEADER_FIELDS if not re.search(rf"^{re.escape(f)}", head, re.M)]
        if missing:
            problems.append(f"{directory.name}/{name} has no {', '.join(missing)} header.")
        if "\ndiff --git " not in text:
            problems.append(f"{directory.name}/{name} holds no diff.")
    for path in sorted(directory.glob("*.patch")):
        if path.name not in seen:
            problems.append(f"{directory.name}/{path.name} is not listed in the series.")
    return problems


def available(patches: Path | None = None) -> list[str]:
    patches = patches or PATCHES
    found = []
    for d in patches.glob("sglang-*"):
        if (d / "series").is_file():
            if not is_release(d.name[len("sglang-"):]):
                raise BuildError(f"{d} is not named for a release (sglang-X.Y.Z, like sglang-0.5.16); "
                                 f"rename or remove it.")
            found.append(d.name[len("sglang-"):])
    return sorted(found, key=Version)


def nearest(version: str, have: list[str]) -> tuple[str | None, str | None]:
    """The releases with a series just below and just above `version` (None where there is none)."""
    v = Version(version)
    below = [h for h in have if Version(h) < v]
    above = [h for h in have if Version(h) > v]
    return (max(below, key=Version) if below else None), (min(above, key=Version) if above else None)


def default_release(patches: Path | None = None) -> str:
    path = (patches or PATCHES) / "default"
    if not path.is_file():
        raise BuildError(f"{path} is missing; it names the default release (or pass --sglang).")
    return read_text(path).strip()


def check_release(version: str, patches: Path | None = None) -> None:
    """A release number, before it names a path (no '..', no name too long for the file system)."""
    if not is_release(version):
        raise BuildError(f"{shown(version)} is not an SGLang release number (like 0.5.16); "
                         f"{patches or PATCHES} has {', '.join(available(patches)) or 'none'}.")


def load(version: str, patches: Path | None = None) -> Release:
    patches = patches or PATCHES
    check_release(version, patches)
    directory = patches / f"sglang-{version}"
    if not (directory / "series").is_file():
        have = ", ".join(available(patches)) or "none"
        older, newer = nearest(version, available(patches))
        near = " and ".join(f"{v} ({side})" for v, side in ((older, "older"), (newer, "newer")) if v)
        start = older or newer
        raise BuildError(
            f"No patch series for sglang {version}; {patches} has {have}"
            + (f", the nearest {near}" if near else "") + ". "
            f"To carry the series to {version}, run: python build.py rebase --onto {version}"
            + (f" --from {start}" if start else "")
        )
    problems = lint(directory)
    if problems:
        raise BuildError(" ".join(problems))
    pin_path = directory / "pin.toml"
    if not pin_path.is_file():
        raise BuildError(f"{directory.name} has no pin.toml.")
    pin = parse_pin(read_text(pin_path, f"{directory.name}/pin.toml"), f"{directory.name}/pin.toml")
    if pin.version != version:
        raise BuildError(f"{directory.name}/pin.toml pins {pin.version}, not {version}.")
    names = parse_series(read_text(directory / "series"))
    return Release(version=version, directory=directory, pin=pin, patches=[directory / n for n in names])
