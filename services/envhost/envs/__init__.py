"""Built-in environments, registered by name in `opentinker.services.envhost.registry`:

| name | data | turns | task |
|---|---|---|---|
| `arith` | free | single | arithmetic (the default training task) |
| `bandit` | free | single | pick an arm of a multi-armed bandit with hidden probabilities |
| `gsm8k` | GSM8K | single | grade-school math, verified by Math-Verify |
| `guess-number` | free | multi | guess a hidden number from higher/lower hints |
| `code-math` | GSM8K or free | multi | math with a sandboxed Python interpreter (tool calls) |
| `geometry3k` | Geometry3K (see below) | single | geometry with a diagram image (vision-language), \\boxed{} answer |
| `geometry3k-tool` | as `geometry3k` | multi | `geometry3k` with a calculator tool (tool calls) |
| `gomoku` | free | multi | gomoku against a built-in opponent |
| `gomoku-duel` | free | multi-agent | gomoku self-play: black and white seats of one policy (`agents = 2`) |
| `negotiation` | free | multi-agent | split a pot by simultaneous demands, self-play (`agents = 2`) |
| `scienceworld` | ScienceWorld (scienceworld package + Java) | multi | text-agent science tasks, one command a turn |
| `alfworld` | ALFWorld ($ALFWORLD_DATA) | multi | household tasks in ALFWorld's text games (TextWorld PDDL) |
| `simulated-user` | free or a scenarios file | multi | help a customer played by a model at an OpenAI-style URL |
| `swe` | 40 generated repos or a SWE-Gym folder | multi | fix an issue with file, edit and test tools (sandboxed) |
| `android-world` | - | - | not served: needs an Android emulator (raises with the reason) |

`geometry3k`'s data: the env arg `data_dir`, else $GEOMETRY3K_DATA, else the sample shipped with the package.
"""
