"""The coding team's task: one-line Python functions of a digit, specs, planted bugs, and
the rewards, which run model-written code in the sandbox (flexmarl.runtime.sandbox).

A spec is an operation and a digit, `add 3`; its program is a Python expression in `x`
written in the tokens of VOCAB (spaces between them, so the text is the tokens):

    add d  ->  x + d          mod d  ->  x % d
    sub d  ->  x - d          max d  ->  max( x , d )
    mul d  ->  x * d          min d  ->  min( x , d )

The coder reads `spec: add 3 code:` and writes a program; its reward is the pass rate of
held-back tests (the program against the spec on every digit x = 0..9), run in a sandbox,
one program per sandboxed process. A program that does not parse passes nothing.

The tester reads a spec and a program with a planted bug (`spec: max 5 program: max( x ,
6 ) input:`) and writes one digit: the input it bets exposes the bug. Its reward is 1
when the planted program's output on that input, run in the sandbox, differs from the
spec's. Bugs are a constant off by one, a neighbouring operation, or a special case
(`x + 3 if x != 7 else 0`, exposed by 7 alone): where a guess seldom catches the bug,
reading the program does.

Plain Python and the standard library: the controller, the environment workers and the
model builder all import it.
"""

from __future__ import annotations

import json
import random

from flexmarl.runtime.model_specs import SPECIAL_TOKENS
from flexmarl.runtime.sandbox import Limits, run_python

OPS = ("add", "sub", "mul", "mod", "max", "min")
DIGITS = tuple(str(d) for d in range(10))
PROGRAM_TOKENS = ("x", "+", "-", "*", "%", "max(", "min(", ",", ")", "if", "else", "!=")
MARKERS = ("spec:", "code:", "program:", "input:")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + DIGITS + PROGRAM_TOKENS + OPS + MARKERS
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
EOS_ID = TOKEN_ID["<eos>"]
TEST_INPUTS = tuple(range(10))  # the held-back tests: every digit
SPEC_DIGITS = tuple(range(1, 10))  # d of a spec (0 would make x % 0)
LIMITS = Limits(cpu_s=2, wall_s=30, memory_mb=128, processes=2)

# How each operation reads as a program, and what it computes.
PROGRAMS = {"add": "x + {d}", "sub": "x - {d}", "mul": "x * {d}", "mod": "x % {d}",
            "max": "max( x , {d} )", "min": "min( x , {d} )"}
# How often each kind of bug is planted: a special case (exposed by one digit, which the
# program names) most, so a tester that reads the program beats one that guesses.
BUG_WEIGHTS = (0.35, 0.15, 0.5)
NEIGHBOUR = {"add": "sub", "sub": "add", "mul": "add", "mod": "sub", "max": "min", "min": "max"}


def program(op: str, d: int) -> str:
    return PROGRAMS[op].format(d=d)


def reference(op: str, d: int, x: int) -> int:
    return {"add": x + d, "sub": x - d, "mul": x * d, "mod": x % d, "max": max(x, d), "min": min(x, d)}[op]


def all_specs() -> list[tuple[str, int]]:
    return [(op, d) for op in OPS for d in SPEC_DIGITS]


def coder_prompt(op: str, d: int) -> str:
    return f"spec: {op} {d} code:"


def tester_prompt(op: str, d: int, planted: str) -> str:
    return f"spec: {op} {d} program: {planted} input:"


def plant_bug(op: str, d: int, rng: random.Random) -> str:
    """A wrong program for the spec: one that differs from it on at least one digit."""
    while True:
        kind = rng.choices(("constant", "operation", "special"), weights=BUG_WEIGHTS)[0]
        if kind == "constant":
            wrong = program(op, rng.choice([c for c in (d - 1, d + 1) if c in SPEC_DIGITS]))
        elif kind == "operation":
            wrong = program(NEIGHBOUR[op], d)
        else:  # right but at one digit, where it answers another digit
            at = rng.randrange(10)
            right = reference(op, d, at)
            wrong = f"{program(op, d)} if x != {at} else {(right + 1) % 10 if 0 <= right < 10 else 0}"
        if exposing_inputs(op, d, wrong):
            return wrong


def run_program(text: str, x: int) -> int | None:
    """The program's value at x here, trusted code only (the warm-up's planted programs)."""
    try:
        value = eval(f"lambda x: {text}", {"__builtins__": {"max": max, "min": min}})(x)
    except Exception:
        return None
    return value if isinstance(value, int) else None


def exposing_inputs(op: str, d: int, planted: str) -> list[int]:
    return [x for x in TEST_INPUTS if run_program(planted, x) != reference(op, d, x)]


# ---- in the sandbox: what runs there reads its program and inputs from stdin --------

HARNESS = """
import json, sys
job = json.loads(sys.stdin.read())
try:
    f = eval("lambda x: " + job["program"], {"__builtins__": {"max": max, "min": min}})
except SyntaxError:
    print("null")
    sys.exit(0)
out = []
for x in job["inputs"]:
    try:
        value = f(x)
        out.append(value if isinstance(value, int) else None)
    except Exception:
        out.append(None)
print(json.dumps(out))
"""


def sandboxed_values(program_text: str, inputs: list[int]) -> list[int | None] | None:
    """The program's value at each input, computed in the sandbox; None if it does not
    parse, or its process failed or hit a limit."""
    result = run_python(HARNESS, stdin=json.dumps({"program": program_text, "inputs": inputs}), limits=LIMITS)
    if not result.ok:
        return None
    return json.loads(result.stdout)


# ---- the rewards (each runs on an environment worker: ctx.call) ---------------------

def pass_rate(op: str, d: int, program_text: str) -> float:
    """The coder's reward: the share of held-back tests its program passes."""
    values = sandboxed_values(program_text.strip(), list(TEST_INPUTS))
    if values is None:
        return 0.0
    return sum(v == reference(op, d, x) for v, x in zip(values, TEST_INPUTS)) / len(TEST_INPUTS)


def catches(op: str, d: int, planted: str, inputs: list[str]) -> list[float]:
    """The tester's rewards: for each input it wrote, 1 if the planted program's output
    there (in the sandbox) differs from the spec's."""
    digits = [int(t) if t.strip() in DIGITS else None for t in (i.strip() for i in inputs)]
    values = sandboxed_values(planted, [x for x in digits if x is not None]) or []
    found = iter(values)
    rewards = []
    for x in digits:
        if x is None:
            rewards.append(0.0)
            continue
        value = next(found, None)
        rewards.append(float(value != reference(op, d, x)))
    return rewards


def ids(text: str) -> list[int]:
    return [TOKEN_ID[t] for t in text.split()]
