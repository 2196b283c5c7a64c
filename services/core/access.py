"""What a tenant's job may name: files, models and rows of the trajectory log.

A tenant (a user with a valid API key) puts paths (`model`, `sft_data`, an operator's
env's path arguments such as `env_args.data_dir`) and SQL
(`sft_query`) in a job spec, and the services act on them with their own rights on the
service machines. The rules here confine that:
- files: the tenant's area `<home>/users/<user>/` (where an operator puts a tenant's
  datasets and models; a relative path is taken from there) and the checkpoint folders
  `<home>/checkpoints/<job>/` of the tenant's own jobs; symlinks and `..` are resolved
  before the check;
- models: the embedded default, a Hugging Face hub id `org/name`, such a file, or a
  folder under `<home>/models/` (the operator's shared models, where the embedded
  default is converted; readable by every tenant, never a place for data);
- the log: the rows of the tenant's own jobs (logdb.run_user_query with `log_jobs`);
- endpoints an operator's env calls (`env_args.user_base_url` and other `*_url`
  arguments) and the variables holding their keys (`*_key_env`): only those on the
  envhost's allowlists (`envhost_allowed_urls`, `envhost_allowed_key_envs`), checked by
  the operator's envhost (check_endpoint_args).
An admin (User.role "admin" in KV `ot_users`), and an operator running a job with no
scheduler record, may name anything.

The scheduler checks a spec when it is submitted (check_spec_paths); the learner checks
it again when the job starts, against the owner in the job's record (`ot_jobs`), so a
spec that reached the learner some other way gets the same rules.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from opentinker.schemas import JobRecord, JobSpec, decode
from opentinker.schemas import subjects as S
from opentinker.schemas.job import JOB_ID_RE, SpecError
from opentinker.schemas.users import USER_NAME_RE, User
from opentinker.services.core.models import DEFAULT_MODEL

# the scheduler's user-name rule: a name becomes a folder name here
USER_RE = USER_NAME_RE
# `org/name` on the Hugging Face hub; a token never starts with "." so it is never "." or ".."
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# model names resolve_model knows without a path or the hub
KNOWN_MODELS = frozenset({DEFAULT_MODEL})


def user_area(home: str | Path, user: str) -> Path:
    """`<home>/users/<user>/`: the one folder whose files a tenant's spec may name.

    Raises ValueError naming `user` when it is not a valid user name (it becomes a
    folder name)."""
    if not USER_RE.match(user):
        raise ValueError(f"user: {user!r} must match {USER_RE.pattern}")
    return Path(home) / "users" / user


def _allowed(home: str | Path, user: str, own_jobs: Iterable[str]) -> list[Path]:
    roots = [user_area(home, user)]
    roots += [Path(home) / "checkpoints" / j for j in sorted(own_jobs) if JOB_ID_RE.match(j)]
    return [Path(os.path.realpath(r)) for r in roots]


def confine_path(path: str, *, field: str, user: str, admin: bool, home: str | Path,
                 own_jobs: Iterable[str]) -> Path:
    """The file or folder `path` names, if `user` may name it.

    An admin may name any path (`~` expanded, returned as given otherwise). For anyone
    else a relative path is taken from user_area(home, user), and the real path (`~`
    expanded, symlinks and `..` resolved; the file need not exist yet) must lie inside
    that area or inside `<home>/checkpoints/<job>/` of one of `own_jobs`; the real path
    is returned, so what is used later is what was checked.

    Raises SpecError(field, ...) naming the allowed places otherwise (never the target
    of a symlink or anything read from a file); ValueError for an invalid user name.
    """
    if admin:
        return Path(path).expanduser()
    area = user_area(home, user)
    p = Path(path).expanduser()
    real = Path(os.path.realpath(p if p.is_absolute() else area / p))
    if any(real.is_relative_to(root) for root in _allowed(home, user, own_jobs)):
        return real
    raise SpecError(field, f"{path!r} is outside the places a job of {user!r} may name files: "
                           f"{area}/ (relative paths start there) and {Path(home) / 'checkpoints'}"
                           "/<job>/ of the user's own jobs")


def check_model_ref(model: str, *, user: str, admin: bool, home: str | Path,
                    own_jobs: Iterable[str], field: str = "model") -> str:
    """`model` as the learner should load it: a known name (the embedded default) or a
    Hugging Face hub id `org/name` unchanged, anything else as a path confined by
    confine_path (the real path is returned, admin: `~` expanded).

    A hub id that also names a folder relative to this process's working directory is
    taken as a path (from_pretrained would load that folder, not the hub's model).
    Raises SpecError(field, ...) for a path the user may not name (`field`: the spec's
    field that names it, "model" or "teacher_model").
    """
    if model in KNOWN_MODELS:
        return model
    if HUB_ID_RE.match(model) and ".." not in model and (admin or not os.path.exists(model)):
        return model
    shared = Path(os.path.realpath(Path(home) / "models"))
    real = Path(os.path.realpath(Path(model).expanduser()))
    if not admin and Path(model).expanduser().is_absolute() and real.is_relative_to(shared) and real != shared:
        return str(real)  # the operator's shared models (module docstring)
    return str(confine_path(model, field=field, user=user, admin=admin, home=home, own_jobs=own_jobs))


def check_spec_paths(spec: JobSpec, *, user: str, admin: bool, home: str | Path,
                     own_jobs: Iterable[str]) -> dict[str, str]:
    """Check that `user` may name the spec's `model`, `teacher_model` and `sft_data` (when
    set); the scheduler calls this when a job is submitted, with the submitter's name, role
    (`admin`), `home` and the ids of the submitter's jobs (`own_jobs`, see jobs_of).

    Returns the checked form of each field set, {field: value} (check_model_ref's,
    confine_path's real path), which is what the services are to read. Raises SpecError
    naming the field ("model", "teacher_model" or "sft_data") and the allowed places.
    """
    rules = dict(user=user, admin=admin, home=home, own_jobs=own_jobs)
    checked = {"model": check_model_ref(spec.model, **rules)}
    if spec.teacher_model:  # read by the rollout worker, as `model` is
        checked["teacher_model"] = check_model_ref(spec.teacher_model, field="teacher_model", **rules)
    if spec.sft_data:
        checked["sft_data"] = str(confine_path(spec.sft_data, field="sft_data", **rules))
    return checked


PATH_ARG_SUFFIXES = ("_dir", "_path", "_file", "_folder")


def path_args(env_args: dict[str, Any]) -> list[str]:
    """The keys of `env_args` that name a path on the envhost's machine: `path`, `dir`,
    `file`, or a name ending in _dir, _path, _file or _folder (e.g. `data_dir`)."""
    return sorted(k for k in env_args if k in ("path", "dir", "file") or k.endswith(PATH_ARG_SUFFIXES))


def confine_env_args(env_args: dict[str, Any], *, user: str, admin: bool, home: str | Path,
                     own_jobs: Iterable[str]) -> dict[str, Any]:
    """`env_args` with every path argument (path_args) replaced by the real path it
    names, when `user` may name it (confine_path: the user's area, their own jobs'
    checkpoints; an admin anything). An operator's env reads such a path on a service
    host, so it is confined like `sft_data`.

    Raises SpecError("env_args.<key>", ...) for a path outside those places or a value
    that is not a string; the message is the same whether the path exists or not."""
    out = dict(env_args)
    for key in path_args(env_args):
        value = env_args[key]
        if value is None:
            continue
        if not isinstance(value, str):
            raise SpecError(f"env_args.{key}", f"must be a path (a string), got {type(value).__name__}")
        out[key] = str(confine_path(value, field=f"env_args.{key}", user=user, admin=admin, home=home,
                                    own_jobs=own_jobs))
    return out


# -- endpoints an operator's env calls for a tenant ---------------------------------

def url_args(env_args: dict[str, Any]) -> list[str]:
    """The keys of `env_args` that name a URL the env calls from the envhost's machine:
    `url` or a name ending in _url (e.g. `user_base_url`)."""
    return sorted(k for k in env_args if k == "url" or k.endswith("_url"))


def key_env_args(env_args: dict[str, Any]) -> list[str]:
    """The keys of `env_args` that name an environment variable of the envhost's
    process holding a secret: a name ending in _key_env (e.g. `user_api_key_env`)."""
    return sorted(k for k in env_args if k.endswith("_key_env"))


def _origin(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host lower-cased, port, path without a trailing "/") of an http(s) URL
    with a host and no user info; None for anything else."""
    try:
        u = urlsplit(url.strip())
        port = u.port or {"http": 80, "https": 443}.get(u.scheme.lower(), 0)
    except ValueError:
        return None
    if u.scheme.lower() not in ("http", "https") or not u.hostname or "@" in u.netloc:
        return None
    return u.scheme.lower(), u.hostname.lower(), port, u.path.rstrip("/")


def url_allowed(url: str, allowed_urls: Iterable[str]) -> bool:
    """Whether `url` lies under one of `allowed_urls`: the same scheme, host and port
    (80 / 443 when not written), and a path equal to the entry's or below it on a "/"
    boundary (`.../v1` allows `.../v1/jobs/x`, never `.../v1x`). A URL with user info
    (`https://allowed@evil`) or not http(s) is never allowed."""
    got = _origin(url)
    if got is None:
        return False
    for entry in allowed_urls:
        want = _origin(entry)
        if want and got[:3] == want[:3] and (got[3] == want[3] or got[3].startswith(want[3] + "/")):
            return True
    return False


def check_endpoint_args(env_args: dict[str, Any], *, admin: bool, allowed_urls: Iterable[str],
                        allowed_key_envs: Iterable[str]) -> dict[str, Any]:
    """`env_args` unchanged, if a job's owner may have an operator's env call their URL
    arguments (url_args) with the secrets their key arguments (key_env_args) name.

    An operator's envhost runs the env on a service host: a tenant's URL could reach the
    operator's internal network (a metadata service, the bus's monitor), and a variable
    name could send one of the host's secrets anywhere. So a job of a non-admin may name
    only URLs under the operator's `envhost_allowed_urls` (url_allowed) and variables in
    `envhost_allowed_key_envs`; an admin, and the operator's own job, anything. A tenant's
    own envhost (on their machine) does not call this.

    Raises SpecError("env_args.<key>", ...) naming the setting to change, or for a value
    that is not a string."""
    allowed_urls, allowed_key_envs = tuple(allowed_urls), frozenset(allowed_key_envs)
    for key in url_args(env_args) + key_env_args(env_args):
        value = env_args[key]
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise SpecError(f"env_args.{key}", f"must be a string, got {type(value).__name__}")
        if admin:
            continue
        if key.endswith("_key_env"):
            if value not in allowed_key_envs:
                raise SpecError(f"env_args.{key}", f"{value[:80]!r} is not a variable this envhost lends to "
                                                   "jobs (the operator's setting envhost_allowed_key_envs)")
        elif not url_allowed(value, allowed_urls):
            raise SpecError(f"env_args.{key}", f"{value[:200]!r} is not under a URL this envhost may call for "
                                               "a job (the operator's setting envhost_allowed_urls: "
                                               f"{' '.join(allowed_urls) or 'none'})")
    return env_args


def split_setting(value: str) -> tuple[str, ...]:
    """A list setting written as one string: entries separated by commas or whitespace."""
    return tuple(x for x in value.replace(",", " ").split() if x)


# -- who owns a job (over the bus) ----------------------------------------------

async def jobs_of(bus: Any, user: str) -> set[str]:
    """The ids of every job of `user` in KV `ot_jobs` (records that do not decode are
    skipped). `bus`: a services.core.bus.Bus."""
    out = set()
    for value, _ in (await bus.kv_values(S.KV_JOBS)).values():
        try:
            rec = decode(value, JobRecord)
        except msgspec.MsgspecError:
            continue
        if rec.user == user:
            out.add(rec.job_id)
    return out


async def is_admin(bus: Any, user: str) -> bool:
    """Whether `user` is an enabled admin in KV `ot_users` (False for a missing or
    unreadable record). `bus`: a services.core.bus.Bus."""
    from nats.js.errors import KeyNotFoundError

    if not USER_RE.match(user):
        return False
    try:
        entry = await (await bus.kv(S.KV_USERS)).get(user)
    except KeyNotFoundError:
        return False
    try:
        rec = decode(entry.value, User) if entry.value else None
    except msgspec.MsgspecError:
        return False
    return rec is not None and rec.role == "admin" and not rec.disabled


@dataclass(frozen=True)
class Tenant:
    """Whose job this is, for the rules above. `user` "" with `admin` True: an operator's
    job with no scheduler record."""

    user: str
    admin: bool
    own_jobs: frozenset[str] = frozenset()

    @property
    def log_jobs(self) -> frozenset[str] | None:
        """The jobs whose log rows this tenant's SQL may read; None: every job."""
        return None if self.admin else self.own_jobs

    def rules(self, home: str | Path) -> dict[str, Any]:
        """The keyword arguments of confine_path, check_model_ref, check_spec_paths."""
        return {"user": self.user, "admin": self.admin, "home": home, "own_jobs": self.own_jobs}


async def tenant_of_job(bus: Any, job_id: str) -> Tenant:
    """The owner of `job_id` from its record in KV `ot_jobs`: an admin, or a user with
    the ids of their jobs. A job with no record, or a record with no user (run without
    a scheduler, by an operator), counts as an admin's.

    Raises msgspec.MsgspecError for an unreadable record (the job must not run on a
    guess)."""
    got = await bus.job_record(job_id)
    if got is None or not got[0].user:
        return Tenant(user="", admin=True)
    user = got[0].user
    if await is_admin(bus, user):
        return Tenant(user=user, admin=True)
    return Tenant(user=user, admin=False, own_jobs=frozenset(await jobs_of(bus, user)))
