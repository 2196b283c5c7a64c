"""The modules and planted bugs the `swe` env's generated tasks are made of
(swe_tasks.generate_tasks puts them together), read from `data/swe/<module>.toml`.

Each `Module` is a small, correct Python module (`source`, with `PKG` standing for the
package's name) and its visible tests (`tests`, unittest), which pass with or without
any of the module's bugs. Each `Bug` replaces one snippet of the module (`fixed` ->
`buggy`, a kind of mistake from real code: off-by-one, a wrong operator or comparison,
a missing edge case, a lost last element), says what a user would report (`title`,
`body`), and brings the hidden tests that fail because of it (`hidden`: test methods
of a TestCase, indented for its body, for the functions `names` of the module).
tests/unit/test_swe_env.py checks every bug against its tests in the sandbox.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data" / "swe"
#: the modules, in the order the generator draws from (changing it changes the tasks)
MODULE_NAMES = ("listops", "numbers", "text", "search", "convert", "money", "stack", "intervals", "roman",
                "version", "stats", "inventory", "codes")
#: package names of the generated repositories (none is a standard-library module)
PACKAGES = ("acorn", "birchwood", "cedarline", "dunefield", "emberkit", "fjordlib", "garnet", "heronpy",
            "irisworks", "jadeutil", "kestrel", "lotuskit", "maplelib", "nimbuskit", "onyxtools", "prismutil",
            "quartzlib", "ravenkit", "sierralib", "tundra", "umberpy", "velvetkit", "willowlib", "zephyrkit",
            "atlaskit", "beaconlib", "cobaltpy", "driftwood", "elmtree", "falconkit", "groveutil", "harborlib",
            "inkwell", "juniperpy", "kelpkit", "lanternlib", "meadowpy", "northwind", "orchardkit", "pebblelib")


@dataclass(frozen=True)
class Bug:
    key: str
    fixed: str
    buggy: str
    title: str
    body: str
    names: tuple[str, ...]
    hidden: str


@dataclass(frozen=True)
class Module:
    name: str
    topic: str
    source: str
    tests: str
    bugs: tuple[Bug, ...]


def load_module(path: Path) -> Module:
    """One module template file. Raises ValueError naming the file and the field that is
    missing or not of its type."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    try:
        bugs = tuple(Bug(key=b["key"], fixed=b["fixed"], buggy=b["buggy"], title=b["title"], body=b["body"],
                         names=tuple(b["names"]), hidden=b["hidden"]) for b in data["bugs"])
        module = Module(name=data["name"], topic=data["topic"], source=data["source"], tests=data["tests"],
                        bugs=bugs)
    except KeyError as e:
        raise ValueError(f"{path}: missing {e.args[0]!r}") from None
    for f in ("name", "topic", "source", "tests"):
        if not isinstance(getattr(module, f), str):
            raise ValueError(f"{path}: {f} must be a string")
    return module


@functools.cache
def modules() -> tuple[Module, ...]:
    """Every module template, in MODULE_NAMES order."""
    return tuple(load_module(DATA_DIR / f"{name}.toml") for name in MODULE_NAMES)
