"""Edits to a repository on disk, from untrusted text: safe paths, search/replace
blocks and unified diffs (the `swe` env's `edit` and `apply_patch` tools).

Everything here is pure Python on the host (nothing of the repository runs), and every
path comes from the policy, so each is checked before use (`resolve`): relative, no
`..`, not inside `.git`, and not leading out of the repository through a symlink. A
change is computed in full before anything is written, so an edit or patch that fails
leaves the repository as it was; files are replaced (written beside, then renamed), never
written in place, so a snapshot hard-linked into the episode's copy is never changed.

Unified diffs: the format of `diff -u` and `git diff` (GNU diffutils manual, "Detailed
Unified Format"): `--- a/<path>` and `+++ b/<path>` headers (`/dev/null` to create or
delete a file; one leading `a/` / `b/` component is dropped, as `git apply`/`patch -p1`
do), then hunks `@@ -start,count +start,count @@` of ` `, `-`, `+` lines and `\\ No
newline at end of file` markers. A hunk's old lines must match the file exactly; when
they are not at the hunk's line number they are looked for nearest to it (patch's
"offset"), never with changed whitespace (no "fuzz"). Renames, mode changes and binary
patches are refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

#: the largest file an edit or patch may leave (bytes)
MAX_FILE_BYTES = 1 << 20
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = "\\ No newline at end of file"


class PatchError(ValueError):
    """An edit or patch that does not apply; the message says why, naming the path."""


def resolve(root: Path, rel: str) -> Path:
    """The file `rel` names inside the repository `root` (a resolved directory).

    Raises PatchError when `rel` is empty, absolute, holds a NUL, `..` or a `.git`
    component, or leads outside `root` through a symlink."""
    if not isinstance(rel, str) or not rel.strip():
        raise PatchError("a path is required")
    rel = rel.strip()
    if "\0" in rel or len(rel) > 4096:
        raise PatchError(f"{rel[:200]!r}: not a valid path")
    pure = PurePosixPath(rel)
    if pure.is_absolute():
        raise PatchError(f"{rel}: absolute paths are refused; name a path relative to the repository root")
    if ".." in pure.parts:
        raise PatchError(f"{rel}: '..' is refused; name a path inside the repository")
    if ".git" in pure.parts:
        raise PatchError(f"{rel}: the .git folder is not part of the task")
    path = root.joinpath(*pure.parts)
    real = Path(os.path.realpath(path))
    if real != root and root not in real.parents:
        raise PatchError(f"{rel}: leads outside the repository (through a symlink)")
    return real


def read_text(path: Path, rel: str) -> str:
    """The UTF-8 text of a regular file. Raises PatchError naming `rel` when it is
    missing, not a regular file, over MAX_FILE_BYTES or not UTF-8."""
    if not path.is_file():
        raise PatchError(f"{rel}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    if path.stat().st_size > MAX_FILE_BYTES:
        raise PatchError(f"{rel}: the file is over {MAX_FILE_BYTES} bytes")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise PatchError(f"{rel}: not a UTF-8 text file") from None


def write_all(root: Path, changes: dict[Path, str | None]) -> None:
    """Write each file's new text (None: delete it), each by writing beside it and
    renaming over it. Raises PatchError for a text over MAX_FILE_BYTES (nothing written)
    or a file that cannot be written (e.g. a parent folder is a file)."""
    for path, text in changes.items():
        if text is not None and len(text.encode("utf-8")) > MAX_FILE_BYTES:
            raise PatchError(f"{path.relative_to(root)}: the change would make it larger than "
                             f"{MAX_FILE_BYTES} bytes")
    for path, text in changes.items():
        try:
            if text is None:
                path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.opentinker-tmp")
            tmp.write_text(text, encoding="utf-8", newline="")
            os.replace(tmp, path)
        except OSError as e:
            raise PatchError(f"{path.relative_to(root)}: cannot be written ({e.strerror})") from None


# --- search/replace -----------------------------------------------------------------

def parse_blocks(text: str) -> list[tuple[str, str]]:
    """The (search, replace) pairs of `text`'s blocks, aider's edit format:

        <<<<<<< SEARCH
        lines copied from the file
        =======
        the lines to put in their place
        >>>>>>> REPLACE

    Each side is its lines joined by "\\n" (no final newline). Raises PatchError when a
    block is unterminated, or there is none."""
    blocks: list[tuple[str, str]] = []
    side: list[str] | None = None
    search: list[str] = []
    replace: list[str] = []
    for line in text.split("\n"):
        mark = line.strip()
        if side is None:
            if re.fullmatch(r"<{5,9} ?SEARCH", mark):
                search, replace = [], []
                side = search
            continue
        if side is search and re.fullmatch(r"={5,9}", mark):
            side = replace
        elif side is replace and re.fullmatch(r">{5,9} ?REPLACE", mark):
            blocks.append(("\n".join(search), "\n".join(replace)))
            side = None
        else:
            side.append(line)
    if side is not None:
        raise PatchError("a SEARCH/REPLACE block is not closed: it needs '=======' and '>>>>>>> REPLACE' lines")
    if not blocks:
        raise PatchError("no SEARCH/REPLACE block: write <<<<<<< SEARCH, the old lines, =======, the new "
                         "lines, >>>>>>> REPLACE")
    return blocks


def edit_file(root: Path, rel: str, blocks: list[tuple[str, str]]) -> str:
    """Apply search/replace `blocks` to the file `rel` in order; returns a one-line
    summary. An empty search creates `rel` (which must not exist) with the replace text.

    Raises PatchError (nothing written) for a refused path (`resolve`), a missing file, a
    search text found nowhere or more than once, or a result over MAX_FILE_BYTES."""
    path = resolve(root, rel)
    if len(blocks) == 1 and blocks[0][0] == "":
        if path.exists() or path.is_symlink():
            raise PatchError(f"{rel}: an empty SEARCH creates a file, but {rel} exists; copy the lines to change")
        text = blocks[0][1]
        write_all(root, {path: text if text.endswith("\n") or not text else text + "\n"})
        return f"Created {rel}."
    text = read_text(path, rel)
    for i, (search, replace) in enumerate(blocks, 1):
        where = f"{rel}: block {i}" if len(blocks) > 1 else rel
        if search == "":
            raise PatchError(f"{where}: the SEARCH text is empty (only a single block with an empty SEARCH "
                             "creates a new file)")
        n = text.count(search)
        if n == 0:
            raise PatchError(f"{where}: the SEARCH text is not in the file; copy it exactly, with its indentation")
        if n > 1:
            raise PatchError(f"{where}: the SEARCH text occurs {n} times; include more lines so it is unique")
        text = text.replace(search, replace, 1)
    write_all(root, {path: text})
    return f"Edited {rel}."


# --- unified diffs --------------------------------------------------------------------

@dataclass
class Hunk:
    old_start: int  # 1-based; 0 for an empty old side
    old: list[str] = field(default_factory=list)  # lines with their newlines
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def _header_path(raw: str) -> str | None:
    p = raw.split("\t")[0].strip()
    if p == "/dev/null":
        return None
    if len(p) >= 2 and p[0] == p[-1] == '"':
        raise PatchError(f"{p}: quoted paths (unusual characters) are not supported")
    return p[2:] if p.startswith(("a/", "b/")) else p


def parse_patch(text: str) -> list[FilePatch]:
    """The file patches of a unified diff (module docstring). Text before the first
    `---` header (a `diff --git` line, prose) is skipped.

    Raises PatchError naming the line for a malformed diff: a header without its
    `+++` line, a hunk whose line counts do not match its header, a binary, rename or
    mode-change patch, or no file patch at all."""
    lines = text.splitlines(keepends=True)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("GIT binary patch", "Binary files ")):
            raise PatchError(f"line {i + 1}: binary patches are not supported")
        if line.startswith(("rename from ", "rename to ", "old mode ", "new mode ", "copy from ")):
            raise PatchError(f"line {i + 1}: renames, copies and mode changes are not supported; "
                             "delete and create the files instead")
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: a '--- <path>' header must be followed by '+++ <path>'")
        fp = FilePatch(_header_path(line[4:]), _header_path(lines[i + 1][4:]))
        if fp.old_path is None and fp.new_path is None:
            raise PatchError(f"line {i + 1}: both sides are /dev/null")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            i = _parse_hunk(lines, i, fp)
        if not fp.hunks:
            raise PatchError(f"line {i + 1}: the patch of {fp.path} has no hunk ('@@ -l,n +l,n @@')")
        patches.append(fp)
    if not patches:
        raise PatchError("no unified diff found: it needs '--- a/<path>', '+++ b/<path>' and '@@' hunks")
    return patches


def _parse_hunk(lines: list[str], i: int, fp: FilePatch) -> int:
    m = _HUNK.match(lines[i])
    if not m:
        raise PatchError(f"line {i + 1}: not a hunk header: {lines[i].rstrip()[:80]!r}")
    old_n = 1 if m.group(2) is None else int(m.group(2))
    new_n = 1 if m.group(4) is None else int(m.group(4))
    hunk = Hunk(int(m.group(1)))
    start = i + 1
    i += 1
    last: list[str] | None = None  # the side(s) the previous line went to
    while len(hunk.old) < old_n or len(hunk.new) < new_n:
        if i >= len(lines):
            raise PatchError(f"line {start}: the hunk ends early: its header counts {old_n} old and {new_n} "
                             f"new lines, the diff has {len(hunk.old)} and {len(hunk.new)}")
        line = lines[i]
        body = line[1:] if line[:1] in " -+" else ("\n" if line in ("\n", "\r\n") else None)
        if line.startswith(_NO_NEWLINE):
            _drop_newline(hunk, last)
        elif body is None:
            raise PatchError(f"line {i + 1}: a hunk line starts with ' ', '-' or '+', got {line.rstrip()[:80]!r}")
        elif line[:1] == "-":
            hunk.old.append(body)
            last = [hunk.old]
        elif line[:1] == "+":
            hunk.new.append(body)
            last = [hunk.new]
        else:  # context (a blank line is context whose space was stripped)
            hunk.old.append(body)
            hunk.new.append(body)
            last = [hunk.old, hunk.new]
        i += 1
    if len(hunk.old) != old_n or len(hunk.new) != new_n:
        raise PatchError(f"line {start}: the hunk's lines do not match its header's counts")
    if i < len(lines) and lines[i].startswith(_NO_NEWLINE):
        _drop_newline(hunk, last)
        i += 1
    fp.hunks.append(hunk)
    return i


def _drop_newline(hunk: Hunk, last: list[list[str]] | None) -> None:
    for side in last or ():
        if side and side[-1].endswith("\n"):
            side[-1] = side[-1][:-1]


def _apply_hunks(text: str, fp: FilePatch) -> str:
    lines = text.splitlines(keepends=True)
    shift = 0  # how far earlier hunks moved the lines after them
    floor = 0  # a hunk applies after the previous one
    for n, hunk in enumerate(fp.hunks, 1):
        want = max(hunk.old_start - 1, 0) + shift
        at = _find(lines, hunk.old, want, floor)
        if at is None:
            raise PatchError(f"{fp.path}: hunk {n} (@@ -{hunk.old_start}) does not match the file: its "
                             "' ' and '-' lines must be the file's lines exactly")
        lines[at:at + len(hunk.old)] = hunk.new
        shift += (at - want) + len(hunk.new) - len(hunk.old)
        floor = at + len(hunk.new)
    return "".join(lines)


def _find(lines: list[str], block: list[str], want: int, floor: int) -> int | None:
    """The start nearest `want` (not before `floor`) where `block` matches `lines`."""
    if not block:
        return min(max(want, floor), len(lines))
    starts = [at for at in range(floor, len(lines) - len(block) + 1)
              if lines[at] == block[0] and lines[at:at + len(block)] == block]
    return min(starts, key=lambda at: (abs(at - want), at), default=None)


def apply_patch(root: Path, text: str) -> str:
    """Apply the unified diff `text` to the repository `root`; returns a one-line summary.

    Raises PatchError (nothing written) for a malformed diff (parse_patch), a refused
    path (`resolve`), a hunk that does not match, a created file that exists, a changed
    or deleted file that does not, a deletion that leaves lines, or a file over
    MAX_FILE_BYTES."""
    changes: dict[Path, str | None] = {}
    for fp in parse_patch(text):
        rel = fp.path
        path = resolve(root, rel)
        if fp.old_path is not None and fp.new_path is not None and \
                resolve(root, fp.old_path) != path:
            raise PatchError(f"{fp.old_path} -> {fp.new_path}: renames are not supported")
        if fp.old_path is None:
            if path.exists() or path.is_symlink() or path in changes:
                raise PatchError(f"{rel}: the patch creates it, but it exists")
            old = ""
        elif path in changes:
            old = changes[path]
            if old is None:
                raise PatchError(f"{rel}: patched after the patch deleted it")
        else:
            old = read_text(path, rel)
        new = _apply_hunks(old, fp)
        if fp.new_path is None and new:
            raise PatchError(f"{rel}: the patch deletes it but leaves lines in it")
        changes[path] = None if fp.new_path is None else new
    write_all(root, changes)
    names = ", ".join(sorted({str(p.relative_to(root)) for p in changes}))
    return f"Patched {names}."
