"""`simulated-user`: multi-turn. The policy plays a support assistant; a model behind an
OpenAI-compatible chat-completions endpoint plays a customer with a persona and a goal
(a refund for order #1234, a laptop under $800), as tau-bench's user simulator
(Yao et al. 2024, arXiv 2406.12045) and upstream OpenTinker's LLM-user env do.

An episode: the scenario's fixed opening line is the first user message (fixed, so
every episode of a GRPO group starts from the same prompt); each turn the policy's reply
goes to the simulated user (its persona as the system prompt, then the conversation with
roles flipped: its own lines as "assistant", the policy's as "user"), and its answer is
the next observation. The episode ends when the user writes a stop marker (`###DONE###`:
goal met; `###STOP###`: giving up, tau-bench's marker) or after `max_turns` replies of
the policy. Reward, on the last turn only (0 before):
- `reward = "rule"` (default): 1.0 when the assistant's replies, taken together, contain
  every `required` fact of the scenario (each one phrase or a list of alternatives;
  case-insensitive substrings, whitespace collapsed) and no `forbidden` phrase, else 0.0;
- `reward = "judge"`: a judge model (the same endpoint unless `judge_*` say otherwise)
  reads the transcript and the scenario's yes/no `rubric`, at temperature 0; exactly
  "YES" gives 1.0, exactly "NO" 0.0 (case and a final "." aside), anything else 0.0 with
  info `judge_verdict = "unparsed"`.

Scenarios: BUILTIN_SCENARIOS below, or the `scenarios_file` (JSON Lines, one Scenario
object a line). Held out: `splits.HeldOut` over the scenario ids (10 built-in: 2 test;
under 5 scenarios none, and "test" asks the train ones).

Endpoint: `user_base_url` (e.g. `http://127.0.0.1:8000/v1`; `/chat/completions` is
appended), `user_model`, and the API key read from the environment variable named by
`user_api_key_env` (a key itself is never an env_arg). On an operator's envhost a
non-admin job's URLs and variable names must be on the operator's allowlists
(`envhost_allowed_urls`, `envhost_allowed_key_envs`; services/core/access.py); a
tenant's own envhost calls any URL. An endpoint that is unreachable, slow past
`timeout_s`, answers an HTTP error, a reply over MAX_REPLY_BYTES or one that is not a
chat completion raises EndpointError naming the URL: the envhost ends that episode with
the reason and keeps serving. A step may call the user and then the judge, so keep
2 x `timeout_s` under the rollout's `env_step_timeout_s` (120 s).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import httpx
import msgspec

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.splits import HeldOut, check_split

STOP_MARKERS = ("###DONE###", "###STOP###")
#: the largest endpoint reply read (bytes); a larger one fails the step
MAX_REPLY_BYTES = 1 << 20
#: the assistant's first line, as the simulated user sees it (tau-bench's convention:
#: strict chat templates want a conversation to start with a user message)
GREETING = "Hi! How can I help you today?"
ENV_VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REWARDS = ("rule", "judge")


class Scenario(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One customer. `persona`: who they are and how they talk; `goal`: what they want
    (both only the simulated user reads); `opening`: their first message; `context`:
    what the assistant is told (store policy, a catalogue), appended to its system
    prompt; `required`: facts the assistant must say, each a phrase or a list of
    alternative phrasings; `forbidden`: phrases it must not say; `rubric`: the judge's
    yes/no question (default: whether the goal was met)."""

    id: str
    persona: str
    goal: str
    opening: str
    context: str = ""
    required: list[str | list[str]] = []
    forbidden: list[str] = []
    rubric: str = ""

    def alternatives(self) -> list[list[str]]:
        return [[r] if isinstance(r, str) else list(r) for r in self.required]


def _s(id: str, persona: str, goal: str, opening: str, context: str, required: list, rubric: str) -> Scenario:
    return Scenario(id=id, persona=persona, goal=goal, opening=opening, context=context, required=required,
                    rubric=rubric)


BUILTIN_SCENARIOS: tuple[Scenario, ...] = (
    _s("refund-1234", "Sam, polite but busy; bought headphones that arrived with a cracked ear cup.",
       "Get a refund for order #1234 and learn when the money arrives.",
       "Hi, my headphones arrived broken and I'd like my money back.",
       "Damaged items are refunded in full within 30 days of delivery, to the original payment method, "
       "arriving in 5-7 business days.",
       ["1234", ["refund"], ["5-7 business days", "5 to 7 business days", "five to seven business days"]],
       "Did the assistant confirm a refund for order #1234 and say it arrives in 5-7 business days?"),
    _s("laptop-under-800", "Priya, a student; needs a light laptop with 16 GB of memory and has at most $800.",
       "Get one laptop recommended that fits the budget and has 16 GB of memory.",
       "Can you recommend a laptop for university? My budget is tight.",
       "Catalogue: Breeze 13 ($599, 8 GB, 1.2 kg); Aero 14 ($749, 16 GB, 1.3 kg); Titan 16 ($1,299, 32 GB, 2.4 kg).",
       ["Aero 14"], "Did the assistant recommend the Aero 14?"),
    _s("password-reset", "Lee, locked out of their account, a little anxious.",
       "Find out how to reset the password and how long the link works.",
       "I can't log in to my account anymore.",
       "Passwords are reset with the 'Forgot password' link on the sign-in page; the emailed link works for 24 hours.",
       [["forgot password"], ["24 hours", "24 hour", "one day"]],
       "Did the assistant explain the 'Forgot password' link and that it works for 24 hours?"),
    _s("address-5521", "Maria, moved house last week.",
       "Change the delivery address of order #5521 to 12 Elm Street.",
       "I need to change where my order is going.",
       "An address can be changed until the order ships. Order #5521 has not shipped yet.",
       ["5521", ["12 Elm Street", "12 Elm St"]],
       "Did the assistant change order #5521's address to 12 Elm Street?"),
    _s("cancel-subscription", "Tom, cutting costs, terse.",
       "Cancel the premium subscription and know until when it still works.",
       "How do I cancel my premium plan?",
       "Subscriptions are cancelled under Settings > Billing; premium stays active until the end of the "
       "current billing period.",
       [["Settings"], ["Billing"], ["end of the current billing period", "end of the billing period",
                                     "end of your billing period", "end of your current billing period"]],
       "Did the assistant say where to cancel and that premium lasts until the end of the billing period?"),
    _s("vegetarian-dinner", "Ana, hosting friends tonight, one of them vegetarian, little time.",
       "Get one vegetarian main dish from the menu that takes under 30 minutes.",
       "I need a quick dinner idea from your recipe kits, one guest is vegetarian.",
       "Recipe kits: Beef Ragu (45 min); Chickpea Curry (25 min, vegetarian); Mushroom Risotto "
       "(40 min, vegetarian); Salmon Bowl (20 min).",
       ["Chickpea Curry"], "Did the assistant suggest the Chickpea Curry?"),
    _s("flight-rebook", "Jo, flight AB123 was cancelled, frustrated.",
       "Be rebooked on the next flight without paying a fee.",
       "My flight got cancelled, what now?",
       "Passengers of a cancelled flight are rebooked free of charge on the next flight with seats; "
       "for AB123 that is AB125 tomorrow at 08:10.",
       ["AB125", ["free", "no fee", "no charge", "no extra cost", "at no cost"]],
       "Did the assistant rebook onto AB125 and say it costs nothing?"),
    _s("warranty-claim", "Kai, their coffee machine stopped heating after 14 months.",
       "Start a warranty claim.",
       "My coffee machine stopped working, is it still covered?",
       "Machines have a 2-year warranty; a claim needs the serial number from the label under the tank.",
       [["serial number"], ["2-year", "2 year", "two-year", "two year", "2 years", "two years"]],
       "Did the assistant say the 2-year warranty covers it and ask for the serial number?"),
    _s("track-7788", "Ben, waiting for a birthday present.",
       "Get the tracking number of order #7788.",
       "Where is my package? It was supposed to come yesterday.",
       "Order #7788 shipped with UPS, tracking number 1Z999AA10123456784, expected tomorrow.",
       ["1Z999AA10123456784"], "Did the assistant give the tracking number 1Z999AA10123456784?"),
    _s("late-checkout", "Noor, a hotel guest with a late flight.",
       "Arrange a late checkout and learn its time and price.",
       "Hi, my flight leaves in the evening. Can I keep my room a bit longer?",
       "Late checkout is available until 2 pm for $25.",
       [["2 pm", "2pm", "14:00", "2:00 pm", "2 p.m."], ["$25", "25 dollars"]],
       "Did the assistant offer late checkout until 2 pm for $25?"),
)


class EndpointError(RuntimeError):
    """A chat-completions endpoint could not give a reply; the message names the URL."""


class _Message(msgspec.Struct):
    content: str


class _Choice(msgspec.Struct):
    message: _Message


class _Completion(msgspec.Struct):
    choices: list[_Choice]


_COMPLETION = msgspec.json.Decoder(_Completion)


class ChatEndpoint:
    """One OpenAI-compatible chat-completions endpoint: POST `<base_url>/chat/completions`.

    `field`: the env_arg naming the URL, used in errors; `api_key_env`: the environment
    variable holding the bearer token ("" for none), read when the env is built;
    `timeout_s`: the limit of each of connect, write and each read.
    Raises ValueError naming the field for a URL that is not http(s), or a variable that
    is not set."""

    def __init__(self, field: str, base_url: str, model: str, api_key_env: str, timeout_s: float):
        self.field, self.model, self.timeout_s = field, model, timeout_s
        if not isinstance(base_url, str) or not re.match(r"^https?://[^/\s]+", base_url):
            raise ValueError(f"env_args.{field}: must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                             f"got {str(base_url)[:200]!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.base_url = base_url
        self.headers = {"Content-Type": "application/json"}
        key_field = field.replace("base_url", "api_key_env")
        if api_key_env:
            if not isinstance(api_key_env, str) or not ENV_VAR_RE.match(api_key_env):
                raise ValueError(f"env_args.{key_field}: must name an environment variable, got {api_key_env!r}")
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"env_args.{key_field}: the environment variable {api_key_env} is not set "
                                 "on this envhost")
            self.headers["Authorization"] = f"Bearer {key}"

    def complete(self, messages: list[dict[str, str]], *, temperature: float, max_tokens: int) -> str:
        """The reply's text to `messages` (OpenAI chat format). Raises EndpointError naming
        the URL: unreachable, no reply within timeout_s, an HTTP status other than 200, a
        reply over MAX_REPLY_BYTES, or a body that is not a chat completion with a text."""
        where = f"{self.field} {self.base_url}"
        body = {"model": self.model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens}
        try:
            # no redirects: the allowlist checked this URL, not wherever it points
            with httpx.stream("POST", self.url, json=body, headers=self.headers, timeout=self.timeout_s,
                              follow_redirects=False) as r:
                raw = bytearray()
                for chunk in r.iter_bytes():
                    raw += chunk
                    if len(raw) > MAX_REPLY_BYTES:
                        raise EndpointError(f"{where}: the reply is over {MAX_REPLY_BYTES} bytes")
                status = r.status_code
        except httpx.TimeoutException:
            raise EndpointError(f"{where}: no reply within {self.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise EndpointError(f"{where}: unreachable ({type(e).__name__}: {e})") from None
        if status != 200:
            raise EndpointError(f"{where}: HTTP {status}: {bytes(raw[:300]).decode(errors='replace')}")
        try:
            got = _COMPLETION.decode(bytes(raw))
        except msgspec.DecodeError as e:
            raise EndpointError(f"{where}: malformed reply, not a chat completion ({e})") from None
        if not got.choices:
            raise EndpointError(f"{where}: malformed reply, no choices")
        return got.choices[0].message.content


@functools.lru_cache(maxsize=16)
def _read_scenarios(path: str, mtime_ns: int) -> tuple[Scenario, ...]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(msgspec.json.decode(line, type=Scenario))
            except msgspec.DecodeError as e:
                raise ValueError(f"env_args.scenarios_file: {path}:{n}: {e}") from None
    return tuple(out)


def load_scenarios(path: str) -> tuple[Scenario, ...]:
    """The scenarios of a JSON Lines file (one Scenario a line; blank lines skipped),
    read again when the file changes. Raises ValueError naming the file and line of a
    bad record, or the file when it cannot be read, is empty or repeats an id."""
    try:
        got = _read_scenarios(path, os.stat(path).st_mtime_ns)
    except OSError as e:
        raise ValueError(f"env_args.scenarios_file: cannot read {path}: {e.strerror}") from None
    if not got:
        raise ValueError(f"env_args.scenarios_file: {path} holds no scenario")
    ids = [s.id for s in got]
    if len(set(ids)) != len(ids):
        raise ValueError(f"env_args.scenarios_file: {path} repeats a scenario id")
    return got


def _held_out(scenarios: tuple[Scenario, ...]) -> HeldOut:
    return _held_out_ids(tuple(s.id for s in scenarios))


@functools.lru_cache(maxsize=16)
def _held_out_ids(ids: tuple[str, ...]) -> HeldOut:
    return HeldOut(scenario_key(i) for i in ids)


def scenario_key(scenario_id: str) -> str:
    """The canonical key of a scenario (splits.py)."""
    return f"simulated-user:{scenario_id}"


def split_of(scenarios: tuple[Scenario, ...], scenario_id: str) -> str:
    """Which split the scenario belongs to among `scenarios`."""
    return _held_out(scenarios).split_of(scenario_key(scenario_id))


def mentions(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text`, case-insensitive, runs of whitespace as one space."""
    return " ".join(phrase.lower().split()) in " ".join(text.lower().split())


def parse_verdict(text: str) -> str:
    """"YES" or "NO" when the judge's whole reply is that word (any case, around it
    whitespace and a final "." or "!"), else "unparsed"."""
    word = text.strip().rstrip(".!").strip().upper()
    return word if word in ("YES", "NO") else "unparsed"


class SimulatedUserGame(AbstractGame):
    """Help a simulated customer (module docstring).

    env_args:
      user_base_url:     the simulated user's OpenAI-compatible endpoint, e.g.
                         http://127.0.0.1:8000/v1 (required)
      user_model:        the model name it serves (required)
      user_api_key_env:  the environment variable holding its API key (default: none)
      user_temperature:  the user's sampling temperature (default 0.0, as tau-bench)
      user_max_tokens:   the longest user line (default 256)
      reward:            "rule" (default) or "judge"
      judge_base_url, judge_model, judge_api_key_env: the judge (default: the user's)
      scenarios_file:    a JSON Lines file of scenarios (default: the 10 built-in)
      max_turns:         the policy's replies before the episode ends (default 6)
      timeout_s:         each endpoint call's limit (default 30)
    Raises ValueError naming the env_arg for a missing or bad value, an unknown one, or
    an API key given as an env_arg.
    """

    name = "simulated-user"

    def __init__(self, user_base_url: str = "", user_model: str = "", user_api_key_env: str = "",
                 user_temperature: float = 0.0, user_max_tokens: int = 256, reward: str = "rule",
                 judge_base_url: str = "", judge_model: str = "", judge_api_key_env: str = "",
                 scenarios_file: str = "", max_turns: int = 6, timeout_s: float = 30.0, **unknown: Any):
        super().__init__(user_base_url=user_base_url, user_model=user_model, reward=reward, max_turns=max_turns)
        for k in sorted(unknown):
            if "key" in k.lower() and not k.endswith("_env"):
                raise ValueError(f"env_args.{k}: an API key never goes in env_args (the job spec is stored "
                                 "and logged); put it in an environment variable of the envhost and name "
                                 "that variable in user_api_key_env / judge_api_key_env")
            raise ValueError(f"env_args.{k}: not an argument of simulated-user")
        if not user_base_url:
            raise ValueError("env_args.user_base_url: required, the simulated user's endpoint "
                             "(e.g. http://127.0.0.1:8000/v1)")
        if not user_model or not isinstance(user_model, str):
            raise ValueError("env_args.user_model: required, the model name the endpoint serves")
        if reward not in REWARDS:
            raise ValueError(f"env_args.reward: must be one of {REWARDS}, got {reward!r}")
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"env_args.max_turns: must be an integer >= 1, got {max_turns!r}")
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 600:
            raise ValueError(f"env_args.timeout_s: must be a number in (0, 600], got {timeout_s!r}")
        if not isinstance(user_max_tokens, int) or not 1 <= user_max_tokens <= 4096:
            raise ValueError(f"env_args.user_max_tokens: must be an integer in 1..4096, got {user_max_tokens!r}")
        if not isinstance(user_temperature, (int, float)) or not 0 <= user_temperature <= 2:
            raise ValueError(f"env_args.user_temperature: must be a number in [0, 2], got {user_temperature!r}")
        self.user = ChatEndpoint("user_base_url", user_base_url, user_model, user_api_key_env, timeout_s)
        self.judge = None
        if reward == "judge":
            self.judge = ChatEndpoint("judge_base_url" if judge_base_url else "user_base_url",
                                      judge_base_url or user_base_url, judge_model or user_model,
                                      judge_api_key_env if judge_base_url or judge_api_key_env else user_api_key_env,
                                      timeout_s)
        self.reward, self.max_turns = reward, max_turns
        self.user_temperature, self.user_max_tokens = float(user_temperature), user_max_tokens
        self.scenarios = load_scenarios(scenarios_file) if scenarios_file else BUILTIN_SCENARIOS
        if reward == "rule":
            for s in self.scenarios:
                if not s.required or not all(s.alternatives()):
                    raise ValueError(f"scenario {s.id!r}: `required` must list at least one fact, each with "
                                     "at least one phrasing, for reward = \"rule\" (or use reward = \"judge\")")
        self.by_id = {s.id: s for s in self.scenarios}
        self.scenario: Scenario = self.scenarios[0]
        self.turn = 0
        self.transcript: list[tuple[str, str]] = []  # ("user" | "assistant", text), in order

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"scenario": id}: a scenario of `split` (module docstring), drawn from `seed`.
        Raises ValueError for a split other than "train" or "test"."""
        check_split(split)
        ids = [s.id for s in self.scenarios]
        return {"scenario": _held_out(self.scenarios).draw(
            self.rng(f"simulated-user:{split}:{seed}"), lambda r: r.choice(ids), scenario_key, split)}

    def reset(self, scenario: str | None = None, seed: int | None = None) -> str:
        if scenario is None:
            scenario = self.generate_initial_state(seed or 0)["scenario"]
        if scenario not in self.by_id:
            raise ValueError(f"scenario: {scenario!r} is not one of this env's scenarios")
        self.scenario, self.turn = self.by_id[scenario], 0
        self.transcript = [("user", self.scenario.opening)]
        return ""

    def get_system_prompt(self) -> str:
        prompt = ("You are a helpful customer-support assistant. Answer the customer briefly and concretely, "
                  "using only the facts below.")
        return f"{prompt}\n\nFacts:\n{self.scenario.context}" if self.scenario.context else prompt

    def get_initial_user_message(self) -> str:
        return self.scenario.opening

    def get_state(self) -> dict[str, Any]:
        return {"scenario": self.scenario.id, "turn": self.turn, "transcript": [list(t) for t in self.transcript]}

    def user_messages(self) -> list[dict[str, str]]:
        """What the simulated user is sent: its persona, then the conversation with roles
        flipped (its own lines are "assistant", the policy's "user")."""
        s = self.scenario
        system = (f"You are role-playing a customer talking to a support assistant. Stay in character.\n"
                  f"Who you are: {s.persona}\nYour goal: {s.goal}\n"
                  "Write only your next message to the assistant, one or two sentences. Never act as the "
                  "assistant. Give details (order numbers, names) when asked. When your goal is fully met, "
                  "end your message with ###DONE###. If the assistant cannot help or the conversation goes "
                  "nowhere, end your message with ###STOP###.")
        flipped = {"user": "assistant", "assistant": "user"}
        return [{"role": "system", "content": system}, {"role": "user", "content": GREETING},
                *({"role": flipped[who], "content": text} for who, text in self.transcript)]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        self.transcript.append(("assistant", action))
        if self.turn >= self.max_turns:
            return self._end("The conversation has reached its turn limit.", "max_turns")
        line = self.user.complete(self.user_messages(), temperature=self.user_temperature,
                                  max_tokens=self.user_max_tokens)
        marker = next((m for m in STOP_MARKERS if m in line), "")
        if marker:
            for m in STOP_MARKERS:
                line = line.replace(m, "")
            line = line.strip()
            self.transcript.append(("user", line))
            return self._end(line, "done" if marker == "###DONE###" else "stop")
        self.transcript.append(("user", line))
        return StepResult(line, 0.0, False, {"turn": self.turn})

    def _end(self, observation: str, ended_by: str) -> StepResult:
        info: dict[str, Any] = {"turn": self.turn, "scenario": self.scenario.id, "ended_by": ended_by}
        said = "\n".join(text for who, text in self.transcript if who == "assistant")
        if self.judge is None:
            missing = [alts[0] for alts in self.scenario.alternatives() if not any(mentions(said, a) for a in alts)]
            forbidden = [p for p in self.scenario.forbidden if mentions(said, p)]
            info.update(missing=missing, forbidden=forbidden)
            reward = 1.0 if not missing and not forbidden else 0.0
        else:
            verdict = parse_verdict(self.judge.complete(self.judge_messages(), temperature=0.0, max_tokens=8))
            info["judge_verdict"] = verdict
            reward = 1.0 if verdict == "YES" else 0.0
        return StepResult(observation, reward, True, info)

    def judge_messages(self) -> list[dict[str, str]]:
        """The judge's prompt: the customer's goal, the transcript and the rubric."""
        s = self.scenario
        rubric = s.rubric or f"Did the assistant fully meet the customer's goal: {s.goal}"
        lines = "\n".join(f"{'Customer' if who == 'user' else 'Assistant'}: {text}" for who, text in self.transcript)
        return [{"role": "system", "content": "You grade conversations between a customer and a support "
                                              "assistant. Answer with exactly one word: YES or NO."},
                {"role": "user", "content": f"The customer's goal: {s.goal}\n\nThe conversation:\n{lines}\n\n"
                                            f"Question: {rubric}\nAnswer YES or NO."}]
