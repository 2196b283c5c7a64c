"""What a tenant's job may name (services/core/access.py): files only in the tenant's
area and the checkpoints of the tenant's own jobs (symlinks, `..` and `~` resolved
first), models by known name, hub id or such a path; an admin may name anything; the
owner of a job and their jobs as read from KV."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nats.js.errors import KeyNotFoundError

from opentinker.schemas import JobRecord, JobSpec, encode
from opentinker.schemas import subjects as S
from opentinker.schemas.job import SpecError
from opentinker.schemas.users import User
from opentinker.services.core.access import (
    USER_RE, Tenant, check_model_ref, check_spec_paths, confine_path, is_admin, jobs_of, tenant_of_job,
    user_area,
)
from opentinker.services.core.models import DEFAULT_MODEL

OWN, OTHER = "alice-job", "bob-job"


@pytest.fixture
def home(tmp_path):
    """A home with alice's and bob's areas and a final export of one job of each."""
    h = tmp_path / "home"
    for user in ("alice", "bob"):
        (h / "users" / user).mkdir(parents=True)
        (h / "users" / user / "data.jsonl").write_text("{}\n")
    for job in (OWN, OTHER):
        (h / "checkpoints" / job / "final").mkdir(parents=True)
    (h / "users" / "alice-evil").mkdir()
    return h


def alice(home, admin=False):
    return {"user": "alice", "admin": admin, "home": home, "own_jobs": {OWN}}


def refused(path, home, field="sft_data") -> SpecError:
    with pytest.raises(SpecError) as e:
        confine_path(str(path), field=field, **alice(home))
    assert e.value.field == field
    # the reason names where files may be
    assert f"{home}/users/alice/" in e.value.reason and f"{home}/checkpoints/<job>/" in e.value.reason
    return e.value


def test_a_tenant_names_files_only_in_their_area_and_own_checkpoints(home):
    area = user_area(home, "alice")
    assert area == home / "users" / "alice"
    # relative paths start in the area
    assert confine_path("data.jsonl", field="sft_data", **alice(home)) == area / "data.jsonl"
    assert confine_path("sub/../data.jsonl", field="sft_data", **alice(home)) == area / "data.jsonl"
    assert confine_path(str(area / "data.jsonl"), field="sft_data", **alice(home)) == area / "data.jsonl"
    own = home / "checkpoints" / OWN / "final"
    assert confine_path(str(own), field="model", **alice(home)) == own

    refused(home / "checkpoints" / OTHER / "final", home)           # another tenant's export
    refused(home / "checkpoints" / OWN / ".." / OTHER / "final", home)
    refused(home / "users" / "bob" / "data.jsonl", home)            # another tenant's area
    refused(home / "users" / "alice-evil" / "data.jsonl", home)     # a name that only starts the same
    refused("/etc/passwd", home)
    refused("../../x", home)
    refused("../bob/data.jsonl", home)
    refused("~root/x", home)
    refused("~/x", home)
    refused(home / "nats" / "auth" / "service.nk", home)
    refused(home / "checkpoints", home)


def test_a_symlink_in_the_area_pointing_outside_is_refused(home, tmp_path):
    area = user_area(home, "alice")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text("secret\n")
    (area / "link").symlink_to(outside)
    (area / "bobs").symlink_to(home / "checkpoints" / OTHER)
    (area / "file-link.jsonl").symlink_to(outside / "secret.jsonl")
    e = refused("link/secret.jsonl", home)
    assert str(outside) not in str(e)  # the link's target is not disclosed
    refused("bobs/final", home, field="model")
    refused("file-link.jsonl", home)
    # a link that stays inside is fine
    (area / "alias.jsonl").symlink_to(area / "data.jsonl")
    assert confine_path("alias.jsonl", field="sft_data", **alice(home)) == area / "data.jsonl"


def test_an_admin_names_any_path(home):
    for p in ("/etc/passwd", str(home / "checkpoints" / OTHER / "final"), "../../x"):
        assert confine_path(p, field="sft_data", **alice(home, admin=True)) == Path(p)
    assert confine_path("~root/x", field="sft_data", **alice(home, admin=True)) == Path(os.path.expanduser("~root/x"))
    spec = JobSpec(algorithm="sft", model=str(home / "checkpoints" / OTHER / "final"), sft_data="/etc/passwd")
    check_spec_paths(spec, **alice(home, admin=True))


def test_models_are_known_names_hub_ids_or_confined_paths(home, monkeypatch):
    assert check_model_ref(DEFAULT_MODEL, **alice(home)) == DEFAULT_MODEL
    for hub in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B", "org/name.v1_x"):
        assert check_model_ref(hub, **alice(home)) == hub
    own = home / "checkpoints" / OWN / "final"
    assert check_model_ref(str(own), **alice(home)) == str(own)
    assert check_model_ref("./my-model", **alice(home)) == str(user_area(home, "alice") / "my-model")
    for bad in (str(home / "checkpoints" / OTHER / "final"), "/etc", "../bob", "~root/x", "org/../../bob"):
        with pytest.raises(SpecError) as e:
            check_model_ref(bad, **alice(home))
        assert e.value.field == "model" and "outside the places" in e.value.reason
    # a hub-like name that is also a folder under the working directory would be loaded
    # from there by from_pretrained: it is taken as a path in the area instead
    monkeypatch.chdir(home / "checkpoints")
    assert check_model_ref(f"{OTHER}/final", **alice(home)) == str(user_area(home, "alice") / OTHER / "final")
    assert check_model_ref(f"{OTHER}/final", **alice(home, admin=True)) == f"{OTHER}/final"


def test_spec_paths_name_the_field(home):
    ok = JobSpec(algorithm="sft", model="HuggingFaceTB/SmolLM2-135M", sft_data="data.jsonl")
    checked = check_spec_paths(ok, **alice(home))  # the form the services are given
    assert checked == {"model": "HuggingFaceTB/SmolLM2-135M", "sft_data": str(user_area(home, "alice") / "data.jsonl")}
    check_spec_paths(JobSpec(), **alice(home))  # the defaults
    with pytest.raises(SpecError) as e:
        check_spec_paths(JobSpec(model=str(home / "checkpoints" / OTHER / "final")), **alice(home))
    assert e.value.field == "model" and str(e.value).startswith("invalid job spec: `model`:")
    with pytest.raises(SpecError) as e:
        check_spec_paths(JobSpec(algorithm="sft", sft_data="/etc/passwd"), **alice(home))
    assert e.value.field == "sft_data"
    # a distillation teacher's model is read by the rollout worker: the same rules as `model`
    teach = dict(teacher="model", distill_coef=1.0)
    check_spec_paths(JobSpec(teacher_model="HuggingFaceTB/SmolLM2-360M-Instruct", **teach), **alice(home))
    for theirs in (str(home / "checkpoints" / OTHER / "final"), "/etc", "../../models-of-bob"):
        with pytest.raises(SpecError) as e:
            check_spec_paths(JobSpec(teacher_model=theirs, **teach), **alice(home))
        assert e.value.field == "teacher_model" and str(e.value).startswith("invalid job spec: `teacher_model`:")


def test_user_names_are_checked_before_they_become_folders(home):
    from opentinker.services.core.users import USER_RE as SCHEDULER_USER_RE

    assert USER_RE.pattern == SCHEDULER_USER_RE.pattern
    for bad in ("", "..", "a/b", "Alice"):
        with pytest.raises(ValueError, match="user: .* must match"):
            user_area(home, bad)


# -- the owner of a job, from KV ------------------------------------------------------

class FakeKV:
    def __init__(self, entries: dict[str, bytes]):
        self.entries = entries

    async def get(self, key):
        if key not in self.entries:
            raise KeyNotFoundError
        return type("Entry", (), {"value": self.entries[key], "revision": 1})()


class FakeBus:
    """The Bus calls access.py makes, over dicts."""

    def __init__(self, jobs: dict[str, bytes], users: dict[str, bytes]):
        self.buckets = {S.KV_JOBS: jobs, S.KV_USERS: users}

    async def kv(self, bucket):
        return FakeKV(self.buckets[bucket])

    async def kv_values(self, bucket, prefix=""):
        return {k: (v, 1) for k, v in self.buckets[bucket].items() if k.startswith(prefix)}

    async def job_record(self, job_id):
        from opentinker.schemas import decode

        v = self.buckets[S.KV_JOBS].get(job_id)
        return (decode(v, JobRecord), 1) if v else None


@pytest.fixture
def bus():
    def rec(job_id, user):
        return encode(JobRecord(job_id=job_id, spec=JobSpec(), user=user))

    jobs = {"a1": rec("a1", "alice"), "a2": rec("a2", "alice"), "b1": rec("b1", "bob"),
            "r1": rec("r1", "root"), "op": rec("op", ""), "junk": b"\xc1not msgpack"}
    users = {"alice": encode(User(name="alice")), "bob": encode(User(name="bob")),
             "root": encode(User(name="root", role="admin")),
             "gone": encode(User(name="gone", role="admin", disabled=True)), "bad": b"\xc1"}
    return FakeBus(jobs, users)


async def test_jobs_and_roles_come_from_kv(bus):
    assert await jobs_of(bus, "alice") == {"a1", "a2"}  # the undecodable record is skipped
    assert await jobs_of(bus, "nobody") == set()
    assert await is_admin(bus, "root") is True
    for user in ("alice", "gone", "bad", "nobody", "../x"):
        assert await is_admin(bus, user) is False


async def test_the_tenant_of_a_job(bus):
    t = await tenant_of_job(bus, "a1")
    assert t == Tenant(user="alice", admin=False, own_jobs=frozenset({"a1", "a2"}))
    assert t.log_jobs == {"a1", "a2"} and t.rules("/h") == {"user": "alice", "admin": False, "home": "/h",
                                                             "own_jobs": frozenset({"a1", "a2"})}
    root = await tenant_of_job(bus, "r1")
    assert root.admin and root.log_jobs is None
    # no record, or no user on it: an operator's job, everything allowed
    for job in ("missing", "op"):
        op = await tenant_of_job(bus, job)
        assert op.admin and op.user == "" and op.log_jobs is None


def test_an_operator_envs_path_arguments_are_confined_and_refused_alike_whether_they_exist_or_not(home):
    from opentinker.services.core.access import confine_env_args, path_args

    assert path_args({"data_dir": "a", "cache_path": "b", "file": "c", "size": 3, "dirt": "x"}) == [
        "cache_path", "data_dir", "file"]
    got = confine_env_args({"data_dir": "sums", "n": 3}, **alice(home))  # relative: from her area
    assert got == {"data_dir": str((home / "users" / "alice" / "sums").resolve()), "n": 3}
    assert confine_env_args({"data_dir": "/anything"}, **alice(home, admin=True))["data_dir"] == "/anything"
    refusals = []
    for target in (home / "users" / "bob", home / "users" / "bob" / "no-such-folder", "/etc",
                   home / "users" / "alice" / ".." / "bob"):
        with pytest.raises(SpecError) as e:
            confine_env_args({"data_dir": str(target)}, **alice(home))
        assert e.value.field == "env_args.data_dir"
        refusals.append(str(e.value).replace(repr(str(target)), "<path>"))
    assert len(set(refusals)) == 1, refusals  # the answer says nothing about what exists there
    with pytest.raises(SpecError, match="must be a path"):
        confine_env_args({"data_dir": ["/etc"]}, **alice(home))


async def test_an_operator_envhost_refuses_a_path_argument_outside_the_jobs_owners_places(home):
    from opentinker.schemas import EnvInitRequest, EnvResetRequest
    from opentinker.services.core.access import confine_env_args
    from opentinker.services.envhost.envs.arith import ArithGame
    from opentinker.services.envhost.service import EnvHost

    host = EnvHost({"arith": ArithGame}, "h1", 2, 60.0)

    async def confine(job_id, env_args):
        return confine_env_args(env_args, **alice(home))

    host.confine = confine
    try:
        bad = {"data_dir": str(home / "users" / "bob")}
        init = await host.init("arith", EnvInitRequest(env="arith", env_args=bad, job_id=OWN), None)
        reset = await host.reset("arith", EnvResetRequest(env="arith", episode_id="e", job_id=OWN, env_args=bad), None)
        for reply in (init, reset):
            assert reply.error.startswith("`env_args.data_dir`") or "env_args.data_dir" in reply.error, reply
        assert not host.episodes
    finally:
        host.shutdown()
