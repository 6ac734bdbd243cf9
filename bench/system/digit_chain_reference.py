"""Reference: GRPO on the digit chain in one process, plain torch sampling, no system.

Answers one question before any distributed machinery is involved: do the three tiny
agents of flexmarl.controller.tasks.digit_chain learn under plain GRPO with the default job's shape
(queries per step, branch factors, learning rates)? It builds (or reuses) the same cached
models the default job uses, then each step runs the chain with branching, scores every
sample, and takes one Adam step per agent on the whole batch:
advantage = (r - group mean) / (group std + 1e-6), loss = -mean(adv * mean token logprob).

    OMP_NUM_THREADS=1 .venv/bin/python bench/system/digit_chain_reference.py [--steps 30]

Prints the reward of every step, and sampled (temperature 1) and greedy rewards on 256
chain contexts before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from flexmarl.controller.tasks import digit_chain  # noqa: E402
from flexmarl.controller.tasks.digit_chain import CHECKER, PLANNER, SOLVER  # noqa: E402
from flexmarl.workers import models  # noqa: E402

AGENTS = list(digit_chain.AGENTS)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--queries", type=int, default=8, help="queries per step")
    parser.add_argument("--groups", default="4,4,2",
                        help="samples per prompt for planner,solver,checker (branch factors)")
    parser.add_argument("--lr", default="3e-3,2e-3,3e-3", help="planner,solver,checker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default=".cache/models")
    return parser.parse_args()


def load_models(cache: str) -> dict[str, torch.nn.Module]:
    loaded = {}
    for name, recipe in digit_chain.TINY_MODELS.items():
        start = time.perf_counter()
        # The recipes controller.models.resolve_model builds, so the cache is shared.
        path = models.ensure_model(recipe, cache)
        print(f"{name}: ready in {time.perf_counter() - start:.1f}s ({path})", flush=True)
        loaded[name] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return loaded


@torch.no_grad()
def sample(model, prompts: list[list[int]], new_tokens: int, greedy: bool = False) -> list[list[int]]:
    ids = torch.tensor(prompts)  # every prompt of one agent has the same length
    for _ in range(new_tokens):
        logits = model(input_ids=ids).logits[:, -1]
        nxt = logits.argmax(-1) if greedy else torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
        ids = torch.cat([ids, nxt[:, None]], 1)
    return ids[:, len(prompts[0]):].tolist()


def mean_token_logprob(model, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
    taken = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
    return taken[:, len(prompts[0]) - 1:].mean(1)


def prompt_and_reward(name: str, context, output: list[int]) -> tuple[list[int], float]:
    if name == PLANNER:
        return digit_chain.planner_prompt(context), digit_chain.planner_reward(context, output)
    if name == SOLVER:
        return digit_chain.solver_prompt(context), digit_chain.solver_reward(context, output)
    plan, answer = context
    return digit_chain.checker_prompt(plan, answer), digit_chain.checker_reward(plan, answer, output)


def prompt_of(name: str, context) -> list[int]:
    return prompt_and_reward(name, context, [])[0]


def rollout(policy, contexts: dict[str, list], name: str, group: int):
    """group samples for each context; returns contexts, outputs, rewards, all flattened."""
    ctxs = [c for c in contexts[name] for _ in range(group)]
    outs = sample(policy[name], [prompt_of(name, c) for c in ctxs], digit_chain.OUTPUT_LEN[name])
    rewards = [prompt_and_reward(name, c, o)[1] for c, o in zip(ctxs, outs)]
    return ctxs, outs, rewards


def run_chain(policy, queries: list[list[int]], groups: dict[str, int]) -> dict[str, tuple]:
    batches = {}
    batches[PLANNER] = rollout(policy, {PLANNER: queries}, PLANNER, groups[PLANNER])
    plans = batches[PLANNER][1]
    batches[SOLVER] = rollout(policy, {SOLVER: plans}, SOLVER, groups[SOLVER])
    plan_answer = list(zip(batches[SOLVER][0], batches[SOLVER][1]))
    batches[CHECKER] = rollout(policy, {CHECKER: plan_answer}, CHECKER, groups[CHECKER])
    return batches


def evaluate(policy, rng: random.Random, n: int = 256) -> dict[str, tuple[float, float]]:
    """Sampled and greedy mean reward per agent on contexts the current chain produces."""
    queries = [digit_chain.make_query(rng) for _ in range(n)]
    plans = sample(policy[PLANNER], [digit_chain.planner_prompt(q) for q in queries], 3)
    answers = sample(policy[SOLVER], [digit_chain.solver_prompt(p) for p in plans], 6)
    contexts = {PLANNER: queries, SOLVER: plans, CHECKER: list(zip(plans, answers))}
    result = {}
    for name in AGENTS:
        prompts = [prompt_of(name, c) for c in contexts[name]]
        scores = []
        for greedy in (False, True):
            outs = sample(policy[name], prompts, digit_chain.OUTPUT_LEN[name], greedy)
            rewards = [prompt_and_reward(name, c, o)[1] for c, o in zip(contexts[name], outs)]
            scores.append(round(sum(rewards) / n, 3))
        result[name] = tuple(scores)
    return result


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    groups = dict(zip(AGENTS, map(int, args.groups.split(","))))
    lrs = dict(zip(AGENTS, map(float, args.lr.split(","))))
    policy = load_models(args.cache)
    torch.manual_seed(123)
    print("before (sampled, greedy):", evaluate(policy, random.Random(123)), flush=True)

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    optimizers = {n: torch.optim.Adam(m.parameters(), lr=lrs[n]) for n, m in policy.items()}
    start = time.perf_counter()
    for step in range(args.steps):
        batches = run_chain(policy, [digit_chain.make_query(rng) for _ in range(args.queries)], groups)
        line = []
        for name, (ctxs, outs, rewards) in batches.items():
            r = torch.tensor(rewards).view(-1, groups[name])
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
            loss = -(adv * mean_token_logprob(policy[name], [prompt_of(name, c) for c in ctxs],
                                              outs)).mean()
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            line.append(f"{name}={r.mean():.2f}(n={len(rewards)})")
        print(f"step {step:3d} " + " ".join(line) + f" {time.perf_counter() - start:.1f}s",
              flush=True)
    torch.manual_seed(123)
    print("after (sampled, greedy):", evaluate(policy, random.Random(123)), flush=True)


if __name__ == "__main__":
    main()
